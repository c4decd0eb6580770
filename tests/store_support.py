"""Stored runs for tests that write a store directly: the reader counts a record as passed only when
its run ended complete, so records stored for a test need the marks testbed.runner writes around them."""

from __future__ import annotations

from testbed.results import RunInfo

# the fields RunInfo.mark copies from the run into each mark (RunInfo.context)
CONTEXT = tuple(RunInfo("x", "x", "x", {}, {}).context())


def as_runs(rows: list[dict]) -> list[dict]:
    """`rows` (stamped records), each run's wrapped in its two marks: started, its records, ended complete."""
    out, runs = [], {}
    for row in rows:
        runs.setdefault(row["run_id"], []).append(row)
    for records in runs.values():
        context = {k: records[0][k] for k in CONTEXT if k in records[0]}
        out += [{**context, "run_mark": "started", "outcome": None, "time": records[0]["time"]}, *records,
                {**context, "run_mark": "ended", "outcome": "complete", "time": records[-1]["time"]}]
    return out
