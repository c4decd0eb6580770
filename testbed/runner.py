"""Run one configured experiment on its device and store its records.

The store is checked before anything runs (testbed.results: writable, with room). The run is stored
as it goes: a "started" mark, each record as soon as the experiment yields it, then an "ended" mark.
A run that fails or is interrupted (Ctrl-C, SIGTERM, SIGHUP: testbed.cli turns them into
`Interrupted`) stores one more record, verdict "error" with what happened, and ends "broke"; one
killed outright has no end mark. Either way what it measured is kept, and read back as incomplete.

A record's `device` is the machine that computed it. So before anything runs, a backend the device
cannot run is refused (refimpl runs only on the host); and every record of a run on any device but
the host must carry evidence that the device ran it (testbed.backends.Evidence: what ran, its sha256,
the command, the device's own time) before it is stored, or the run breaks there. Records of a
profile with capability `emulated` (qemu-user, the loopback adbd, lavapipe) say so: real for
correctness, never for speed. Each record carries the host's load so far (noisy when it exceeded the
cores).
"""

from __future__ import annotations

import math
import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import pandas as pd

from testbed import backends, experiments
from testbed.config import RunConfig, check_params, results_path
from testbed.devices import Device, connect, load_profile
from testbed.devices.profile import Profile
from testbed.errors import DeviceError
from testbed.heartbeat import Lasting, saying
from testbed.report import tables
from testbed.results import Record, ResultsStore, RunInfo, running
from testbed.stop import STOP, STOP_SIGNAL, Interrupted, raise_if_stopped  # noqa: F401 -- used as runner.X
from testbed.verdicts import LABEL, PASS, UNJUDGED, Tally


# Interrupted, STOP and raise_if_stopped live in testbed.stop (the transports check them too).
# The main thread is interrupted by the handler itself, except while it stores (`storing`: a record
# half-handled would be stored yet uncounted); runs in worker threads (testbed nightly) and a deferred
# main thread see STOP after each record, between repetitions and while waiting for a device's command,
# and stop the same way.
# Every run this process started, by id, with where it got to: "running" (its started mark is stored),
# "complete", "broke" or "broken by a signal" (each stored with its end mark). What the CLI says was
# stored when a signal stops it (`stored_so_far`): a nightly may have completed runs before the one the
# signal broke, and a worker still inside one long call leaves its run without an end mark.
RUNS: dict[str, str] = {}
REACHED: dict[str, str] = {}  # a run that broke: the verdicts it had reached ("13 pass, 1 fail"), said with it
_storing = threading.local()


def stop_on_signals() -> None:
    """Turn SIGINT, SIGTERM and SIGHUP into `Interrupted`, so a run stores what happened before it exits."""

    def handler(signum, frame):
        STOP_SIGNAL[:] = [signum]
        STOP.set()
        if not getattr(_storing, "now", False):  # the handler runs in the main thread: its flag
            raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


@contextmanager
def storing():
    """A stretch a signal may not cut: it is acted on right after (raise_if_stopped)."""
    _storing.now = True
    try:
        yield
    finally:
        _storing.now = False


def results_store(rc: RunConfig) -> ResultsStore:
    # read again here, not only when composing: a lab's worker runs a job composed elsewhere in its own store
    return ResultsStore(results_path(rc.cfg.results_dir))


def check(rc: RunConfig):
    """Everything that can be checked before running: parameters, the backend against the device,
    cross-parameter rules, the profile."""
    module = experiments.load(rc.experiment)
    check_params(rc.cfg, module.PARAMS, rc.origin)
    profile = load_profile(rc.device)
    # The profile as composed, with the run's device.* overrides and additions, is checked as a profile
    # file is: `+device.foo=1` reads nothing, and a typo there must not pass unseen.
    Profile.from_config(rc.cfg.device, f"device={rc.device} as composed for this run")
    backend = rc.cfg.get("backend")
    if backend in backends.names():
        backends.refuse_mismatch(backend, rc.device, rc.cfg.device.get("capabilities"))
    if backend == "native":
        check_native_tools(profile, counted=bool(rc.cfg.get("counts")))
    if backend == "engine" and rc.cfg.get("engine"):  # built for this device, its prebuilt program there
        from testbed.backends.engine import build as engine_build, spec as engine_spec

        engine_build.check_device(engine_spec.load(rc.cfg.engine), profile)
    if hasattr(module, "validate"):
        module.validate(rc.cfg)
    return module, profile


def check_native_tools(profile, counted: bool) -> None:
    """backend=native builds its programs on this host before anything runs, and counts=true on the host
    runs them once more under valgrind: a missing tool (zig after a bootstrap without the cross extra, a
    cross gcc, valgrind) is said now (ToolMissing, exit 3), before a run is stored, not as a broken run."""
    from testbed.backends.native.build import BuildError, ToolMissing, default_toolchain, target_for_abi, \
        toolchain_identity
    from testbed.measure.counts import valgrind_argv

    try:
        target = target_for_abi(profile.abi)
        toolchain_identity(target, default_toolchain(target))
    except ToolMissing:
        raise
    except BuildError:
        pass  # not a missing tool: the build itself says what is wrong, in the run
    if counted and profile.transport == "local":
        valgrind_argv([])


class ComputedElsewhere(DeviceError):
    """A record of a run on a device carries no evidence that the device computed it."""


def check_evidence(records: list[Record], profile) -> None:
    """Every record of a device run carries evidence, and each piece says what kind of program ran: a
    program's ELF machine (elf_machine), which must be the one of the profile's ABI
    (testbed.devices.profile.ELF_MACHINE_FOR_ABI), or an IREE module's executable formats
    (module_formats), which must hold the device's. A host program under the qemu transport runs
    natively: without this, a build for the wrong target computes on the host and passes."""
    if profile.transport == "local" and not profile.has("emulated"):
        return  # the host itself: what ran here ran on the host
    # a refusal or a verdict not judged claims nothing was computed: it needs no evidence (what it has is checked)
    bare = [r.case for r in records if not r.evidence and not (r.kind == "oracle" and r.verdict in UNJUDGED)]
    if bare:
        raise ComputedElsewhere(f"{len(bare)} record(s) of a run on device {profile.name} carry no evidence that "
                                f"the device computed them (first: {bare[0]}); nothing computed on the host is "
                                f"stored under a device's name")
    for r in records:
        for ran in r.evidence:
            problem = wrong_kind(ran, profile)
            if problem:
                raise ComputedElsewhere(f"{r.case}: {ran.get('ran')} (sha256 {str(ran.get('sha256'))[:16]}) {problem}; "
                                        f"it did not compute on device {profile.name}")


def wrong_kind(ran: dict, profile) -> str | None:
    """Why this evidence does not show a program for the device's kind (None: it does)."""
    from testbed.backends.native.build import ELF_MACHINE_NAMES
    from testbed.devices.profile import elf_machine_for

    detail = ran.get("detail") if isinstance(ran.get("detail"), dict) else {}
    if "module_formats" in detail:
        from testbed.backends.iree.device import module_format_for

        want = module_format_for(profile)
        formats = detail["module_formats"] or []
        return None if want in formats else f"is a module for {', '.join(map(str, formats)) or 'nothing known'}, " \
                                            f"not {want} (device {profile.name}: {profile.abi})"
    machine, want = detail.get("elf_machine"), elf_machine_for(profile.abi)
    if want is None:
        return f"cannot be checked: ABI {profile.abi} has no ELF machine in testbed.devices.profile.ELF_MACHINE_FOR_ABI"
    if machine is None:
        return "does not say what kind of program ran (no ELF machine or module format in its evidence)"
    if machine != want:
        return (f"is an ELF for machine {machine} ({ELF_MACHINE_NAMES.get(machine, 'unknown')}), not "
                f"{want} ({ELF_MACHINE_NAMES.get(want, 'unknown')}) of ABI {profile.abi}")
    return None


@dataclass
class Outcome:
    info: RunInfo
    rows: list[dict]

    def frame(self) -> pd.DataFrame:
        return pd.json_normalize(self.rows, sep=".") if self.rows else pd.DataFrame()

    @property
    def tally(self) -> Tally:
        """Its oracle verdicts by state (testbed.verdicts): what its exit status and summary say."""
        return Tally.of_records(self.rows)

    @property
    def failed(self) -> int:
        """Its verdicts that fail or err (a refusal or a verdict not judged is neither)."""
        return self.tally.failed


def host_load(before: dict | None = None) -> dict:
    """The 1-minute load average and the cores; with `before`, the run's worst of both readings and
    whether it was noisy: more runnable tasks than cores means measurements shared the CPUs (on a
    device run too: the host drives the transport and, under emulation, computes)."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if before is None:
        return {"load_1m_before": load, "cores": cores}
    worst = max(before["load_1m_before"], load)
    return {**before, "load_1m_after": load, "noisy": worst > cores}


def backend_label(cfg) -> str:
    """The records' backend: its name, and for backend=engine the engine's (engine:NAME), so two engines
    stay apart in tables, sweeps and the report."""
    backend = str(cfg.get("backend", "refimpl"))
    return f"engine:{cfg.get('engine')}" if backend == "engine" else backend


def _store_as_they_come(records, profile, info: RunInfo, store: ResultsStore, rows: list[dict], load_before: dict,
                        progress) -> None:
    """Each record as the experiment yields it: checked for evidence, stamped, stored, kept in `rows`;
    an oracle's verdict said through `progress` at once, before the run goes on."""
    for record in records:
        check_evidence([record], profile)
        info.host_load = host_load(load_before)
        row = info.stamp(record)
        with storing():
            store.append([row])
            rows.append(row)
        if row["kind"] == "oracle":  # said the moment it is decided, before whatever the run does next
            progress(Lasting(verdict_line(row)))
        raise_if_stopped()


def execute(rc: RunConfig, progress=lambda msg: None, device: Device | None = None, produce=None) -> Outcome:
    """Run the experiment (or `produce(cfg, ctx)`, another source of its records: testbed ab) and store
    its records as they come."""
    module, profile = check(rc)
    store = results_store(rc)
    store.check_writable()
    device = device or connect(profile)
    info = RunInfo(
        experiment=rc.experiment, device=rc.device, backend=backend_label(rc.cfg),
        config=rc.flat(), fingerprint=device.fingerprint(), emulated=profile.has("emulated"),
    )
    ctx = experiments.Context(device=device, progress=progress)
    load_before = host_load()
    rows: list[dict] = []
    with storing():
        store.append([info.mark("started")])
        RUNS[info.run_id] = "running"
    try:
        raise_if_stopped()
        # the first step named at once: what a heartbeat says until the experiment says more (a model to
        # build, programs to compile)
        progress(f"{rc.experiment} on {rc.device} ({info.backend}): starting")
        # a build deep in a backend says so through this run's progress; an engine's failing requests are kept
        # for this run
        with saying(progress), running(store.root, info.run_id):
            _store_as_they_come((produce or module.run)(rc.cfg, ctx), profile, info, store, rows, load_before,
                                progress)
    except BaseException as e:  # noqa: BLE001  -- signals included: the store must say the run broke
        if isinstance(e, KeyboardInterrupt):
            what = "interrupted"
        elif isinstance(e, Interrupted):
            what = str(e)
        else:
            what = f"{type(e).__name__}: {e}"
        with storing():
            # what the failing call ran (an engine that crashed: its program, sha256, command and kept request)
            evidence = list(getattr(e, "evidence", None) or [])
            store.append([info.stamp(Record(rc.experiment, "run", "oracle", "run", "error", None,
                                            {"records_before_error": len(rows)}, detail=what, evidence=evidence)),
                          info.mark("ended", "broke")])
            RUNS[info.run_id] = "broken by a signal" if isinstance(e, (KeyboardInterrupt, Interrupted)) else "broke"
            REACHED[info.run_id] = Tally.of_records(rows).phrase()
        raise
    with storing():  # a signal now finds the run complete; the next run (of a sweep) stops at its start
        store.append([info.mark("ended", "complete")])
        RUNS[info.run_id] = "complete"
    return Outcome(info, rows)


def verdict_line(row: dict) -> str:
    """An oracle's verdict as progress says it the moment it is decided, in one line: the verdict,
    experiment, case and oracle, the device and the engine (the backend), the margin, and for any verdict but a
    pass why (the progress line cuts it to the terminal's width; the record and the summary keep it)."""
    oracle = str(row.get("oracle") or "")
    case = row["case"] if not oracle or row["case"].endswith(oracle) else f"{row['case']} {oracle}"
    text = f"{LABEL.get(row['verdict'], 'ERROR')} {row['experiment']} {case} on {row['device']} ({row['backend']})"
    margin = row.get("margin")
    if isinstance(margin, (int, float)) and not isinstance(margin, bool) and math.isfinite(margin):
        text += f", margin {tables.number(margin)}"
    if row["verdict"] != PASS and row.get("detail"):
        text += f": {row['detail']}"
    return " ".join(text.split())  # a detail's own line breaks never break the one line


def stored_so_far() -> str:
    """What this process's runs left in the store, in one clause, for the line a signal ends it with."""
    def ids(state: str) -> list[str]:
        return [run_id for run_id, s in RUNS.items() if s == state]

    said = []
    if ids("complete"):
        said.append(f"{len(ids('complete'))} run(s) completed and stored ({', '.join(ids('complete'))})")
    if ids("broke"):
        said.append(f"run {', '.join(ids('broke'))} broke before the signal (its error record is stored)")
    for run_id in ids("broken by a signal"):  # with the verdicts it reached before the signal
        verdicts = REACHED.get(run_id, "no verdicts")
        reached = f"; its verdicts so far: {verdicts}" if verdicts != "no verdicts" else ""
        said.append(f"run {run_id} was recorded as broken (what it measured is kept{reached})")
    if ids("running"):
        said.append(f"run {', '.join(ids('running'))} was still inside a call when testbed stopped waiting for it: "
                    "it reads back as incomplete (what it measured is kept)")
    return "; ".join(said) or "no run had started; nothing was stored"
