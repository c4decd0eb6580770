"""The results store: one JSON record per verdict or measurement, appended atomically.

A store is a folder holding `records.jsonl`. A run collects its records in memory and appends them in
one write under an exclusive lock, followed by fsync, when it ends. So an interrupted or crashed run
appends either nothing or a single record with verdict "error" that says what happened; never a
half-written batch that could read as passed. A torn last line (power loss mid-write) is skipped on
read with a warning.

Tables are pandas views over records (`frame`), flattened with dotted column names.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import math
import os
import subprocess
import uuid
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from testbed import PROJECT_ROOT, __version__

SCHEMA = 1
VERDICTS = ("pass", "fail", "error")


@dataclass
class Figure:
    """A measured quantity over repetitions: median with min and max, and how many reps."""

    median: float
    min: float
    max: float
    reps: int
    unit: str

    @classmethod
    def of(cls, samples: Iterable[float], unit: str) -> "Figure":
        s = np.asarray(list(samples), dtype=float)
        return cls(float(np.median(s)), float(s.min()), float(s.max()), int(s.size), unit)

    def scaled(self, factor: float, unit: str) -> "Figure":
        """The same figure in another unit (factor > 0; a rate inverts min and max)."""
        lo, hi = sorted((self.min * factor, self.max * factor))
        return Figure(self.median * factor, lo, hi, self.reps, unit)

    def rate(self, amount: float, unit: str) -> "Figure":
        """amount / time, for a figure of seconds: tokens/s, FLOP/s. min/max swap."""
        return Figure(amount / self.median, amount / self.max, amount / self.min, self.reps, unit)


@dataclass
class Record:
    """One verdict (kind="oracle") or one measurement (kind="measure")."""

    experiment: str
    case: str
    kind: str
    oracle: str | None = None
    verdict: str | None = None
    margin: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Figure] = field(default_factory=dict)
    work: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)
    detail: str = ""
    # what ran on the device for this record (testbed.backends.Evidence dicts); empty on the host
    evidence: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if self.kind not in ("oracle", "measure"):
            raise ValueError(f"record kind {self.kind!r} is not oracle or measure")
        if self.kind == "oracle" and self.verdict not in VERDICTS:
            raise ValueError(f"oracle record verdict {self.verdict!r} is not one of {VERDICTS}")


def git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _jsonable(x):
    if isinstance(x, Figure):
        return asdict(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # JSON has no NaN/inf; keep them visible as strings
    return x


@dataclass
class RunInfo:
    """What every record of one run shares."""

    experiment: str
    device: str
    backend: str
    config: dict[str, Any]
    fingerprint: dict[str, Any]
    # computed under emulation (qemu-user, lavapipe): real for correctness, never for speed
    emulated: bool = False
    # this host's load while the run went on (testbed.runner.host_load): a figure taken on a loaded
    # machine says so
    host_load: dict[str, Any] = field(default_factory=dict)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    git_commit: str = field(default_factory=git_commit)
    started: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))

    def stamp(self, record: Record) -> dict:
        """The stored form of a record: the run's context plus the record's own fields."""
        body = _jsonable(asdict(record))
        body["figures"] = {k: _jsonable(v) for k, v in record.figures.items()}
        return {
            "schema": SCHEMA,
            "record_id": uuid.uuid4().hex,
            "run_id": self.run_id,
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "started": self.started,
            "device": self.device,
            "backend": self.backend,
            "emulated": self.emulated,
            "host_load": self.host_load,
            "fingerprint": _jsonable(self.fingerprint),
            "config": _jsonable(self.config),
            "git_commit": self.git_commit,
            "testbed_version": __version__,
            **body,
        }


class ResultsStore:
    """A folder of records. `append` is atomic per batch; `records` and `frame` read them back."""

    FILE = "records.jsonl"

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.path = self.root / self.FILE

    def append(self, rows: list[dict]) -> None:
        if not rows:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            view = memoryview(data)
            while view:  # os.write may write less than asked; the lock keeps the batch contiguous
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def records(self, experiment: str | None = None) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        with open(self.path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.endswith("\n"):
                    warnings.warn(f"{self.path}:{n}: skipping a torn last line (an interrupted write)")
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    warnings.warn(f"{self.path}:{n}: skipping a line that is not JSON")
                    continue
                if experiment is None or row.get("experiment") == experiment:
                    out.append(row)
        return out

    def frame(self, experiment: str | None = None) -> pd.DataFrame:
        """Records as a flat DataFrame: nested fields become dotted columns (figures.x.median, ...)."""
        rows = self.records(experiment)
        if not rows:
            return pd.DataFrame()
        return pd.json_normalize(rows, sep=".")
