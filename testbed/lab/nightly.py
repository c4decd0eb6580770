"""`testbed nightly [suite=NAME] [key=value ...]`: run a suite on its devices, then write the report.

A suite is Hydra config, experiments/suite/NAME.yaml: the devices, and the runs, each an experiment
with overrides in Hydra's syntax (sweeps included: chunk=16,32,64) and optionally its own devices.
Extra key=value arguments override the suite's keys (lock_wait_s=60). Every job is composed and
checked before the first one starts, so a usage or configuration error runs nothing and writes
nothing.

Devices run concurrently, one worker thread per device, each running its jobs one after the other
(the work is on the devices, the host mostly waits). A device is held for the whole night through its
lock (testbed.devices.private: a per-user private folder, the same lock `pytest --device=NAME`
takes), so a second nightly or a test session waits for the device, up to lock_wait_s, then reports
it busy, naming the holder. A device that cannot
be reached (DeviceUnreachable, when connecting or during a run) is reported and the others go on.
With farm=HEAD:PORT the jobs run on a lab's Ray cluster instead, each on the host that owns its
device (testbed.lab.farm); the store, the night log and the report stay here.

Each night appends a "started" entry to RESULTS/nights/records.jsonl when it begins and its full
entry (which runs, each device's status, tool versions, exit status, every flag of tonight's runs as
testbed.measure.history.flag_data gives it: quantity, levels before and after, commit range, the machine
probe's reading, the A/B evidence; and every instruction count that changed tonight) once the report
is written, so
a killed night still shows in the log, and the logged exit status is the one the process returns;
the report reads the log beside the records. Exit status (testbed.verdicts): 0 no oracle failed and
nothing regressed (a refusal, "not supported", is never a failure); 1 an oracle failed, a run broke,
or a figure or oracle regressed; 2 a usage or configuration error; 3 a device was unreachable or busy
and nothing else went wrong; 7 every verdict of the night was not supported or not judged.
"""

from __future__ import annotations

import datetime as dt
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import OmegaConf

from testbed import config, experiments, runner, stop
from testbed.config import RunConfig
from testbed.devices import Device, connect, load_profile
from testbed.devices.private import DeviceBusy, device_lock
from testbed.errors import DeviceUnreachable, UsageError, did_you_mean
from testbed.heartbeat import heartbeat, time_left
from testbed.measure import history
from testbed.measure.timing import cpu_seconds
from testbed.report import build as report
from testbed.report.tables import printable
from testbed.results import Record, ResultsStore
from testbed.verdicts import FAILING, LABEL, NOTHING_JUDGED, UNJUDGED, Tally

SCREEN = 12  # at most this many failure or regression lines in the summary; the report has them all


# --- the suite ------------------------------------------------------------------------------------


class ABJob(RunConfig):
    """A suite run marked `ab: true`: its native programs measured against the build of the last night
    that measured its own (`baseline_tree`) in the same job (testbed.lab.ab), so machine drift cancels
    instead of reading as a regression; the history keeps the per-night A/B ratios."""


@dataclass
class Suite:
    name: str
    devices: list[str]
    jobs: dict[str, list[RunConfig]]  # device -> its jobs, in the suite's order
    lock_dir: Path | None  # None: the per-user default, shared with pytest --device
    lock_wait_s: float
    report_out: Path | None
    ab_reps: int = 10  # pairs per call in the A/B jobs
    ab_tree: str = "."  # the source tree tonight's A/B jobs measure as B (default: the working tree)


def load_suite(overrides: list[str], suite_dir: Path | None = None) -> Suite:
    """Compose suite=NAME (default: default) with the other overrides, and check every job. Suites are
    looked for in suite_dir if given, else in the project's and the lab's suite folders."""
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("suite=")]
    name = chosen[-1] if chosen else "default"
    if suite_dir is None:
        suite_dir = config.group_file("suite", name).parent
    names = sorted(p.stem for p in suite_dir.glob("*.yaml"))
    if name not in names:
        raise UsageError(f"unknown suite {name!r}{did_you_mean(name, names)}; accepted: {', '.join(names)}")
    rest = [o for o in overrides if not o.startswith("suite=")]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(suite_dir), version_base="1.3"):
        try:
            cfg = compose(name, overrides=rest)
        except HydraException as e:
            raise UsageError(f"suite {name}: {str(e).splitlines()[0]}") from None
    spec = OmegaConf.to_container(cfg, resolve=True)
    devices = spec.get("devices") or []
    known = config.choices("device")
    for device in devices:
        if device not in known:
            raise UsageError(f"suite {name}: unknown device {device!r}{did_you_mean(device, known)}; "
                             f"accepted: {', '.join(known)}")
    if not devices or not spec.get("runs"):
        raise UsageError(f"suite {name}: needs `devices` (a list of {', '.join(known)}) and `runs`")
    jobs: dict[str, list[RunConfig]] = {d: [] for d in devices}
    for label, run in spec["runs"].items():
        experiment = run.get("experiment") if isinstance(run, dict) else None
        if experiment is None:
            raise UsageError(f"suite {name}: run {label!r} names no experiment; accepted: "
                             f"{', '.join(config.choices('experiment'))}")
        together = experiments.sweep_together(config.swept_experiments([f"experiment={experiment}"]))
        for device in run.get("devices") or devices:
            if device not in jobs:
                raise UsageError(f"suite {name}: run {label!r} names device {device!r}, "
                                 f"which is not in the suite's devices: {', '.join(devices)}")
            for combo in config.expand_sweep(run.get("overrides") or [], together):
                rc = config.load([f"device={device}", *combo], experiment=experiment)
                module, _ = runner.check(rc)
                if run.get("ab"):
                    if not hasattr(module, "ab_calls") or rc.cfg.get("backend") != "native":
                        raise UsageError(f"suite {name}: run {label!r} has ab: true, which needs an experiment with A/B "
                                         f"calls and backend=native (got {experiment}, backend={rc.cfg.get('backend')})")
                    rc = ABJob(rc.experiment, rc.device, rc.cfg, rc.overrides)
                jobs[device].append(rc)
    lock_dir = Path(spec["lock_dir"]) if spec.get("lock_dir") else None
    wait = spec.get("lock_wait_s", 0)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0:
        raise UsageError(f"suite {name}: lock_wait_s={wait!r} is not accepted; accepted: seconds >= 0")
    out = spec.get("report_out")
    ab_reps = spec.get("ab_reps", 10)
    if isinstance(ab_reps, bool) or not isinstance(ab_reps, int) or ab_reps < 1:
        raise UsageError(f"suite {name}: ab_reps={ab_reps!r} is not accepted; accepted: an integer >= 1")
    ab_tree = spec.get("ab_tree") or "."
    if any(isinstance(rc, ABJob) for js in jobs.values() for rc in js):
        from testbed.lab import ab

        ab.resolve_tree(str(config.project_path(ab_tree)))  # a bad tree is a usage error before anything runs
    return Suite(name, devices, jobs, lock_dir, float(wait), config.project_path(out) if out else None, ab_reps,
                 str(config.project_path(ab_tree)))


# --- one worker per device ------------------------------------------------------------------------


@dataclass
class DeviceNight:
    device: str
    status: str = "ok"  # ok | unreachable | busy
    reason: str = ""
    run_ids: list[str] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)  # its oracle verdicts by state
    measurements: int = 0
    failures: list[str] = field(default_factory=list)  # one line per failing oracle or broken run
    refusals: list[str] = field(default_factory=list)  # one line per verdict not supported or not judged
    seconds: float = 0.0
    ab_jobs_done: int = 0  # A/B jobs that completed: tonight's kernels were measured in them

    def count(self, run_id: str, rows: list[dict]) -> None:
        """Add one finished run's records."""
        self.run_ids.append(run_id)
        oracles = [r for r in rows if r["kind"] == "oracle"]
        self.tally += Tally.of_records(oracles)
        self.measurements += len(rows) - len(oracles)
        def line(r):
            return f"{self.device} {r['experiment']} ({r['backend']}) {r['case']}: {r['verdict']} {r['detail']}"
        self.failures += [line(r) for r in oracles if r["verdict"] in FAILING]
        self.refusals += [f"{LABEL[r['verdict']]} {line(r)}" for r in oracles if r["verdict"] in UNJUDGED]


class Log:
    """Progress lines from several workers, one whole line at a time."""

    def __init__(self, stream=sys.stderr):
        self.stream, self.lock = stream, threading.Lock()

    def __call__(self, device: str, message: str) -> None:
        with self.lock:
            print(printable(f"[{device}] {message}"), file=self.stream, flush=True)


def job_label(rc: RunConfig) -> str:
    return " ".join([rc.experiment, *(o for o in rc.overrides if not o.startswith(("experiment=", "device=")))])


def baseline_tree(nights: list[dict]):
    """The A side of tonight's A/B jobs: the kernels of the newest night whose A/B jobs all completed
    (last night's build, as asv compares neighbours), as that night snapshotted them
    (testbed.lab.ab.snapshot), named by that night's commit. Whatever that night said: a change is
    flagged on the night it appears, against the night before, and not again the nights after, when
    both sides hold it (an intentional slowdown is accepted by landing; a revert reads as faster).
    A night killed or stopped before its A/B jobs ended never measured its kernels, so the night
    before it stays the baseline and a change it brought is still flagged the next night. None before
    the first such night, or when its snapshot is gone from the cache."""
    from testbed.lab import ab

    for entry in reversed(nights):
        measured = entry.get("ab_measured", entry.get("exit_status") == 0)  # older logs: their last good night
        if measured and entry.get("kernels"):
            tree = ab.snapshotted(entry["kernels"])
            if tree is None:
                return None
            return replace(tree, revision=entry.get("kernels_commit") or entry["git_commit"])
    return None


NO_BASELINE = history.NO_BASELINE


def without_baseline(record: Record) -> Record:
    """An A/B record of tonight's kernels against themselves (no earlier night measured its own): its
    verdicts say so instead of a "no change" that compared nothing. Its counts and ratios are kept: they
    start the history."""
    block = record.metrics.get("ab")
    if isinstance(block, dict):
        block.update(verdict=NO_BASELINE, baseline=NO_BASELINE)
    for figure in record.figures.values():
        if figure.ab:
            figure.ab["verdict"] = NO_BASELINE
    return record


def execute_job(rc: RunConfig, handle: Device, suite: Suite, trees, log) -> runner.Outcome:
    """One job: a plain run, or an A/B job of trees (A: the last measured night's kernels, B: tonight's;
    before the first such night, tonight's against themselves, every verdict NO_BASELINE, and the
    history starts)."""
    if not isinstance(rc, ABJob):
        return runner.execute(rc, device=handle)
    from testbed.lab import ab

    opts = ab.Options(reps=suite.ab_reps)
    module = experiments.load(rc.experiment)
    first = trees[0] is trees[1]
    if first:
        log(f"A/B: {NO_BASELINE} (no earlier night measured its kernels): tonight's kernels against themselves, "
            "nothing compared; they are the next night's baseline")
    else:
        log(f"A/B against {trees[0].spec} of commit {trees[0].revision[:12]} (the last measured night's kernels), "
            f"{opts.reps} pairs per call")

    def produce(cfg, ctx):
        for record in ab.measure(cfg, ctx, module, rc.experiment, trees, opts):
            yield without_baseline(record) if first else record

    return runner.execute(rc, device=handle, produce=produce)


def work(device: str, jobs: list[RunConfig], suite: Suite, night: str, log: Log,
         open_device: Callable[[str], Device], trees=None) -> DeviceNight:
    result = DeviceNight(device)
    started = time.monotonic()
    try:
        with device_lock(device, suite.lock_wait_s, f"testbed nightly, night {night}", suite.lock_dir):
            handle = open_device(device)
            began = time.monotonic()
            for i, rc in enumerate(jobs, 1):
                log(device, f"{i}/{len(jobs)} {job_label(rc)}{time_left(time.monotonic() - began, i - 1, len(jobs))}")
                try:
                    say = lambda msg: log(device, f"{i}/{len(jobs)} {msg}")  # noqa: E731
                    with heartbeat(job_label(rc), say):  # a job's step may be silent for minutes (a build)
                        outcome = execute_job(rc, handle, suite, trees, say)
                except DeviceUnreachable:
                    raise
                except Exception as e:  # noqa: BLE001 -- the runner stored an error record; go on
                    result.failures.append(f"{device} {job_label(rc)}: run broke: {type(e).__name__}: {e}")
                    log(device, f"{i}/{len(jobs)} broke: {type(e).__name__}: {e}")
                    continue
                result.count(outcome.info.run_id, outcome.rows)
                result.ab_jobs_done += isinstance(rc, ABJob)
    except DeviceBusy as e:
        result.status, result.reason = "busy", str(e)
    except DeviceUnreachable as e:
        result.status, result.reason = "unreachable", str(e)
    result.seconds = time.monotonic() - started
    log(device, f"{result.status}{': ' + result.reason if result.reason else ''} ({result.seconds:.1f} s)")
    return result


def open_device(name: str) -> Device:
    return connect(load_profile(name))


# --- the night ------------------------------------------------------------------------------------


def on_this_host(suite: Suite, night: str, log: Log,
                 open_device: Callable[[str], Device] = open_device, trees=None) -> list[DeviceNight]:
    """Every device's jobs, one worker thread per device; the runner stores the records. On a signal
    the workers stop at their next check (testbed.stop: between repetitions, while a device command
    runs, after each record) and store their run as broken; this thread waits for them at most
    stop.GRACE_S, then goes on without those still inside one long call (daemon threads: the process
    does not wait for them; their run reads back as never ended)."""
    done: dict[str, DeviceNight] = {}
    errors: list[BaseException] = []
    # Not Thread.join: a signal's exception raised inside join marks the joined thread as stopped while
    # it still runs (CPython bpo-45274), and the process would exit under it.
    finished = {d: threading.Event() for d in suite.devices}

    def worker(device: str) -> None:
        try:
            done[device] = work(device, suite.jobs[device], suite, night, log, open_device, trees)
        except BaseException as e:  # noqa: BLE001 -- handed to the main thread
            errors.append(e)
        finally:
            finished[device].set()

    for d in suite.devices:
        threading.Thread(target=worker, args=(d,), name=f"device-{d}", daemon=True).start()
    try:
        for event in finished.values():
            while not event.wait(stop.POLL_S):
                pass
    except runner.Interrupted:
        runner.STOP.set()
        deadline = time.monotonic() + stop.GRACE_S
        for event in finished.values():
            event.wait(max(0.0, deadline - time.monotonic()))
        raise
    if errors:
        raise errors[0]
    return [done[d] for d in suite.devices]


def run_night(suite: Suite, store: ResultsStore, open_device: Callable[[str], Device] = open_device,
              log: Log | None = None, drive=None) -> tuple[int, str]:
    """Run the suite, write the report, log the night; (exit status, summary). `drive`
    runs the jobs and stores their records (default: on_this_host; testbed.lab.farm: on a Ray cluster)."""
    log = Log() if log is None else log
    started = dt.datetime.now(dt.timezone.utc)
    night = started.strftime("%Y-%m-%dT%H%M%SZ-") + uuid.uuid4().hex[:6]
    earlier = report.night_log(store.root)
    from testbed.results import git_commit

    entry = {"night": night, "suite": suite.name, "started": started.isoformat(timespec="seconds"),
             "git_commit": git_commit(), "tools": report.tool_versions()}
    trees = None
    ab_jobs = sum(isinstance(rc, ABJob) for jobs in suite.jobs.values() for rc in jobs)
    if ab_jobs:
        from testbed.lab import ab

        measured = ab.resolve_tree(suite.ab_tree)
        tonight = ab.snapshot(measured)
        entry["kernels"] = tonight.revision.split()[0].removeprefix("kernels:")
        # The commit the A/B flags name for tonight's side: the commit ab_tree names, or for a folder
        # (the working tree by default; its revision names its snapshot) the checkout's commit, as every
        # record of tonight carries.
        named_commit = re.fullmatch(r"[0-9a-f]{40}", measured.revision)
        entry["kernels_commit"] = measured.revision if named_commit else entry["git_commit"]
        tonight = replace(tonight, spec=f"kernels:{entry['kernels']}", revision=entry["kernels_commit"])
        baseline = baseline_tree(earlier)
        entry["ab_baseline"] = f"{baseline.spec} ({baseline.revision})" if baseline is not None else NO_BASELINE
        trees = (baseline or tonight, tonight)
    store_nights(store).append([entry])  # what a killed night leaves in the log
    try:
        results = drive(suite, store, night, log) if drive else on_this_host(suite, night, log, open_device, trees)
    except runner.Interrupted as e:  # the workers stop at their next record (runner.STOP)
        stopped = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        store_nights(store).append([{**entry, "finished": stopped, "exit_status": 128 + e.signum,
                                     "report": f"not written: {e}"}])
        raise
    if ab_jobs:  # tonight's kernels are the next night's baseline only if every A/B job measured them
        entry["ab_measured"] = sum(r.ab_jobs_done for r in results) == ab_jobs
    tonight = {run for r in results for run in r.run_ids}
    records = store.records()
    settings = report.settings()
    flags = [f for f in history.flags(records, settings) if f.run_id in tonight]
    changes = [c for c in history.count_changes(records, settings.get("instruction_rise", history.INSTRUCTION_RISE))
               if c.run_id in tonight]  # every count that changed tonight, a regression or not
    status = exit_status(results, flags)
    finished = dt.datetime.now(dt.timezone.utc)
    entry.update(finished=finished.isoformat(timespec="seconds"), exit_status=status, cpu_seconds=cpu_seconds(),
                 devices={r.device: {"status": r.status, "reason": r.reason, "runs": r.run_ids} for r in results},
                 flags=[history.flag_data(f) for f in flags],
                 count_changes=[{"experiment": c.series[0], "device": c.series[1], "config_key": c.series[2],
                                 "case": c.series[3], "what": c.what, "before": c.before, "after": c.after,
                                 "change": c.change, "verdict": c.verdict,
                                 "last_clean_commit": c.old["git_commit"], "since_commit": c.new["git_commit"],
                                 "line": c.line()} for c in changes])
    store_nights(store).append([entry])  # before the report, which shows it
    try:
        out, _ = report.write(store, suite.report_out)
        report_line = f"report: {out / 'report.html'}"
    except Exception as e:  # noqa: BLE001 -- the night's runs are stored; say the report broke, exit 1
        status, report_line = 1, f"report: not written: {type(e).__name__}: {e}"
        store_nights(store).append([{**entry, "exit_status": status, "report": report_line}])  # the last word
    compared = compared_with(earlier, records, tonight, settings["min_history"])
    if entry.get("ab_baseline") == NO_BASELINE:
        compared += f"\nA/B: {NO_BASELINE}: tonight's kernels were measured against themselves, nothing compared"
    return status, summary(suite, night, results, flags, compared, report_line, status, finished - started, changes)


def store_nights(store: ResultsStore) -> ResultsStore:
    return ResultsStore(store.root / "nights")


def exit_status(results: list[DeviceNight], flags: list[history.Flag]) -> int:
    """1 a verdict failed or a run broke, or a regression; 3 a device unreachable or busy; NOTHING_JUDGED every
    verdict of the night a refusal or not judged; 0 otherwise."""
    if flags or any(r.failures or r.tally.failed for r in results):
        return 1
    if any(r.status != "ok" for r in results):
        return 3
    return sum((r.tally for r in results), Tally()).exit_status()


def compared_with(earlier: list[dict], records: list[dict], tonight: set[str], min_history: int) -> str:
    """Which earlier night tonight's runs were compared with, and how many configs have enough history
    for their figures to be judged (oracles are judged against a single earlier run)."""
    if not earlier:
        return "first night: nothing to compare with yet"
    configs = {}
    for r in records:
        configs.setdefault((r["experiment"], r["device"], history.config_key(r)), set()).add(r["run_id"])
    tonights = [runs for runs in configs.values() if runs & tonight]
    compared = sum(len(runs) > 1 for runs in tonights)
    judged = sum(len(runs) > min_history for runs in tonights)
    return (f"compared with {len(earlier)} earlier night(s), the last {earlier[-1]['night']}: "
            f"{compared}/{len(tonights)} of tonight's configs have earlier runs (oracles compared), "
            f"{judged}/{len(tonights)} the {min_history} needed to judge figures")


def summary(suite: Suite, night: str, results: list[DeviceNight], flags: list[history.Flag], compared: str,
            report_line: str, status: int, took: dt.timedelta, changes: list[history.CountChange] = ()) -> str:
    lines = [f"nightly {suite.name}: night {night} ({took.total_seconds():.0f} s, {cpu_seconds():.0f} CPU-s)"]
    for r in results:
        what = (f"{len(r.run_ids)} runs, oracles {r.tally.phrase()}, {r.measurements} measurements"
                if r.status == "ok" else r.reason)
        lines.append(f"  {r.device:<14} {r.status:<12} {what}")
    failures = [f for r in results for f in r.failures]
    problems = [f"FAIL {f}" for f in failures] + [
        f"REGRESSION {f.line()}" for f in flags] + [
        f"CHANGED {c.line()}" for c in changes if not c.regression] + [  # counts: reported, not flagged
        f for r in results for f in r.refusals]  # refusals last: never a failure
    lines += problems[:SCREEN]
    if len(problems) > SCREEN:
        lines.append(f"... and {len(problems) - SCREEN} more in the report")
    lines.append(compared)
    lines.append(report_line)
    tally = sum((r.tally for r in results), Tally())
    meaning = {0: "all oracles pass, no regression" if not tally.unjudged else
                  f"no oracle failed ({tally.phrase()}), no regression",
               1: f"{len(failures)} failures, {len(flags)} regressions"
                  + ("; the report was not written" if "not written" in report_line else ""),
               3: "a device was unreachable or busy",
               NOTHING_JUDGED: "nothing judged: every verdict not supported or not judged"}
    lines.append(f"exit {status}: {meaning[status]}")
    return "\n".join(map(printable, lines))  # reasons and names from engines, devices and files
