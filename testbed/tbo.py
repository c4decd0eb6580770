"""llama.cpp's test-backend-ops: its output, parsed into verdicts and figures.

Test mode (`test-backend-ops -o OP -b BACKEND`) prints one line per case,
    OP(params): OK | FAIL (often after "[OP] NMSE = x > y") | not supported [BACKEND]
then "  N/M tests passed", "  Backend NAME: OK|FAIL", "K/K backends passed" and a final OK or FAIL.
Perf mode (`perf -o OP`) prints per case "R runs - T us/run - S kB/run - B GB/s" (or GFLOP/run and
GFLOPS for compute-bound ops). `--output csv` prints one row per case.

A run reads as passed only if every case line says OK, the tool's own "N/M tests passed" agrees with
the lines counted here, and the backend and final status say OK: a run cut short (a crash, a lost
device, a truncated pull) lacks the summary and is an error, never a pass.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field

ANSI = re.compile(r"\x1b\[[0-9;]*m")
CASE = re.compile(r"^\s+([A-Z][A-Z0-9_]*)\((.*)\):\s*(.*?)\s*$")
NMSE = re.compile(r"NMSE = ([-+0-9.eE]+|nan|inf) > ([-+0-9.eE]+)")
SUMMARY = re.compile(r"^\s*(\d+)/(\d+) tests passed")
BACKEND = re.compile(r"^\s*Backend (\S+): (OK|FAIL|SKIPPED)")
PERF = re.compile(
    r"(\d+) runs -\s+([\d.]+) us/run -\s+([\d.]+) (kB|MB|GB|kFLOP|MFLOP|GFLOP|TFLOP)/run -\s+([\d.]+) "
    r"(GB/s|kFLOPS|MFLOPS|GFLOPS|TFLOPS)")


def clean(text: str) -> str:
    return ANSI.sub("", text)


@dataclass
class Case:
    op: str
    params: str
    status: str  # OK | FAIL | unsupported
    nmse: float | None = None
    threshold: float | None = None
    detail: str = ""

    @property
    def name(self) -> str:
        return f"{self.op}({self.params})"

    def param(self, key: str) -> str | None:
        for part in re.split(r",(?![^\[]*\])", self.params):
            k, _, v = part.partition("=")
            if k == key:
                return v
        return None


@dataclass
class TestReport:
    cases: list[Case] = field(default_factory=list)
    summary: tuple[int, int] | None = None  # the tool's own "N/M tests passed"
    backends: dict[str, str] = field(default_factory=dict)
    final: str | None = None

    @property
    def tested(self) -> list[Case]:
        return [c for c in self.cases if c.status != "unsupported"]

    @property
    def passed(self) -> int:
        return sum(c.status == "OK" for c in self.tested)

    def tally(self) -> str:
        """'36/36 OK', as the seeds report it."""
        return f"{self.passed}/{len(self.tested)} OK"

    def problems(self) -> list[str]:
        """Why this run may not be read as a pass (empty: it passed)."""
        out = [f"{c.name}: {c.detail or c.status}" for c in self.tested if c.status != "OK"]
        if not self.tested:
            out.append("no case was tested (all unsupported, or the output is empty)")
        if self.summary is None:
            out.append("the output has no 'N/M tests passed' line: the run did not finish")
        elif self.summary != (self.passed, len(self.tested)):
            out.append(f"the tool says {self.summary[0]}/{self.summary[1]} passed but "
                       f"{self.passed}/{len(self.tested)} case lines say OK")
        bad = [f"{b}: {s}" for b, s in self.backends.items() if s != "OK"]
        if bad or not self.backends:
            out.append("backend status " + (", ".join(bad) if bad else "missing"))
        if self.final != "OK":
            out.append(f"final status {self.final or 'missing'}")
        return out


def parse_test(text: str) -> TestReport:
    report = TestReport()
    for line in clean(text).splitlines():
        if m := CASE.match(line):
            op, params, rest = m.groups()
            if rest.endswith("OK") and "FAIL" not in rest:
                report.cases.append(Case(op, params, "OK"))
            elif "not supported" in rest:
                report.cases.append(Case(op, params, "unsupported", detail=rest))
            else:
                n = NMSE.search(rest)
                report.cases.append(Case(op, params, "FAIL", nmse=float(n.group(1)) if n else None,
                                         threshold=float(n.group(2)) if n else None, detail=rest or "no verdict"))
        elif m := SUMMARY.match(line):
            report.summary = (int(m.group(1)), int(m.group(2)))
        elif m := BACKEND.match(line):
            report.backends[m.group(1)] = m.group(2)
        elif line.strip() in ("OK", "FAIL"):
            report.final = line.strip()
    return report


def parse_csv(text: str) -> list[Case]:
    """`--output csv`: a case passed when the tool marks it passed (or, in versions without that
    column, when it is supported and carries no error message)."""
    cases = []
    for row in csv.DictReader(io.StringIO(clean(text))):
        if row.get("test_mode") not in (None, "test"):
            continue
        supported = row.get("supported") in ("1", "true", "yes")
        if "passed" in row:
            ok = row["passed"] in ("1", "true", "yes")
        else:
            ok = supported and not row.get("error_message")
        status = "unsupported" if not supported else ("OK" if ok else "FAIL")
        cases.append(Case(row["op_name"], row["op_params"], status, detail=row.get("error_message") or ""))
    return cases


@dataclass
class Perf:
    op: str
    params: str
    runs: int
    us_per_run: float
    per_run: float
    per_run_unit: str
    rate: float
    rate_unit: str

    @property
    def name(self) -> str:
        return f"{self.op}({self.params})"

    @property
    def gbps(self) -> float | None:
        return self.rate if self.rate_unit == "GB/s" else None


def parse_perf(text: str) -> list[Perf]:
    rows = []
    for line in clean(text).splitlines():
        m = CASE.match(line)
        p = PERF.search(line) if m else None
        if p:
            rows.append(Perf(m.group(1), m.group(2), int(p.group(1)), float(p.group(2)), float(p.group(3)),
                             p.group(4), float(p.group(5)), p.group(6)))
    return rows
