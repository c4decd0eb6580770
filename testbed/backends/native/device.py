"""Run a native benchmark-and-dump program on a device: push it and its .npy inputs, run it, pull its
.npy outputs and its timings, then compare on the host.

The program contract (kernels/bench/'s benchmark-and-dump programs follow it):
  cwd        a fresh run folder (runs/ID) holding the inputs as NAME.npy; the program itself is
             pushed once per content to bin/SHA/NAME
  argv       the program followed by the job's args; kernels/bench programs take IN_DIR OUT_DIR first,
             which are both the run folder: args=[".", ".", "form=chunkwise", "reps=5", ...]. An arg
             "{inputs}" instead stages the inputs once per content in inputs/SHA/ and names that
             folder: an oracle matrix runs each case's inputs through several forms, pushed once.
  writes     each output as NAME.npy (of the shape the job expects, where it says) and `timings.json`
             in the run folder:
             {"seconds": [one per timed repetition...], ...whatever else the program records}
  exit 0     on success; anything else is a failed run, reported with its stderr
  counts     on a device whose profile has the capability `counts` (the emulated ones: qemu-user runs
             every program under testbed's counting plugin), the instructions of each timed call,
             from the plugin's file in the run folder; with `NativeJob.count` on the host, the program
             runs under valgrind's callgrind instead (testbed.measure.counts; `count_instructions`
             runs a job once more so, with the host's build valgrind can run). A count that was due and
             is missing or does not match the timed calls is an error, never a silent gap; a program
             that marks no timed region on a counting device has its result and evidence say
             "not counted: ..." (`NativeResult.uncounted`), never nothing.

Nothing here trusts "it ran": a non-zero exit and outputs that are missing or unreadable are errors
(the caller's oracle judges the values), and a run that fails is never retried (it is a measurement
and may have effects).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from testbed.backends import Evidence
from testbed.backends.native.build import ELF_MACHINE_NAMES, build_info
from testbed.devices import CommandResult, Device
from testbed.devices.transport import elf_machine, quoted, sha256_file
from testbed.errors import DeviceError, UsageError
from testbed.measure import counts as counting
from testbed.results import Figure


@dataclass
class NativeJob:
    program: Path
    inputs: dict[str, np.ndarray]
    outputs: list[str]
    args: list[str] = field(default_factory=list)
    timeout: float | None = None
    measured: bool = True  # under the profile's health discipline (cool-down, warm-up, throttle flag)
    count: bool = False    # on a device that does not count by itself (the host): run under valgrind
    # what each output's shape must be (None: any size on that axis); one that is not (a stale or cut
    # output file) fails the run, as a device operation, instead of reaching an oracle
    shapes: dict[str, tuple[int | None, ...]] = field(default_factory=dict)


@dataclass
class Call:
    """One measured call of an experiment: a benchmark-and-dump program on its inputs (what `testbed ab`
    measures on both source trees, testbed.lab.ab)."""

    label: str                  # the case, e.g. "H=16,hs=128,T=512,kda=0/chunkwise"
    program: str                # its name in a build folder (tb_gdn_bench)
    inputs: dict[str, np.ndarray]
    args: list[str]             # the program's arguments, reps=1 (one timed call per run)
    outputs: list[str]
    work: dict = field(default_factory=dict)


@dataclass
class NativeResult:
    outputs: dict[str, np.ndarray]
    timings: dict[str, Any]
    command: CommandResult
    health: dict[str, Any] = field(default_factory=dict)  # for the record's metrics
    evidence: Evidence | None = None
    counts: counting.Counts | None = None  # instructions of each timed call, where they were counted
    uncounted: str | None = None  # why a count that was due is absent ("not counted: ..."), else None

    def figure(self, unit_scale: float = 1.0, unit: str = "s") -> Figure:
        """The program's own per-repetition times as a Figure (median/min/max/reps)."""
        samples = self.timings.get("seconds") or []
        if not samples:
            raise DeviceError("the program reported no timing samples (timings.json has no \"seconds\")")
        return Figure.of([s * unit_scale for s in samples], unit)


class NativeRunFailed(DeviceError):
    """The program ran and failed, or left outputs that cannot be read."""


@lru_cache(maxsize=64)
def _digest(path: Path, mtime_ns: int, size: int) -> str:
    return sha256_file(path)


def program_digest(program: Path) -> str:
    st = program.stat()
    return _digest(program, st.st_mtime_ns, st.st_size)


def program_identity(program: Path) -> dict:
    """What the pushed bytes are: the ELF machine of the program (the file whose sha256 the evidence
    names) and the toolchain that built it (its build folder's build.json), where known."""
    machine = elf_machine(program)
    info = build_info(program)
    # kernels/' build.json holds the toolchain's fields at its top; llama.cpp's, under "toolchain"
    toolchain = info.get("toolchain") if isinstance(info.get("toolchain"), dict) else {
        k: info[k] for k in ("toolchain", "compiler", "target", "libc") if k in info}
    return ({"elf_machine": machine, "elf_machine_name": ELF_MACHINE_NAMES.get(machine, "unknown")}
            if machine is not None else {}) | ({"toolchain": toolchain} if toolchain else {}) | (
        # what ran: a FUSED=1 build on a target without FMA computes unfused (build.multiply_add)
        {"multiply_add": info["multiply_add"]} if "multiply_add" in info else {})


def runner_prefix(device: Device) -> list[str]:
    """What starts a program on the device: nothing, or on a Hexagon device whose profile names the
    vendor SDK's runner (tools.hexagon_runner, e.g. "run_main_on_hexagon 3"), that runner."""
    import shlex

    runner = device.profile.tools.get("hexagon_runner") if device.profile.abi == "hexagon" else None
    return shlex.split(runner) if runner else []


def stage_program(device: Device, program: Path) -> str:
    """The program's path on the device, pushed once per content: bin/SHA/NAME is reused while the
    device still holds those exact bytes (checked by size and sha256 on the device)."""
    digest = program_digest(program)
    remote = f"bin/{digest[:16]}/{program.name}"
    if device.transport.remote_digest(remote) != (program.stat().st_size, digest):
        device.push(program, remote, mode=0o755)
    return remote


def stage_folder(device: Device, folder: Path) -> str:
    """models/SHA/ holding the folder's files (its top level: a Hugging Face folder's config.json, weights and
    tokenizer), pushed once per content as stage_inputs pushes inputs; a file the device holds with the same
    size and sha256 is not pushed again."""
    files = {p.name: p for p in sorted(Path(folder).iterdir()) if p.is_file()}
    if not files:
        raise UsageError(f"{folder}: the model folder holds no files")
    digests = {name: sha256_file(path) for name, path in files.items()}
    h = hashlib.sha256()
    for name in files:
        h.update(name.encode() + b"\0" + digests[name].encode())
    remote = f"models/{h.hexdigest()[:20]}"
    held = device.transport.remote_digests([f"{remote}/{name}" for name in files])
    for name, path in files.items():
        if held.get(f"{remote}/{name}") != (path.stat().st_size, digests[name]):
            device.push(path, f"{remote}/{name}")
    return remote


def stage_inputs(device: Device, inputs: dict[str, np.ndarray], tmp: Path) -> str:
    """inputs/SHA/ holding NAME.npy for each input, pushed once per content: a file is reused while the
    device still holds its exact bytes (size and sha256 checked on the device, all in one command, as
    programs are), and pushed again otherwise (missing, cut, or changed on the device)."""
    files = {}
    for name, array in sorted(inputs.items()):
        files[name] = tmp / f"{name}.npy"
        np.save(files[name], np.ascontiguousarray(array))
    digests = {name: sha256_file(path) for name, path in files.items()}
    h = hashlib.sha256()
    for name in files:
        h.update(name.encode() + b"\0" + digests[name].encode())
    folder = f"inputs/{h.hexdigest()[:20]}"
    remote = {name: f"{folder}/{name}.npy" for name in files}
    held = device.transport.remote_digests(list(remote.values()))
    for name, path in files.items():
        if held.get(remote[name]) != (path.stat().st_size, digests[name]):
            device.push(path, remote[name])
    return folder


class WrongMachine(NativeRunFailed):
    """The program is an ELF for another machine than the device's ABI runs: under qemu-user a host
    program would run natively and its outputs be filed under the device's name."""


def check_machine(device: Device, program: Path) -> None:
    from testbed.devices.profile import ELF_MACHINE_FOR_ABI

    expected = ELF_MACHINE_FOR_ABI.get(device.profile.abi)
    machine = elf_machine(program)
    if expected is not None and machine is not None and machine != expected:
        raise WrongMachine(f"{device.name}: {program.name} ({program.parent.name}) is an ELF for machine {machine} "
                           f"({ELF_MACHINE_NAMES.get(machine, 'unknown')}), not for the device's ABI "
                           f"{device.profile.abi} ({expected}); refused: it would not compute on the device")


def pull_dumps(device: Device, run_dir: str, due: int, tmp: Path) -> list[str]:
    """callgrind's dumps in the run folder: the `due` ones, and one more if there is one (which already
    says the marks were not what the program claims: parse_callgrind_dumps refuses it)."""
    remotes = [f"{run_dir}/{counting.CALLGRIND_FILE}.{i}" for i in range(1, due + 2)]
    held = device.transport.remote_digests(remotes)
    dumps = []
    for i, remote in enumerate(remotes, 1):
        if i > due and held.get(remote) is None:
            break
        device.pull(remote, tmp / f"cg.{i}")  # a due dump that is missing fails here, named
        dumps.append((tmp / f"cg.{i}").read_text())
    return dumps


def run_native(device: Device, job: NativeJob) -> NativeResult:
    check_machine(device, job.program)
    run_dir = f"runs/{secrets.token_hex(6)}"
    try:
        with tempfile.TemporaryDirectory(prefix="testbed-native-") as tmp:
            tmp = Path(tmp)
            program = stage_program(device, job.program)
            args = list(map(str, job.args))
            if "{inputs}" in args:
                shared = f"../../{stage_inputs(device, job.inputs, tmp)}"
                args = [shared if a == "{inputs}" else a for a in args]
                device.run(["mkdir", "-p", run_dir], timeout=60)  # it holds the outputs only
            else:
                for name, array in job.inputs.items():
                    local = tmp / f"{name}.npy"
                    np.save(local, np.ascontiguousarray(array))
                    device.push(local, f"{run_dir}/{name}.npy")
            argv = [*runner_prefix(device), f"../../{program}", *args]
            valgrind = job.count and not device.profile.has("counts")
            if valgrind:
                argv = counting.valgrind_argv(argv)

            def once():
                return device.run(argv, timeout=job.timeout, cwd=run_dir)

            result, health = device.measured(once) if job.measured else (once(), {})
            if result.returncode != 0:
                raise NativeRunFailed(f"{device.name}: {job.program.name} exited {result.returncode}: "
                                      f"{(result.stderr or result.stdout).strip()[-300:]}")
            outputs = {}
            for name in job.outputs:
                local = tmp / f"{name}.npy"
                device.pull(f"{run_dir}/{name}.npy", local)
                try:
                    outputs[name] = np.load(local, allow_pickle=False)
                except ValueError as e:
                    raise NativeRunFailed(f"{device.name}: output {name}.npy is not a valid .npy file: {e}") from None
                want = job.shapes.get(name)
                got = outputs[name].shape
                if want is not None and (len(got) != len(want) or any(w not in (None, g) for w, g in zip(want, got))):
                    shown = "(" + ", ".join("*" if w is None else str(w) for w in want) + ")"
                    raise NativeRunFailed(f"{device.name}: {job.program.name} wrote {name}.npy of shape {got}, "
                                          f"expected {shown}: a stale or cut output")
            device.pull(f"{run_dir}/timings.json", tmp / "timings.json")
            try:
                timings = json.loads((tmp / "timings.json").read_text())
            except json.JSONDecodeError as e:
                raise NativeRunFailed(f"{device.name}: timings.json is not JSON: {e}") from None
            seconds = timings.get("seconds") or []
            # one list of repetitions, or one per timed operation (tb_cache_bench)
            samples = [x for v in seconds.values() for x in v] if isinstance(seconds, dict) else seconds
            # a program that marks its timed regions names them ("marks", per repetition)
            marks = tuple(timings.get("marks") or ())
            marked = len(marks) * int(timings.get("reps") or 0)
            counts, uncounted = None, None
            if not marks and device.profile.has("counts"):  # due, and nothing marked to count: said, not silent
                uncounted = (f"not counted: {job.program.name} marks no timed region (only the harness's "
                             "tb_count_begin/tb_count_end marks are counted)")
            try:
                if marks and device.profile.has("counts"):
                    device.pull(f"{run_dir}/{counting.COUNTS_FILE}", tmp / "counts.json")
                    counts = counting.parse_plugin_output((tmp / "counts.json").read_text(), marked, marks)
                elif valgrind:
                    if not marks:
                        raise NativeRunFailed(f"{job.program.name} marks no timed region: nothing for valgrind to count")
                    counts = counting.parse_callgrind_dumps(pull_dumps(device, run_dir, 2 * marked, tmp), marked, marks)
            except counting.CountError as e:
                raise counting.CountError(f"{device.name}: {job.program.name}: {e}") from None
            evidence = Evidence(device.name, job.program.name, program_digest(job.program), quoted(argv),
                                float(sum(samples)) if samples else None,
                                {"timed_calls": len(samples), "cpu_seconds": sum(timings.get("cpu_seconds") or []),
                                 "clock": "the program's CLOCK_MONOTONIC on the device",
                                 # the whole command as the host saw it: process start, input load,
                                 # warm-up, output write and the link, around the timed kernel calls
                                 "command_seconds": result.seconds}
                                # what kind of program the pushed bytes are (runner.check_evidence)
                                | program_identity(job.program)
                                | ({"instructions": counts.metadata()} if counts else {})
                                | ({"instructions": uncounted} if uncounted else {}))
            return NativeResult(outputs, timings, result, health, evidence, counts, uncounted)
    finally:
        try:
            device.run(["rm", "-rf", run_dir], timeout=60)
        except Exception:  # noqa: BLE001 -- cleanup must not hide the run's own error
            pass


def count_instructions(device: Device, job: NativeJob) -> counting.Counts:
    """The instructions of `job`'s timed calls: on a device that counts by itself, from one run as it is;
    elsewhere (the host) from one more run under valgrind, never a timed one, of the same program from
    the build valgrind can run (the host's without AVX-512, testbed.backends.native.build.valgrind_program)."""
    from testbed.backends.native.build import valgrind_program

    counting_device = device.profile.has("counts")
    program = job.program if counting_device else valgrind_program(job.program)
    result = run_native(device, dataclasses.replace(job, program=program, measured=False, count=not counting_device))
    if result.counts is None:
        raise counting.CountError(f"{device.name}: {job.program.name}: "
                                  f"{result.uncounted or 'no count came back from a run that asked for one'}")
    return result.counts
