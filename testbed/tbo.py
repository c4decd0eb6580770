"""llama.cpp's test-backend-ops output (console, with its colour codes, or CSV) as testbed records.

So that `test-backend-ops -o GATED_DELTA_NET -b HTP0` run on a phone lands in the same store as
testbed's own runs: one oracle record per case (test mode), one measure record per case (perf mode),
and one summary record per backend ("36/36 OK").

Console lines look like

    Backend 1/1: CPU
      GATED_DELTA_NET(type=f32,head_count=4,...,K=1): OK
      GATED_DELTA_NET(type=f32,...): [GATED_DELTA_NET] NMSE = 0.012 > 0.0000001 FAIL
      GATED_DELTA_NET(type=f32,...): not supported [HTP0]
      GATED_DELTA_NET(type=f32,...):     6051 runs -   165.48 us/run -     4160 kB/run -   23.98 GB/s
      36/36 tests passed
      Backend CPU: OK

The CSV form (`--output csv`) has one row per case; its verdict column is `passed` where the build
writes one, otherwise a supported case with an empty error_message counts as passed.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field

from testbed.results import Figure, Record

ANSI = re.compile(r"\x1b\[[0-9;]*m")
BACKEND = re.compile(r"^Backend \d+/\d+: (?P<name>\S+)")
CASE = re.compile(r"^\s+(?P<op>[A-Z][A-Z0-9_]*)\((?P<params>[^)]*)\):\s*(?P<rest>.*)$")
NMSE = re.compile(r"NMSE = (?P<nmse>[-+0-9.eE]+|nan|inf) > (?P<max>[-+0-9.eE]+)")
PERF = re.compile(
    r"(?P<runs>\d+) runs -\s+(?P<us>[0-9.]+) us/run -\s+(?P<size>[0-9.]+) (?P<size_unit>[kMG]B|[kMGT]?FLOP)/run"
    r"\s+-\s+(?P<rate>[0-9.]+) (?P<rate_unit>\S+)"
)
SUMMARY = re.compile(r"^\s+(?P<passed>\d+)/(?P<total>\d+) tests passed")


@dataclass
class TBOCase:
    backend: str
    op: str
    params: dict[str, str]
    status: str  # "pass" | "fail" | "unsupported" | "perf"
    nmse: float | None = None
    max_nmse: float | None = None
    perf: dict[str, float | str] = field(default_factory=dict)
    line: str = ""

    @property
    def name(self) -> str:
        return f"{self.op}({','.join(f'{k}={v}' for k, v in self.params.items())})"


def _params(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",") if "=" in item)


def parse_console(text: str) -> tuple[list[TBOCase], dict[str, tuple[int, int]]]:
    """Cases, and per backend the harness' own "passed/total" line (absent in perf mode)."""
    cases, summaries, backend = [], {}, "?"
    for raw in text.splitlines():
        line = ANSI.sub("", raw)
        if m := BACKEND.match(line):
            backend = m["name"]
        elif m := SUMMARY.match(line):
            summaries[backend] = (int(m["passed"]), int(m["total"]))
        elif m := CASE.match(line):
            rest = m["rest"].strip()
            case = TBOCase(backend, m["op"], _params(m["params"]), "pass", line=line.strip())
            if p := PERF.search(rest):
                case.status = "perf"
                case.perf = {"runs": int(p["runs"]), "us_per_run": float(p["us"]), "size": float(p["size"]),
                             "size_unit": p["size_unit"], "rate": float(p["rate"]), "rate_unit": p["rate_unit"]}
            elif "not supported" in rest:
                case.status = "unsupported"
            elif rest.endswith("FAIL") or "FAIL" in rest.split():
                case.status = "fail"
            elif not rest.endswith("OK"):
                raise ValueError(f"test-backend-ops line not understood: {line.strip()!r}")
            if n := NMSE.search(rest):
                case.nmse, case.max_nmse = float(n["nmse"]), float(n["max"])
            cases.append(case)
    return cases, summaries


def parse_csv(text: str) -> list[TBOCase]:
    cases = []
    for row in csv.DictReader(io.StringIO(text)):
        supported = row.get("supported", "1") in ("1", "true", "yes")
        if not supported:
            status = "unsupported"
        elif "passed" in row:
            status = "pass" if row["passed"] in ("1", "true", "yes") else "fail"
        else:
            status = "fail" if row.get("error_message") else "pass"
        cases.append(TBOCase(row["backend_name"], row["op_name"], _params(row["op_params"]), status,
                             line=row.get("error_message", "")))
    return cases


def parse(text: str) -> tuple[list[TBOCase], dict[str, tuple[int, int]]]:
    """Either form, told apart by the CSV header."""
    if text.lstrip().startswith('"backend_name"') or text.lstrip().startswith("backend_name"):
        return parse_csv(text), {}
    return parse_console(text)


def to_records(text: str, experiment: str, command: str = "test-backend-ops") -> list[Record]:
    cases, summaries = parse(text)
    if not cases:
        raise ValueError("no test-backend-ops cases found in the output (was the backend skipped?)")
    records = []
    for c in cases:
        params = {"backend_name": c.backend, "op": c.op, **c.params}
        if c.status == "perf":
            us = c.perf["us_per_run"]
            records.append(Record(experiment, c.name, "measure", params=params,
                                  figures={"time": Figure(us, us, us, int(c.perf["runs"]), "us"),
                                           "rate": Figure(c.perf["rate"], c.perf["rate"], c.perf["rate"],
                                                          int(c.perf["runs"]), str(c.perf["rate_unit"]))},
                                  work={f"per_run_{c.perf['size_unit']}": c.perf["size"]},
                                  detail=f"{command}: mean over {c.perf['runs']} runs"))
        elif c.status != "unsupported":
            metrics = {} if c.nmse is None else {"nmse": c.nmse, "max_nmse": c.max_nmse}
            records.append(Record(experiment, c.name, "oracle", "test-backend-ops", c.status, None, metrics,
                                  params=params, detail=c.line if c.status == "fail" else ""))
    tested = [c for c in cases if c.status in ("pass", "fail")]
    for backend in sorted({c.backend for c in tested}):
        mine = [c for c in tested if c.backend == backend]
        ok = sum(c.status == "pass" for c in mine)
        unsupported = sum(c.status == "unsupported" and c.backend == backend for c in cases)
        reported = summaries.get(backend)
        detail = f"{ok}/{len(mine)} OK" + (f", {unsupported} not supported" if unsupported else "")
        consistent = reported is None or reported == (ok, len(mine))
        if not consistent:
            detail += f"; the harness printed {reported[0]}/{reported[1]}"
        records.append(Record(experiment, f"{command} -b {backend}", "oracle", "test-backend-ops-suite",
                              "pass" if ok == len(mine) and consistent else "fail", float(ok - len(mine)),
                              {"passed": ok, "total": len(mine), "unsupported": unsupported},
                              params={"backend_name": backend}, detail=detail))
    return records
