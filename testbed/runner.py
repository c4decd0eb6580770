"""Run one configured experiment on its device and store its records.

The run's records are kept in memory and appended to the store in one atomic batch at the end. If
the run fails or is interrupted, only one record is appended: verdict "error" with what happened.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pandas as pd

from testbed import experiments
from testbed.config import RunConfig, check_params, project_path
from testbed.devices import Device, connect, load_profile
from testbed.results import Record, ResultsStore, RunInfo


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
    device = device or connect(profile)
    info = RunInfo(
        experiment=rc.experiment, device=rc.device, backend=str(rc.cfg.get("backend", "refimpl")),
        config=rc.flat(), fingerprint=device.fingerprint(),
    )
    store = results_store(rc)
    ctx = experiments.Context(device=device, progress=progress)
    records: list[Record] = []
    try:
        for record in module.run(rc.cfg, ctx):
            records.append(record)
    except BaseException as e:  # noqa: BLE001  -- Ctrl-C included: the store must say the run broke
        what = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        store.append([info.stamp(Record(rc.experiment, "run", "oracle", "run", "error", None,
                                        {"records_before_error": len(records)}, detail=what))])
        raise
    rows = [info.stamp(r) for r in records]
    store.append(rows)
    return Outcome(info, rows)
