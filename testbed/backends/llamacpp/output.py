"""llama.cpp's tools, their outputs read: test-backend-ops (verdicts, perf figures) and llama-bench
(tokens per second). Outputs come from runs on devices (testbed.backends.llamacpp.runner), so a run that was
cut short must never read as passed.

test-backend-ops
----------------
Test mode (`test-backend-ops test -o OP -b BACKEND`) prints one line per case,
    OP(params): OK | FAIL (often after "[OP] NMSE = x > y") | not supported [BACKEND]
then "  N/M tests passed", "  Backend NAME: OK|FAIL", "K/K backends passed" and a final OK or FAIL.
Perf mode (`perf -o OP`) prints per case "R runs - T us/run - S kB/run - B GB/s" (or GFLOP/run and
GFLOPS for compute-bound ops). `--output csv` prints one row per case.

A run reads as passed only if every case line says OK, the tool's own "N/M tests passed" agrees with
the lines counted here, and the backend and final status say OK: a run cut short (a crash, a lost
device, a truncated pull) lacks the summary and is an error, never a pass.

llama-bench
-----------
Its three documented output formats become one kind of row:
  -o md     a markdown table: model | size | params | backend | [threads | ngl | ...] | test | t/s
            with t/s as "MEAN ± STDDEV" and test as "pp512", "tg128", "pp512 @ d512" (older
            versions: "pp 512")
  -o csv    one header row, one row per test: n_prompt, n_gen, n_depth, avg_ts, stddev_ts, ...
  -o json   an array of objects with the csv fields plus samples_ns and samples_ts per repetition
            (-o jsonl: one such object per line)
Each becomes a BenchRow: the test name (pp512, tg128, pp512@d512), tokens/s mean and stddev, and the
per-repetition samples when the format carries them (json), so a Figure has real min/max.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field

from testbed.errors import DeviceError
from testbed.results import Figure

# --- test-backend-ops ------------------------------------------------------------------------------

# Colour codes; the ESC byte is optional because outputs that went through a tool that drops control
# bytes keep the rest ("[1;32mOK[0m"), which must still read as OK.
ANSI = re.compile(r"\x1b?\[[0-9;]*m")
CASE = re.compile(r"^\s+([A-Z][A-Z0-9_]*)\((.*)\):\s*(.*?)\s*$")
NMSE = re.compile(r"NMSE = ([-+0-9.eE]+|nan|inf) > ([-+0-9.eE]+)")
SUMMARY = re.compile(r"^\s*(\d+)/(\d+) tests passed")
BACKEND = re.compile(r"^\s*Backend (\S+): (OK|FAIL|SKIPPED)")
BACKEND_HEADER = re.compile(r"^Backend \d+/\d+: (\S+)")
SKIPPING = re.compile(r"^\s*Skipping (\S+) backend")
PERF = re.compile(
    r"(\d+) runs -\s+([\d.]+) us/run -\s+([\d.]+) (kB|MB|GB|kFLOP|MFLOP|GFLOP|TFLOP)/run -\s+([\d.]+) "
    r"(GB/s|kFLOPS|MFLOPS|GFLOPS|TFLOPS)")


def clean(text: str) -> str:
    return ANSI.sub("", text)


class Unreadable(ValueError):
    """A line of a tool's output that testbed does not understand: never read as a pass, never dropped."""

    def __init__(self, line: int, text: str, why: str):
        self.line, self.text, self.why = line, text, why
        super().__init__(f"line {line} ({text.strip()[:100]!r}): {why}")


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
class TboReport:
    cases: list[Case] = field(default_factory=list)
    summary: tuple[int, int] | None = None  # the tool's own "N/M tests passed"
    backends: dict[str, str] = field(default_factory=dict)
    final: str | None = None
    evidence: list[dict] = field(default_factory=list)  # the device run that printed it, when there was one

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


def parse_test(text: str) -> TboReport:
    report = TboReport()
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


def named_backends(text: str) -> set[str]:
    """The backends a console output ran ("Backend 1/1: CPU" and "Backend CPU: OK"), less the ones
    it says it skipped."""
    named, skipped = set(), set()
    for line in clean(text).splitlines():
        if m := BACKEND_HEADER.match(line) or BACKEND.match(line):
            (skipped if m.re is BACKEND and m.group(2) == "SKIPPED" else named).add(m.group(1))
        elif m := SKIPPING.match(line):
            skipped.add(m.group(1))
    return named - skipped


BOOLEAN = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def parse_csv(text: str) -> list[Case]:
    """`--output csv` in test mode: a case passed when the tool marks it passed (or, in versions without
    that column, when it is supported and carries no error message). A row whose mode, `supported` or
    `passed` cell is not one the tool writes (an empty cell: no verdict) raises Unreadable."""
    cases = []
    reader = csv.DictReader(io.StringIO(clean(text)))
    for row in reader:
        n, line = reader.line_num, ",".join(str(v) for v in row.values())
        if row.get("test_mode") not in (None, "test"):
            raise Unreadable(n, line, f"test_mode {row.get('test_mode')!r}; testbed reads test mode's CSV")
        supported = BOOLEAN.get(str(row.get("supported")).strip().lower())
        if supported is None:
            raise Unreadable(n, line, f"supported is {row.get('supported')!r}, not one of {', '.join(BOOLEAN)}")
        if "passed" in row and supported:
            ok = BOOLEAN.get(str(row["passed"]).strip().lower())
            if ok is None:
                raise Unreadable(n, line, f"passed is {row['passed']!r}: no verdict")
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
    """Perf mode's rows. In a perf output (one with a perf row, or a case line that tries to be one),
    every case line is a perf row or "not supported": any other, and a row of no runs or of a time that
    is not a positive number (nan, inf, 0.00, negative), raises Unreadable naming its line."""
    rows, other = [], []
    for n, line in enumerate(clean(text).splitlines(), 1):
        m = CASE.match(line)
        if not m:
            continue
        p = PERF.search(line)
        if p is None:
            if "not supported" not in m.group(3):
                other.append((n, line))
            continue
        row = Perf(m.group(1), m.group(2), int(p.group(1)), float(p.group(2)), float(p.group(3)),
                   p.group(4), float(p.group(5)), p.group(6))
        if row.runs <= 0 or not row.us_per_run > 0:
            raise Unreadable(n, line, f"{row.runs} runs, {p.group(2)} us/run: not a measurement")
        rows.append(row)
    bad = other if rows else [(n, line) for n, line in other if "us/run" in line or " runs" in line]
    if bad:
        raise Unreadable(*bad[0], "a case line that is not a perf row testbed reads "
                                  "(R runs - T us/run - S UNIT/run - B RATE, with a positive time)")
    return rows


# --- llama-bench -----------------------------------------------------------------------------------


@dataclass
class BenchRow:
    test: str  # pp512, tg128, pp512@d512
    tokens_per_s: float
    stddev: float
    model: str = ""
    backend: str = ""
    threads: int | None = None
    samples_ts: list[float] = field(default_factory=list)

    def figure(self) -> Figure:
        """Median/min/max over the repetitions when known; else the mean with its +-1 stddev band."""
        if self.samples_ts:
            return Figure.of(self.samples_ts, "tokens/s")
        return Figure(self.tokens_per_s, self.tokens_per_s - self.stddev, self.tokens_per_s + self.stddev, 0,
                      "tokens/s")


def bench_test_name(n_prompt: int, n_gen: int, n_depth: int = 0) -> str:
    name = f"pp{n_prompt}" if n_prompt and not n_gen else f"tg{n_gen}" if n_gen and not n_prompt \
        else f"pp{n_prompt}+tg{n_gen}"
    return f"{name}@d{n_depth}" if n_depth else name


def _normal_test(cell: str) -> str:
    """'pp 512' / 'pp512' / 'pp512 @ d512' -> 'pp512', 'pp512@d512'."""
    return re.sub(r"\s+", "", cell)


def parse_bench_markdown(text: str) -> list[BenchRow]:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("|")]
    if len(lines) < 2:
        return []
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        m = re.match(r"([\d.]+)\s*±\s*([\d.]+)", cells.get("t/s", ""))
        if not m or "test" not in cells:
            continue
        threads = cells.get("threads")
        rows.append(BenchRow(_normal_test(cells["test"]), float(m.group(1)), float(m.group(2)),
                             cells.get("model", ""), cells.get("backend", ""),
                             int(threads) if threads and threads.isdigit() else None))
    return rows


def _from_fields(obj: dict) -> BenchRow:
    return BenchRow(bench_test_name(int(obj["n_prompt"]), int(obj["n_gen"]), int(obj.get("n_depth") or 0)),
                    float(obj["avg_ts"]), float(obj["stddev_ts"]), str(obj.get("model_type", "")),
                    str(obj.get("backends", "")), int(obj["n_threads"]) if obj.get("n_threads") not in (None, "") else None,
                    [float(s) for s in obj.get("samples_ts", [])])


def parse_bench_csv(text: str) -> list[BenchRow]:
    return [_from_fields(r) for r in csv.DictReader(io.StringIO(text.strip()))]


def parse_bench_json(text: str) -> list[BenchRow]:
    text = text.strip()
    objs = json.loads(text) if text.startswith("[") else [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    return [_from_fields(o) for o in objs]


def parse_bench(text: str) -> list[BenchRow]:
    """Any of the formats, recognised by its first character; an output with no result row is an
    error (a crashed or cut-short run), never an empty success."""
    body = text.strip()
    try:
        if body.startswith(("[", "{")):
            rows = parse_bench_json(body)
        elif body.startswith("|") or "\n|" in body:
            rows = parse_bench_markdown(body)
        else:
            rows = parse_bench_csv(body)
    except (ValueError, KeyError) as e:
        raise DeviceError(f"llama-bench output is not in a format testbed reads: {type(e).__name__}: {e}") from None
    if not rows:
        raise DeviceError(f"llama-bench printed no result rows (output began: {body[:120]!r})")
    return rows
