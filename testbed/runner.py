"""Run one configured experiment on its device and store its records.

The store is checked before anything runs (testbed.results: writable, with room). The run is stored
as it goes: a "started" mark, each record as soon as the experiment yields it, then an "ended" mark.
A run that fails or is interrupted (Ctrl-C, SIGTERM, SIGHUP: testbed.cli turns them into
`Interrupted`) stores one more record, verdict "error" with what happened, and ends "broke"; one
killed outright has no end mark. Either way what it measured is kept, and read back as incomplete.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

import pandas as pd

from testbed import experiments
from testbed.config import RunConfig, check_params, project_path
from testbed.devices import Device, connect, load_profile
from testbed.results import Record, ResultsStore, RunInfo


class Interrupted(BaseException):
    """A signal asked testbed to stop (SIGINT, SIGTERM, SIGHUP). A BaseException, as KeyboardInterrupt:
    no `except Exception` on the way may swallow it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


# Set when a signal arrives. The main thread is interrupted by the handler itself; runs in worker
# threads (testbed nightly) see this between two records and stop the same way.
STOP = threading.Event()
STOP_SIGNAL: list[int] = []


def stop_on_signals() -> None:
    """Turn SIGINT, SIGTERM and SIGHUP into `Interrupted`, so a run stores what happened before it exits."""

    def handler(signum, frame):
        STOP_SIGNAL[:] = [signum]
        STOP.set()
        raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def results_store(rc: RunConfig) -> ResultsStore:
    return ResultsStore(project_path(os.environ.get("TESTBED_RESULTS") or rc.cfg.results_dir))


def check(rc: RunConfig):
    """Everything that can be checked before running: parameters, cross-parameter rules, the profile."""
    module = experiments.load(rc.experiment)
    check_params(rc.cfg, module.PARAMS)
    if hasattr(module, "validate"):
        module.validate(rc.cfg)
    return module, load_profile(rc.device)


@dataclass
class Outcome:
    info: RunInfo
    rows: list[dict]

    def frame(self) -> pd.DataFrame:
        return pd.json_normalize(self.rows, sep=".") if self.rows else pd.DataFrame()

    @property
    def failed(self) -> int:
        return sum(r["kind"] == "oracle" and r["verdict"] != "pass" for r in self.rows)


def execute(rc: RunConfig, progress=lambda msg: None, device: Device | None = None) -> Outcome:
    module, profile = check(rc)
    store = results_store(rc)
    store.check_writable()
    device = device or connect(profile)
    info = RunInfo(
        experiment=rc.experiment, device=rc.device, backend=str(rc.cfg.get("backend", "refimpl")),
        config=rc.flat(), fingerprint=device.fingerprint(),
    )
    ctx = experiments.Context(device=device, progress=progress)
    rows: list[dict] = []
    store.append([info.mark("started")])
    try:
        for record in module.run(rc.cfg, ctx):
            row = info.stamp(record)
            store.append([row])
            rows.append(row)
            if STOP.is_set():
                raise Interrupted(STOP_SIGNAL[0] if STOP_SIGNAL else signal.SIGTERM)
    except BaseException as e:  # noqa: BLE001  -- signals included: the store must say the run broke
        if isinstance(e, KeyboardInterrupt):
            what = "interrupted"
        elif isinstance(e, Interrupted):
            what = str(e)
        else:
            what = f"{type(e).__name__}: {e}"
        store.append([info.stamp(Record(rc.experiment, "run", "oracle", "run", "error", None,
                                        {"records_before_error": len(rows)}, detail=what)),
                      info.mark("ended", "broke")])
        raise
    store.append([info.mark("ended", "complete")])
    return Outcome(info, rows)
