"""Run one configured experiment on its device and store its records.

The run's records are kept in memory and appended to the store in one atomic batch at the end. If
the run fails or is interrupted, only one record is appended: verdict "error" with what happened.

A record's `device` is the machine that computed it. So before anything runs, a backend the device
cannot run is refused (refimpl runs only on the host); and after, every record of a run on any device
but the host must carry evidence that the device ran it (testbed.backends.Evidence: what ran, its
sha256, the command, the device's own time), or the run is an error and nothing of it is stored as a
verdict or a figure. Records of a profile with capability `emulated` (qemu-user, the loopback adbd,
lavapipe) say so: real for correctness, never for speed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pandas as pd

from testbed import backends, experiments
from testbed.config import RunConfig, check_params, project_path
from testbed.devices import Device, connect, load_profile
from testbed.errors import DeviceError
from testbed.results import Record, ResultsStore, RunInfo


def results_store(rc: RunConfig) -> ResultsStore:
    return ResultsStore(project_path(os.environ.get("TESTBED_RESULTS") or rc.cfg.results_dir))


def check(rc: RunConfig):
    """Everything that can be checked before running: parameters, the backend against the device,
    cross-parameter rules, the profile."""
    module = experiments.load(rc.experiment)
    check_params(rc.cfg, module.PARAMS)
    profile = load_profile(rc.device)
    backend = rc.cfg.get("backend")
    if backend in backends.names():
        backends.refuse_mismatch(backend, rc.device, rc.cfg.device.get("capabilities"))
    if hasattr(module, "validate"):
        module.validate(rc.cfg)
    return module, profile


class ComputedElsewhere(DeviceError):
    """A record of a run on a device carries no evidence that the device computed it."""


def check_evidence(records: list[Record], profile) -> None:
    if profile.transport == "local" and not profile.has("emulated"):
        return  # the host itself: what ran here ran on the host
    bare = [r.case for r in records if not r.evidence]
    if bare:
        raise ComputedElsewhere(f"{len(bare)} record(s) of a run on device {profile.name} carry no evidence that "
                                f"the device computed them (first: {bare[0]}); nothing computed on the host is "
                                f"stored under a device's name")


@dataclass
class Outcome:
    info: RunInfo
    rows: list[dict]

    def frame(self) -> pd.DataFrame:
        return pd.json_normalize(self.rows, sep=".") if self.rows else pd.DataFrame()

    @property
    def failed(self) -> int:
        return sum(r["kind"] == "oracle" and r["verdict"] != "pass" for r in self.rows)


def host_load(before: dict | None = None) -> dict:
    """The 1-minute load average and the cores; with `before`, the run's worst of both readings and
    whether it was noisy: more runnable tasks than cores means measurements shared the CPUs (on a
    device run too: the host drives the transport and, under emulation, computes)."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if before is None:
        return {"load_1m_before": load, "cores": cores}
    worst = max(before["load_1m_before"], load)
    return {**before, "load_1m_after": load, "noisy": worst > cores}


def execute(rc: RunConfig, progress=lambda msg: None, device: Device | None = None) -> Outcome:
    module, profile = check(rc)
    device = device or connect(profile)
    info = RunInfo(
        experiment=rc.experiment, device=rc.device, backend=str(rc.cfg.get("backend", "refimpl")),
        config=rc.flat(), fingerprint=device.fingerprint(), emulated=profile.has("emulated"),
    )
    store = results_store(rc)
    ctx = experiments.Context(device=device, progress=progress)
    load_before = host_load()
    records: list[Record] = []
    try:
        for record in module.run(rc.cfg, ctx):
            records.append(record)
        check_evidence(records, profile)
        info.host_load = host_load(load_before)
    except BaseException as e:  # noqa: BLE001  -- Ctrl-C included: the store must say the run broke
        what = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        store.append([info.stamp(Record(rc.experiment, "run", "oracle", "run", "error", None,
                                        {"records_before_error": len(records)}, detail=what))])
        raise
    rows = [info.stamp(r) for r in records]
    store.append(rows)
    return Outcome(info, rows)
