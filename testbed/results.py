"""The results store: one JSON record per verdict or measurement, in batches that commit whole or not at all.

A store is a folder holding `records.jsonl`, one JSON object a line, three kinds of line:

  a row        a record (or any dict, e.g. the nightly log's entries) tagged with its batch id
  a commit     {"commit": BATCH, "rows": N}: the batch's N rows are complete
  a run mark   a row {"run_mark": "started" | "ended", ...}: where a run began and how it ended

`append` writes one batch (its rows, then its commit line) under an exclusive lock and fsyncs it; if
anything fails on the way (a full disk, a signal), the file is truncated back to where the batch
began. A batch cut short anyway (kill -9, power loss) has no commit line, so the reader never sees it.
A torn or NUL-padded line left by such a crash is set apart by a newline before the next batch, so
it can never swallow that batch's first line.

A run stores each record as it is produced (testbed.runner), between its two marks. The reader marks
every record of a run that did not end complete `"incomplete": true` (never counted as passed, see
`passed`), and adds one "error" record for a run that never ended (killed, or still running; also one
whose start mark is gone), so such a run reads as broken wherever verdicts are counted. Only schema-1
records (stored whole in one write, before runs had marks) count without an end mark. The start mark
names the run's process (host, pid), so `testbed records rm` can tell a run still going from a dead one.
A run that `records rm` took records out of has its end mark's outcome EDITED: it never reads as
complete again. A figure that is not a finite number (or has a field of a type testbed never writes)
is set aside, its record kept (`figure_problems`).

Lines the reader cannot use (not UTF-8, not a JSON object, a newer schema) are skipped with one
warning per read; `testbed records verify` lists them. Tables are pandas views over records
(`frame`), flattened with dotted column names.
"""

from __future__ import annotations

import contextvars
import datetime as _dt
import fcntl
import json
import math
import os
import re
import socket
import stat
import subprocess
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from testbed import PROJECT_ROOT, __version__, children
from testbed.errors import StoreError
from testbed.verdicts import PASS, VERDICTS

SCHEMA = 2  # 2: rows in committed batches, runs between marks (1: one write per run, no marks)


@dataclass
class Figure:
    """A measured quantity over repetitions: median with min and max, how many reps, and each
    repetition's value in the order they were taken (None where only the summary is known, e.g. a
    seed's quoted figure), so tables for programs can hand out the raw samples."""

    median: float
    min: float
    max: float
    reps: int
    unit: str
    samples: list[float] | None = None
    # "machine_probe" for a figure that measures the machine, not the code (testbed.measure.history); stored
    # only when set
    role: str | None = None
    # a paired A/B ratio's evidence (testbed.measure.history's docstring names its fields); stored only when set
    ab: dict[str, Any] | None = None

    def as_probe(self) -> "Figure":
        """The same figure marked as a machine probe."""
        return Figure(self.median, self.min, self.max, self.reps, self.unit, self.samples, role="machine_probe",
                      ab=self.ab)

    @classmethod
    def of(cls, samples: Iterable[float], unit: str) -> "Figure":
        s = np.asarray(list(samples), dtype=float)
        return cls(float(np.median(s)), float(s.min()), float(s.max()), int(s.size), unit, s.tolist())

    def scaled(self, factor: float, unit: str) -> "Figure":
        """The same figure in another unit (factor > 0; a rate inverts min and max)."""
        lo, hi = sorted((self.min * factor, self.max * factor))
        samples = None if self.samples is None else [x * factor for x in self.samples]
        return Figure(self.median * factor, lo, hi, self.reps, unit, samples, self.role)

    def rate(self, amount: float, unit: str) -> "Figure":
        """amount / time, for a figure of seconds: tokens/s, FLOP/s. min/max swap."""
        samples = None if self.samples is None else [amount / x for x in self.samples]
        return Figure(amount / self.median, amount / self.max, amount / self.min, self.reps, unit, samples,
                      self.role)


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
        head = children.run(
            ["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=5
        )
        dirty = children.run(
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
        # role and ab are stored only when set: every other figure is stored as before
        return {k: v for k, v in asdict(x).items() if k not in ("role", "ab") or v is not None}
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        # JSON has no NaN/inf, and a string where a number belongs breaks every reader that sorts or
        # takes a minimum: stored as null (a verdict's detail says what was not finite)
        return None
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

    def context(self) -> dict:
        """What every stored row of this run carries."""
        return {
            "schema": SCHEMA,
            "run_id": self.run_id,
            "started": self.started,
            "experiment": self.experiment,
            "device": self.device,
            "backend": self.backend,
            "emulated": self.emulated,
            "host_load": self.host_load,
            "fingerprint": _jsonable(self.fingerprint),
            "config": _jsonable(self.config),
            "git_commit": self.git_commit,
            "testbed_version": __version__,
        }

    def stamp(self, record: Record) -> dict:
        """The stored form of a record: the run's context plus the record's own fields."""
        body = _jsonable(asdict(record))
        body["figures"] = {k: _jsonable(v) for k, v in record.figures.items()}
        return {**self.context(), "record_id": uuid.uuid4().hex,
                "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **body}

    def mark(self, which: str, outcome: str | None = None) -> dict:
        """A run mark: "started" before the first record (with the host and pid of the process that runs
        it), "ended" (outcome complete or broke) after the last."""
        process = {"host": socket.gethostname(), "pid": os.getpid()} if which == "started" else {}
        return {**self.context(), "run_mark": which, "outcome": outcome, **process,
                "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


@dataclass(frozen=True)
class RunPlace:
    """The run going on in this thread: its store's folder (where it keeps files beside its records, such as
    an engine's failing requests) and its id."""

    store: Path
    run_id: str


_CURRENT_RUN: contextvars.ContextVar[RunPlace | None] = contextvars.ContextVar("testbed_current_run", default=None)


@contextmanager
def running(store: Path, run_id: str):
    """Mark `run_id` of the store at `store` as the run this thread is in (testbed.runner.execute)."""
    token = _CURRENT_RUN.set(RunPlace(Path(store), run_id))
    try:
        yield
    finally:
        _CURRENT_RUN.reset(token)


def current_run() -> RunPlace | None:
    """The run this thread is in, or None (a call outside any run: a test, a replay)."""
    return _CURRENT_RUN.get()


def passed(record: dict) -> bool:
    """A verdict that counts as passed: "pass", from a run that ended complete."""
    return record.get("verdict") == PASS and not record.get("incomplete")


def unfinished_run_record(start: dict, kept: int, marked: bool = True) -> dict:
    """The "error" record the reader adds for a run that never ended: `start` is its start mark, or
    (marked=False, the mark is gone) its first record."""
    why = "the run never ended (killed, or still running)" if marked else \
        "the run has no start or end mark (removed while it ran?): it never ended complete"
    record = Record(str(start.get("experiment")), "run", "oracle", "run", "error", None, {"records_kept": kept},
                    detail=f"{why}; {kept} records of it are kept, marked incomplete")
    body = _jsonable(asdict(record))
    context = {k: v for k, v in start.items() if k not in ("run_mark", "outcome", "batch", "host", "pid")}
    return {**context, "record_id": f"{start['run_id']}-unfinished", "time": start.get("time"), **body,
            "incomplete": True}


EDITED = "edited"  # an end mark's outcome once `testbed records rm` took records out of its run


def edited_run(mark: dict, how: str) -> dict:
    """An end mark of a run some of whose records were removed (`how`): outcome EDITED, never complete
    again; the outcome it ended with and every removal are kept."""
    return {**mark, "outcome": EDITED, "ended_as": mark.get("ended_as", mark.get("outcome")),
            "edits": [*(mark.get("edits") if isinstance(mark.get("edits"), list) else []), how]}


def valid_id(value) -> bool:
    return isinstance(value, str)


# What every record has (RunInfo.stamp), and of what type; readers and reports rely on them.
RECORD_TYPES = {"record_id": str, "run_id": str, "experiment": str, "case": str, "kind": str, "device": str,
                "backend": str, "started": str, "config": dict, "fingerprint": dict, "git_commit": str,
                "testbed_version": str, "params": dict, "figures": dict, "metrics": dict}
RECORD_FIELDS = tuple(RECORD_TYPES)
# What some records have, and of what type when they do (null allowed).
OPTIONAL_TYPES = {"verdict": str, "oracle": str, "margin": (int, float), "detail": str, "evidence": list,
                  "work": dict, "artifacts": dict, "emulated": bool, "host_load": dict}


def malformed(row: dict) -> str | None:
    """Why a row that says it is a record cannot be used as one (a field missing, or of a type no
    testbed writes: a damaged or hostile store), or None."""
    for name, kind in RECORD_TYPES.items():
        if name not in row:
            return f"no {name}"
        if not isinstance(row[name], kind) or isinstance(row[name], bool):
            return f"{name} is a {type(row[name]).__name__}"
    for name, kind in OPTIONAL_TYPES.items():
        value = row.get(name)
        if value is not None and (not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)):
            return f"{name} is a {type(value).__name__}"
    if row["kind"] not in ("oracle", "measure"):
        return f"kind {row['kind']!r}"
    return None

# A figure's fields, and of what type; median, min and max are finite numbers (testbed stores a value
# that is not finite as null, and a figure without its value cannot be compared or tabled).
FIGURE_NUMBERS = ("median", "min", "max")
FIGURE_TYPES = {"reps": int, "unit": str, "samples": (list, type(None)), "role": (str, type(None)),
                "ab": (dict, type(None))}


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def figure_problem(figure) -> str | None:
    """Why a stored figure cannot be used (a value that is not a finite number, a field of a type testbed
    never writes), naming the field, or None."""
    if not isinstance(figure, dict):
        return f"is a {type(figure).__name__}, not a figure"
    for name in FIGURE_NUMBERS:
        value = figure.get(name)
        if not _finite(value):
            what = repr(value) if isinstance(value, float) or value is None else f"a {type(value).__name__}"
            return f".{name} is {what}, not a finite number"
    for name, kind in FIGURE_TYPES.items():
        value = figure.get(name)
        if name in ("reps", "unit") and name not in figure:
            return f".{name} is missing"
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            return f".{name} is a {type(value).__name__}"
    if any(x is not None and not _finite(x) for x in figure.get("samples") or []):
        return ".samples holds a value that is not a finite number"
    return None


def figure_problems(record: dict) -> dict[str, str]:
    """Per figure of a record that cannot be used, why: "figures.NAME.FIELD is ..." (see figure_problem)."""
    return {name: f"figures.{name}{why}" for name, figure in record["figures"].items()
            if (why := figure_problem(figure))}


# The free space a run needs before it starts: room for its records with a wide margin.
MIN_FREE_BYTES = 1 << 20
# How many of the skipped lines one warning names.
NAMED_PROBLEMS = 3
# A torn line may be NUL-padded (a filesystem extends the file before the data lands): NUL runs are line
# breaks too, so the valid line after them is still read.
LINE_BREAK = re.compile(rb"\n|\x00+")


def make_folder(path: Path, mode: int = 0o755) -> None:
    """`path` and any missing parent, each made with `mode` (0755: others may read the records, only
    this user writes them). mkdir's default 0777 under a umask of 000 gave a world-writable store;
    a umask can only take bits away from `mode`."""
    path = Path(path)
    if path.is_dir():
        return
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=mode)
        except FileExistsError:
            pass  # made meanwhile by another writer


@dataclass
class Scan:
    """What a read of the store found: committed rows in order, and every line it set aside."""

    batches: list[list[dict]] = field(default_factory=list)  # committed, in order (a schema-1 row alone)
    problems: list[str] = field(default_factory=list)  # "LINE: why", for lines that are not usable
    uncommitted: dict[str, int] = field(default_factory=dict)  # batch -> rows without a commit line

    @property
    def rows(self) -> list[dict]:
        return [row for batch in self.batches for row in batch]


class ResultsStore:
    """A folder of records. `append` commits a batch whole or not at all; `records` and `frame` read them."""

    FILE = "records.jsonl"

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.path = self.root / self.FILE

    # -- writing ----------------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Raise StoreError (one line) unless a run's records can be written here: before running."""
        try:
            make_folder(self.root)
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
            free = os.statvfs(self.root)
        except OSError as e:
            raise StoreError(f"results store {self.path} cannot be written: {e.strerror}") from None
        if free.f_bavail * free.f_frsize < MIN_FREE_BYTES:
            raise StoreError(f"results store {self.path}: only {free.f_bavail * free.f_frsize} bytes free; "
                             f"a run needs at least {MIN_FREE_BYTES >> 20} MiB")

    def append(self, rows: list[dict]) -> None:
        """Write `rows` as one batch: all of them with their commit line, or (on any failure) nothing."""
        if not rows:
            return
        batch = uuid.uuid4().hex[:16]
        lines = [json.dumps({**r, "batch": batch}, sort_keys=True) for r in rows]
        lines.append(json.dumps({"commit": batch, "rows": len(rows)}))
        data = ("\n".join(lines) + "\n").encode()
        fd = self._locked()
        try:
            begin = os.fstat(fd).st_size
            if begin and os.pread(fd, 1, begin - 1) != b"\n":
                data = b"\n" + data  # a torn line before us ends here, not inside our first row
            view = memoryview(data)
            try:
                while view:  # os.write may write less than asked; the lock keeps the batch contiguous
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except BaseException as e:
                # A full disk or a failed sync: take the batch back. A signal (Ctrl-C) once every byte
                # is written: keep it, readers may already have seen it whole; before that, take it back.
                if isinstance(e, OSError) or view:
                    os.ftruncate(fd, begin)
                if isinstance(e, OSError):
                    raise StoreError(f"results store {self.path}: {len(rows)} records not stored: "
                                     f"{e.strerror}") from None
                raise
        finally:
            os.close(fd)

    def _locked(self) -> int:
        """The store file, open for appending under its exclusive lock. `rewrite` replaces the file
        while holding the lock, so a writer that waited on the old one opens the new one."""
        while True:
            try:
                make_folder(self.root)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError as e:
                raise StoreError(f"results store {self.path} cannot be written: {e.strerror}") from None
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.stat(self.path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(fd).st_ino:
                return fd
            os.close(fd)

    def rewrite(self, keep, edited: str | None = None) -> tuple[Scan, list[dict]]:
        """Replace the store with the committed rows `keep(row)` accepts, batch by batch, under the lock;
        the old file stays beside it (records.jsonl.before-TIME). Returns what was read and what was
        dropped. Unusable lines and uncommitted batches are not carried over: nothing reads them.
        With `edited` (what removed them), a run that loses records but keeps its end mark has that mark
        say so (`edited_run`): its verdicts no longer count as passed, for a run with a record taken out
        is not the run that ended complete (a failed verdict removed must not leave a run of passes)."""
        fd = self._locked()
        try:
            found = self.scan()
            dropped = [row for batch in found.batches for row in batch if not keep(row)]
            losing = {row.get("run_id") for row in dropped if "record_id" in row} if edited is not None else set()

            def amend(row: dict) -> dict:
                return edited_run(row, edited) if row.get("run_mark") == "ended" and row.get("run_id") in losing \
                    else row
            stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
            target = Path(os.path.realpath(self.path))  # a symlinked store stays a symlink: its file is replaced
            fresh = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.new"
            try:
                with open(fresh, "wb") as f:
                    for batch in found.batches:
                        kept = [amend(row) for row in batch if keep(row)]
                        if kept:
                            name = uuid.uuid4().hex[:16]
                            f.write("".join(json.dumps({**r, "batch": name}, sort_keys=True) + "\n"
                                            for r in kept).encode())
                            f.write((json.dumps({"commit": name, "rows": len(kept)}) + "\n").encode())
                    f.flush()
                    os.fsync(f.fileno())
                os.link(target, target.parent / f"{target.name}.before-{stamp}")
                os.chmod(fresh, stat.S_IMODE(os.stat(target).st_mode))
                os.replace(fresh, target)
            except OSError as e:
                fresh.unlink(missing_ok=True)
                raise StoreError(f"results store {self.path} not rewritten (left as it was): {e.strerror}") from None
            return found, dropped
        finally:
            os.close(fd)

    # -- reading ----------------------------------------------------------------------------------

    def scan(self) -> Scan:
        """Every committed row, in order, and what was set aside (see the module's docstring)."""
        found = Scan()
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return found
        pending: dict[str, list[dict]] = {}
        for n, raw in enumerate(LINE_BREAK.split(data), 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                found.problems.append(f"{n}: not UTF-8")
                continue
            except json.JSONDecodeError:
                found.problems.append(f"{n}: not JSON, a torn line (an interrupted write)")
                continue
            if not isinstance(row, dict):
                found.problems.append(f"{n}: a JSON {type(row).__name__}, not an object")
            elif isinstance(row.get("schema"), int) and row["schema"] > SCHEMA:
                found.problems.append(f"{n}: schema {row['schema']}, newer than this testbed's {SCHEMA}")
            elif not isinstance(row.get("commit", ""), str) or not isinstance(row.get("batch", ""), str):
                found.problems.append(f"{n}: a batch or commit id that is not a string")
            elif "commit" in row:
                rows = pending.pop(row["commit"], [])
                if len(rows) == row.get("rows"):
                    found.batches.append(rows)
                else:
                    found.problems.append(f"{n}: batch {row['commit']} commits {row.get('rows')} rows "
                                          f"but {len(rows)} were read")
            elif "batch" in row:
                pending.setdefault(row.pop("batch"), []).append(row)
            else:
                found.batches.append([row])  # schema 1: a run's records were written in one append
        found.uncommitted = {batch: len(rows) for batch, rows in pending.items()}
        return found

    def rows(self) -> list[dict]:
        """Every committed row (records, run marks, or a log's entries), warning once about the rest."""
        found = self.scan()
        if found.problems:
            named = "; ".join(found.problems[:NAMED_PROBLEMS])
            more = f" and {len(found.problems) - NAMED_PROBLEMS} more" if len(found.problems) > NAMED_PROBLEMS else ""
            warnings.warn(f"{self.path}: skipped {len(found.problems)} unusable lines (line {named}{more}); "
                          f"`testbed records verify` lists them")
        return found.rows

    def records(self, experiment: str | None = None) -> list[dict]:
        """The stored records, each marked incomplete unless its run ended complete (schema-1 records,
        from before runs had marks, excepted), plus one error record per run that never ended. A row
        that says it is a record but lacks a field every record has is skipped with a warning (tables
        and reports would stumble on it)."""
        rows = self.rows()
        starts = {r["run_id"]: r for r in rows if r.get("run_mark") == "started" and valid_id(r.get("run_id"))}
        outcomes = {r["run_id"]: r.get("outcome") for r in rows
                    if r.get("run_mark") == "ended" and valid_id(r.get("run_id"))}
        out, kept, first, set_aside, bad_figures = [], {}, {}, [], []
        for r in rows:
            if "record_id" not in r:
                continue
            why = malformed(r)
            if why:
                set_aside.append(why)
                continue
            r.pop("incomplete", None)  # the reader's to say, never a stored field's
            r.pop("figures_set_aside", None)
            bad = figure_problems(r)
            if bad:  # the figures set aside, the record (its verdict) kept, and what was set aside said
                r["figures"] = {name: f for name, f in r["figures"].items() if name not in bad}
                r["figures_set_aside"] = bad
                bad_figures.extend(f"run {r['run_id']} record {r['record_id']}: {why}" for why in bad.values())
            run = r["run_id"]
            if outcomes.get(run) != "complete" and (run in starts or r.get("schema") != 1):
                r["incomplete"] = True
                kept[run] = kept.get(run, 0) + 1
                first.setdefault(run, r)
            out.append(r)
        # each run that never ended, its start mark there or gone: one error record, with the context of
        # its start mark, or of its first record where that mark is gone or not one testbed wrote
        for run in [*starts, *(run for run in first if run not in starts)]:
            if run in outcomes:
                continue
            start = starts.get(run)
            error = unfinished_run_record(start, kept.get(run, 0)) if start else None
            if error is None or malformed(error):
                error = unfinished_run_record(first[run], kept[run], marked=bool(start)) if run in first else None
            if error is not None and not malformed(error):
                out.append(error)
        if set_aside:
            warnings.warn(f"{self.path}: skipped {len(set_aside)} records without the fields every record has "
                          f"({', '.join(RECORD_FIELDS)}), or with one of a type testbed never writes (first: "
                          f"{set_aside[0]}); `testbed records verify` counts them")
        if bad_figures:
            warnings.warn(f"{self.path}: set aside {len(bad_figures)} figures that are not finite numbers or of a "
                          f"type testbed never writes (first: {bad_figures[0]}); their records are kept without "
                          "them; `testbed records verify` names them")
        return [r for r in out if experiment is None or r["experiment"] == experiment]

    def frame(self, experiment: str | None = None) -> pd.DataFrame:
        """Records as a flat DataFrame: nested fields become dotted columns (figures.x.median, ...)."""
        rows = self.records(experiment)
        if not rows:
            return pd.DataFrame()
        return pd.json_normalize(rows, sep=".")
