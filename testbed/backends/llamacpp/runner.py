"""llama.cpp's tools on a device: test-backend-ops (test and perf modes) and llama-bench, into records.

The tools are either where the profile's `tools` say (a phone prepared by hand), or built from source
for the device's ABI by testbed.backends.llamacpp.build and pushed once per content (`resolve_tools`).
The backend (`-b`) defaults to the profile's `accelerators.backend` (HTP0 on the Hexagon phone).
Verdicts follow testbed.backends.llamacpp.output: a run that did not finish, or whose counts disagree,
is an error record, never a pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from testbed.backends import Evidence
from testbed.backends.iree.device import tool
from testbed.backends.llamacpp import build as builder
from testbed.backends.llamacpp import output as out
from testbed.backends.native.build import ELF_MACHINE_NAMES
from testbed.backends.native.device import runner_prefix, stage_program
from testbed.devices import CommandResult, Device
from testbed.devices.transport import quoted
from testbed.errors import DeviceError, UsageError
from testbed.results import Figure, Record

BUILD = ("auto", True, False)


@dataclass
class Tools:
    """Where llama.cpp's programs are on a device: built and pushed by testbed (`built` says what
    built them), or else the profile's `tools`."""

    device: Device
    paths: dict[str, str]
    built: builder.Built | None = None

    def path(self, name: str) -> str:
        return self.paths[name] if self.built else tool(self.device, name)

    def artifacts(self) -> dict:
        if self.built is None:
            return {"tools": "the profile's"}
        return {"llamacpp_source_sha256": self.built.source_hash, "llamacpp_source": self.built.info["source"],
                "build_target": self.built.target}


def profile_tools(device: Device) -> Tools:
    return Tools(device, {})


def wants_build(build, profile_names_tools: bool) -> bool:
    """build: "auto" builds when the profile names no tools; True always builds; False never does."""
    if build not in BUILD:
        raise UsageError(f"llamacpp.build={build!r} is not accepted; accepted: auto, true, false")
    return build is True or (build == "auto" and not profile_names_tools)


def resolve_tools(device: Device, build, source: str, programs: tuple[str, ...],
                  progress: Callable[[str], None] = lambda m: None) -> Tools:
    """The profile's tools, or `programs` built for the device (see testbed.backends.llamacpp.build)
    and pushed to it once per content (bin/SHA/NAME in its work folder)."""
    if not wants_build(build, bool(device.profile.tools.get("test-backend-ops"))):
        return profile_tools(device)
    profile = device.profile
    built = builder.build(builder.target_for(profile.name, profile.abi, profile.capabilities), source, programs,
                          progress)
    paths = {}
    for name in programs:
        progress(f"pushing {name} to {device.name} (once per content)")
        paths[name] = str(device.transport.path(stage_program(device, built.program(name))))
    return Tools(device, paths, built)


def elf_machine_on_device(device: Device, path: str) -> dict:
    """The ELF machine of a file as the device reads it (bytes 18-19 of its header); {} for a file that
    is not an ELF (a script has no machine: the evidence check then says what kind of program ran is
    unknown), or one the device cannot read."""
    r = device.run(["od", "-An", "-tu1", "-N20", path], timeout=60)
    try:
        header = [int(x) for x in r.stdout.split()]
    except ValueError:
        return {}
    if len(header) < 20 or header[:4] != [0x7F, ord("E"), ord("L"), ord("F")]:
        return {}
    machine = header[18] | header[19] << 8
    return {"elf_machine": machine, "elf_machine_name": ELF_MACHINE_NAMES.get(machine, "unknown")}


def evidence(device: Device, argv: list[str], result: CommandResult, tools: Tools | None = None) -> list[dict]:
    """What ran on the device: the tool's sha256 and ELF machine read there, the command, the command's
    duration (llama.cpp's tools time their own work; this is the whole run, as the link saw it), and
    the toolchain that built it when testbed did."""
    program = argv[len(runner_prefix(device))]
    digest = device.run(["sha256sum", program], timeout=120)
    sha = digest.stdout.split()[0] if digest.returncode == 0 and digest.stdout.split() else "unreadable"
    built = {"toolchain": tools.built.info.get("toolchain")} if tools and tools.built and tools.built.info.get(
        "toolchain") else {}
    return [Evidence(device.name, program.rsplit("/", 1)[-1], sha, quoted(argv), result.seconds,
                     {"clock": "the command's duration seen through the transport"}
                     | elf_machine_on_device(device, program) | built).as_dict()]


def harness_argv(tools: Tools, mode: str, op: str, backend: str, cases: str) -> list[str]:
    """test-backend-ops MODE -o OP -b BACKEND [-p CASES] (CASES: a regex over the case parameters)."""
    return [*runner_prefix(tools.device), tools.path("test-backend-ops"), mode, "-o", op, "-b", backend] + (
        ["-p", cases] if cases else [])


def test_backend_ops(device: Device, op: str, backend: str, tools: Tools | None = None, cases: str = "",
                     timeout: float | None = None) -> tuple[out.TboReport, list[str]]:
    """Run test mode; returns the parsed report and every reason it may not be read as a pass."""
    argv = harness_argv(tools or profile_tools(device), "test", op, backend, cases)
    result = device.run(argv, timeout)
    report = out.parse_test(result.stdout)
    report.evidence = evidence(device, argv, result, tools)
    problems = report.problems()
    if result.returncode != 0:
        problems.append(f"test-backend-ops exited {result.returncode}: {result.stderr.strip()[-200:]}")
    return report, problems


def test_records(experiment: str, op: str, backend: str, report: out.TboReport, problems: list[str]) -> list[Record]:
    """One oracle record per case, then the run's tally ('36/36 OK') as its own verdict."""
    records = []
    for case in report.tested:
        verdict = "pass" if case.status == "OK" else "fail"
        margin = None if case.nmse is None else case.threshold - case.nmse
        records.append(Record(experiment, f"{case.name}/{backend}", "oracle", "test-backend-ops", verdict, margin,
                              {"nmse": case.nmse} if case.nmse is not None else {},
                              params={"op": op, "backend": backend, "params": case.params}, detail=case.detail,
                              evidence=report.evidence))
    finished = report.summary is not None and report.final is not None
    verdict = "pass" if not problems else ("fail" if finished else "error")
    records.append(Record(experiment, f"{op}/{backend}/tally", "oracle", "test-backend-ops", verdict, None,
                          {"tally": report.tally(), "passed": report.passed, "tested": len(report.tested),
                           "unsupported": len(report.cases) - len(report.tested)},
                          params={"op": op, "backend": backend}, detail="; ".join(problems), evidence=report.evidence))
    return records


def perf_records(device: Device, experiment: str, op: str, backend: str, tools: Tools | None = None,
                 cases: str = "", timeout: float | None = None) -> list[Record]:
    """Perf mode under the profile's health discipline (cool-down, warm-up, throttling flag). Each
    case runs for about a second of a real CPU's time: under emulation, select a few with `cases`."""
    argv = harness_argv(tools or profile_tools(device), "perf", op, backend, cases)
    result, health = device.measured(lambda: device.run(argv, timeout))
    try:
        rows = out.parse_perf(result.stdout)
    except out.Unreadable as e:
        raise DeviceError(f"{device.name}: test-backend-ops perf -o {op} -b {backend}: {e}") from None
    if result.returncode != 0 or not rows:
        raise DeviceError(f"{device.name}: test-backend-ops perf -o {op} -b {backend} exited {result.returncode} "
                          f"with {len(rows)} result lines: {result.stderr.strip()[-200:]}")
    records, ran = perf_rows_records(experiment, backend, rows, health), evidence(device, argv, result, tools)
    for r in records:
        r.evidence = ran
    return records


def perf_rows_records(experiment: str, backend: str, rows: list[out.Perf], health: dict | None = None) -> list[Record]:
    """Perf-mode rows as measure records (also for output produced elsewhere: `testbed ingest`)."""
    health = health or {}
    records = []
    for row in rows:
        us = Figure(row.us_per_run, row.us_per_run, row.us_per_run, row.runs, "us")  # the tool reports a mean
        figures = {"time": us}
        if row.gbps is not None:
            figures["bandwidth"] = Figure(row.gbps, row.gbps, row.gbps, row.runs, "GB/s")
        records.append(Record(experiment, f"{row.name}/{backend}/perf", "measure", figures=figures, metrics=health,
                              work={f"per_run_{row.per_run_unit}": row.per_run, "runs": row.runs,
                                    "what": "test-backend-ops perf: mean over its runs"},
                              params={"op": row.op, "backend": backend, "params": row.params}))
    return records


def llama_bench_records(device: Device, experiment: str, model: str, prompt: int, threads: int, reps: int,
                        tools: Tools | None = None, extra: list[str] = (), timeout: float | None = None) -> list[Record]:
    argv = [*runner_prefix(device), (tools or profile_tools(device)).path("llama-bench"), "-m", model, "-p", str(prompt), "-n", "0", "-t", str(threads),
            "-r", str(reps), "-o", "json", *extra]
    result, health = device.measured(lambda: device.run(argv, timeout))
    if result.returncode != 0:
        raise DeviceError(f"{device.name}: llama-bench exited {result.returncode}: {result.stderr.strip()[-300:]}")
    ran = evidence(device, argv, result, tools)
    return [Record(experiment, f"{row.test}/t{threads}", "measure", figures={"tokens_per_s": row.figure()},
                   metrics=health,
                   work={"tokens": prompt, "what": f"llama-bench {row.test}: prompt tokens per second"},
                   params={"model": model, "threads": threads, "test": row.test, "backend": row.backend},
                   evidence=ran)
            for row in out.parse_bench(result.stdout)]
