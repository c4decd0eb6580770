"""`testbed ingest FILE`: store test-backend-ops output from a run made elsewhere (test or perf mode,
console or `--output csv`), as if testbed had run it on --device.

Output from elsewhere may be cut short, damaged or not what it claims, and a wrong pass is the one
mistake a store of verdicts may not make. So the file is refused (one line, exit 2, nothing stored)
unless it is evidently whole and evidently the device's:

  - a regular file of at most MAX_BYTES (not a FIFO, a device such as /dev/zero, or a folder);
  - it ends with a newline (a cut file rarely does), and a CSV has every column and every row every
    field of its header;
  - a CSV (which has no summary line) holds every case the command ran: each of the op's cases where
    testbed knows them (GATED_DELTA_NET's 36), else as many as --cases N says; one cut at a row
    boundary is refused as incomplete;
  - every line that names a case is understood: a CSV row with a verdict the tool writes (an empty
    `passed` cell is none), a perf row with runs and a positive time (not nan, inf, 0 or negative);
    the first that is not is named;
  - it has at least one case line with a verdict the tool prints (OK, FAIL, not supported) or a perf row;
  - the backends it names include the device's (its profile's accelerators.backend, else CPU), unless
    --force: `Backend 1/1: CPU` is not a run on the phone's HTP;
  - the same outputs were not stored before for this experiment and device: a run's .stdout and its
    .csv are one run, not two (--force stores it again: two runs may print the same).

Then the verdicts follow testbed.backends.llamacpp.output: a console run without its summary lines is an
error record, never a pass.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from testbed.backends.llamacpp import output as out
from testbed.errors import UsageError
from testbed.results import Record

MAX_BYTES = 64 << 20  # test-backend-ops' largest outputs (every op, perf) are a few MB
EXPERIMENTS = ("gdn", "llamacpp")  # the experiments whose records are test-backend-ops verdicts and figures
CSV_COLUMNS = ("backend_name", "op_name", "op_params", "test_mode", "supported", "error_message")


def read_regular(path: str) -> str:
    """The file's text; refused unless it is a regular file of at most MAX_BYTES."""
    try:
        info = os.stat(path)  # stat, not open: opening a FIFO for reading blocks until a writer comes
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(f"{path} is not a regular file; accepted: a file holding test-backend-ops output")
    if info.st_size > MAX_BYTES:
        raise UsageError(f"{path} has {info.st_size} bytes; accepted: at most {MAX_BYTES >> 20} MiB")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # swapped between stat and open
            raise UsageError(f"{path} is not a regular file; accepted: a file holding test-backend-ops output")
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise UsageError(f"{path} has more than {MAX_BYTES} bytes; accepted: at most {MAX_BYTES >> 20} MiB")
    return data.decode("utf-8", errors="replace")


@dataclass
class Output:
    """What a file holds: a test-mode report (with why it may not pass) or perf rows, and the
    backends it names."""

    report: out.TboReport
    problems: list[str]
    perf: list[out.Perf]
    backends: set[str]

    def digest(self, device: str) -> str:
        """What identifies the run: the device, its backends and every case's outcome."""
        cases = sorted([c.name, c.status, c.nmse] for c in self.report.cases)
        perf = sorted([p.name, p.runs, p.us_per_run] for p in self.perf)
        text = json.dumps([device, sorted(self.backends), cases, perf], default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def known_cases(op: str) -> list[str] | None:
    """The cases `test-backend-ops -o OP` runs (their parameters), where testbed knows them."""
    if op == "GATED_DELTA_NET":
        from testbed.experiments.gdn import TBO_CASES

        return [c.tbo_params for c in TBO_CASES]
    return None


def check_whole(path: str, cases: list[out.Case], expected: int | None) -> None:
    """A CSV has no summary line: only its cases say whether it is whole (see the module's docstring)."""
    if expected is not None:
        if len(cases) != expected:
            raise UsageError(f"{path}: incomplete: {len(cases)} case rows, but the command ran {expected} (--cases); "
                             f"accepted: the whole CSV of that run")
        return
    for op in sorted({c.op for c in cases}):
        listed = known_cases(op)
        if listed is None:
            raise UsageError(f"{path}: a CSV has no summary line and testbed has no case list for {op}, so nothing "
                             f"says the file is whole; accepted: --cases N, the number of cases the command ran")
        held = {c.params for c in cases if c.op == op}
        missing = [p for p in listed if p not in held]
        if missing:
            raise UsageError(f"{path}: incomplete: {len(listed) - len(missing)} of the {len(listed)} {op} cases "
                             f"(first missing: {op}({missing[0]})); accepted: a whole run's CSV, or --cases N "
                             f"when the command ran fewer (-p)")


def parse_csv_file(path: str, text: str, expected: int | None = None) -> Output:
    rows = list(csv.reader(io.StringIO(text)))
    header = rows[0] if rows else []
    missing = [c for c in CSV_COLUMNS if c not in header]
    if missing:
        raise UsageError(f"{path}: the CSV lacks column {missing[0]!r}; accepted: test-backend-ops --output csv "
                         f"with columns {', '.join(CSV_COLUMNS)}")
    for n, row in enumerate(rows[1:], 2):
        if len(row) != len(header):
            raise UsageError(f"{path}: CSV row {n} has {len(row)} fields, the header {len(header)}: a cut row")
    try:
        report = out.TboReport(cases=out.parse_csv(text))
    except out.Unreadable as e:
        raise UsageError(f"{path}: {e}; accepted: test-backend-ops' own CSV") from None
    check_whole(path, report.cases, expected)
    # CSV has no summary or final status lines; a file that is whole is a finished run
    report.summary, report.final = (report.passed, len(report.tested)), "n/a (csv)"
    problems = [f"{c.name}: {c.detail or c.status}" for c in report.tested if c.status != "OK"]
    problems += [] if report.tested else ["no case was tested"]
    return Output(report, problems, [], {row[header.index("backend_name")] for row in rows[1:]})


def parse_file(path: str, text: str, expected: int | None = None) -> Output:
    """`expected`: how many cases the command ran (--cases), for a CSV of an op testbed has no case list for."""
    if not text.endswith("\n"):
        raise UsageError(f"{path} does not end with a newline: cut short; accepted: a whole test-backend-ops output")
    if text.lstrip().startswith(('"backend_name"', "backend_name")):
        return parse_csv_file(path, text, expected)
    report = out.parse_test(text)
    try:
        perf = out.parse_perf(text)
    except out.Unreadable as e:
        raise UsageError(f"{path}: {e}; nothing stored") from None
    if not perf and not any(c.status != "FAIL" or "FAIL" in c.detail for c in report.cases):
        raise UsageError(f"{path}: no test-backend-ops case line with a verdict the tool prints (OK, FAIL, "
                         "not supported) and no perf row in it")
    return Output(report, report.problems(), perf, out.named_backends(text))


def check_device(path: str, parsed: Output, device: str, expected: str, force: bool) -> None:
    if expected not in parsed.backends and not force:
        named = ", ".join(sorted(parsed.backends)) or "none"
        raise UsageError(f"{path} is output of backend {named}, but device {device}'s backend is {expected}; "
                         f"accepted: output that ran {expected} (or --force)")


def records(experiment: str, backend: str, parsed: Output) -> list[Record]:
    from testbed.backends.llamacpp import runner as llamacpp

    if parsed.perf:
        return llamacpp.perf_rows_records(experiment, backend, parsed.perf)
    return llamacpp.test_records(experiment, parsed.report.cases[0].op, backend, parsed.report, parsed.problems)


def check_experiment(name: str) -> None:
    if name not in EXPERIMENTS:
        raise UsageError(f"--experiment {name!r} does not take test-backend-ops output; accepted: "
                         f"{', '.join(EXPERIMENTS)}")


def already_stored(stored: list[dict], digest: str) -> dict | None:
    return next((r for r in stored if r.get("config", {}).get("source_digest") == digest), None)


def source_name(path: str) -> str:
    return Path(path).name
