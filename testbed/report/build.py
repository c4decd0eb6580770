"""The report: one self-contained folder people open in the morning and programs read.

    report.html   the page (jinja2), its images beside it (PNG, matplotlib)
    report.md     the same content as Markdown
    report.json   the same content as data (each table cell's value: numbers stay numbers), plus
                  the figures programs check (breakevens, flags, each device's verdict)

It is built from stored records only (testbed.results.ResultsStore) and the seeds' fixtures. Each
section is a function of the records it is about and is left out when there are none, so an
experiment that has not run yet (or does not exist yet) costs nothing. "Current" means the newest
run of each experiment, device and configuration, an A/B job's apart from the experiment's own
(`latest_runs`); older runs are its history (testbed.measure.history). A record the report cannot read
is named and left out (`unreadable`), and a section that still fails is a notice in its place (`draw`):
the page is always built.

The page's first screen answers what broke, where, and what next: one line per device (green, amber, red
or grey by the result, its counts of pass / fail / not supported / not judged / not run, the reason and
the load a note beneath; `device_verdict`), then the worst failure with the commands that reproduce it
(the run's overrides, the engine's kept call), what regressed with its commits, and the next step
(`first_screen`). The sections below are folded; among them per device the numbers that matter
(`numbers`), and at the end each column explained once (`glossary`). A run stopped before it ended
(killed, interrupted: testbed.results.stopped_runs) is incomplete: set apart before anything else, listed
grey under "Incomplete runs", never current, never a failing verdict for being stopped (`IncompleteRun`).
Every table and plot is of one device, backend and model (testbed.report.implementations): figures of two
implementations side by side in one choice, or one series, would answer no question.

The folder is written beside its destination and moved into place at the end: a report is either
the previous one or the complete new one, never half of each. A report folder holds a marker file
(MARKER); an existing folder without one is never replaced (`--out results` must not delete the
records), and what a killed build left beside it (staging folders, the previous report mid-swap) is
cleaned up or put back by the next build.

Everything on the page is HTML-escaped: device output, config values and names are data, never markup.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import shlex
import shutil
import socket
import sys
import uuid
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path, PurePath
from typing import Any, Callable

import jinja2
import numpy as np
import pandas as pd

from testbed import experiments, results, verdicts
from testbed.devices.private import process_alive
from testbed.errors import INTERNAL_ERROR, StoreError, UsageError
from testbed.experiments import chunk_prefill
from testbed.experiments.chunk_prefill import ChunkMeasures
from testbed.measure import breakeven, decisions, emulation, history, seed
from testbed.report import implementations, plots, tables
from testbed.report.tables import number as format_number, printable
from testbed.runner import verdict_line
from testbed.verdicts import FAIL, FAILING, NOTHING_JUDGED, PASS, UNJUDGED, Tally

TEMPLATES = Path(__file__).parent / "templates"
MARKER = ".testbed-report"  # in every report folder: what may be replaced by the next report
TOOLS = ("numpy", "pandas", "hydra-core", "jinja2", "matplotlib", "iree-base-runtime", "iree-base-compiler",
         "jax", "paramiko", "adb-shell")


# --- the content model: sections of tables, images and lines, rendered three ways ---------------------


@dataclass
class Table:
    caption: str
    columns: list[str]
    rows: list[list[dict]]  # cells: {"text": str, "href": optional anchor, "cls": optional css class}
    # a table that may grow past a screen either way (the oracle matrix: a column per oracle, a row per
    # implementation) scrolls inside a frame of its own, its header and first column kept in view
    framed: bool = False


@dataclass
class Section:
    id: str
    title: str
    lines: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    images: list[dict] = field(default_factory=list)  # {"file": name.png, "caption": str}
    # closed on the page until opened: {"summary": one line, "data": what it summarises}
    details: list[dict] = field(default_factory=list)


def plain(value: Any) -> Any:
    """A value as JSON data: numpy scalars as Python numbers, NaN and pandas' missing values as None."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or value is pd.NA or value is pd.NaT or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def cell(value: Any, href: str | None = None, cls: str | None = None, text: str | None = None) -> dict:
    """One table cell: its value as data (what report.json holds) and its text for people (the value
    formatted, unless the cell says it in words)."""
    value = plain(value)
    if text is None:
        text = "" if value is None else format_number(value) if isinstance(value, float) else str(value)
    return {"value": value, "text": text, "href": href, "cls": cls}


def frame_table(caption: str, df: pd.DataFrame) -> Table:
    return Table(caption, [str(c) for c in df.columns], [[cell(v) for v in row] for row in df.itertuples(index=False)])


def table_data(table: Table) -> dict:
    """A table as report.json holds it: one object per row, each cell's value (numbers stay numbers)."""
    return {"caption": table.caption, "columns": table.columns,
            "rows": [dict(zip(table.columns, (c["value"] for c in row))) for row in table.rows],
            "framed": table.framed}


def section_data(section: Section) -> dict:
    return {**asdict(section), "tables": [table_data(t) for t in section.tables]}


def anchor(record_id: str) -> str:
    return f"#rec-{record_id[:12]}"


# --- what a report is built from ------------------------------------------------------------------


@dataclass
class Inputs:
    """Every record in the window, the current ones, and where the seeds' figures are."""

    records: list[dict]
    current: list[dict]
    fixtures: Path
    out: Path  # where images are written
    now: dt.datetime  # when the report is built: what "stale" is measured from
    settings: dict
    nights: list[dict]
    flags: list[history.Flag]
    referenced: dict[str, dict] = field(default_factory=dict)  # records a table links to, by id
    breakevens: list[dict] = field(default_factory=list)  # per device, backend, model, source: the tail
    choices: list[dict] = field(default_factory=list)  # per implementation: the best C, chunked vs token by token
    set_apart: list[dict] = field(default_factory=list)  # emulated figures, listed apart (testbed.measure.emulation)
    unreadable: list[tuple[dict, str]] = field(default_factory=list)  # records the report cannot read, and why
    current_runs: set[str] = field(default_factory=set)  # the runs of `current`, and of unreadable records
    # records of runs stopped before they ended (killed, interrupted by a signal: results.stopped_runs), set
    # apart from everything above: incomplete, never current, never failing by being stopped
    stopped: list[dict] = field(default_factory=list)
    stopped_how: dict[str, str] = field(default_factory=dict)  # run id -> how it was stopped
    incomplete: list["IncompleteRun"] = field(default_factory=list)  # those newer than their series' current run

    def cite(self, record: dict) -> str:
        self.referenced[record["record_id"]] = record
        return anchor(record["record_id"])

    def current_of(self, experiment: str, kind: str | None = None) -> list[dict]:
        return [r for r in self.current if r["experiment"] == experiment and (kind is None or r["kind"] == kind)]


def parse_since(text: str | None) -> dt.datetime | None:
    if text is None:
        return None
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"--since {text!r} is not a date; accepted: YYYY-MM-DD or an ISO time") from None
    return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)


def select(records: list[dict], since: dt.datetime | None) -> list[dict]:
    if since is None:
        return list(records)
    return [r for r in records if (started_at(r) or since) >= since]  # a record with no time is kept, to be named


def started_at(record: dict) -> dt.datetime | None:
    try:
        when = dt.datetime.fromisoformat(record["started"])
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)


# --- records the report cannot read: named, never a traceback ---------------------------------------


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


HOST_LOAD_FIELDS = {"load_1m_before": is_number, "load_1m_after": is_number, "cores": is_number,
                    "noisy": lambda v: isinstance(v, bool)}


def unreadable(record: dict) -> str | None:
    """Why the report cannot read a record the store let through, or None. The store checks the fields
    every record has and their types (testbed.results.malformed) and sets aside each figure it cannot
    use (figures_set_aside: testbed.results.figure_problems); the report reads inside the rest: the
    start time, an oracle's verdict, the load reading.
    A damaged store, a hand edit or an older testbed may hold anything there (issue 34: an instruction
    count that was a string): such a record is listed with this reason, and never read further."""
    if started_at(record) is None:
        return f"started {record['started']!r} is not an ISO time"
    if record.get("figures_set_aside"):  # the store's reader took them out (testbed.results.figure_problems)
        return "; ".join(record["figures_set_aside"].values())
    for key in ("verdict", "oracle"):
        if record["kind"] == "oracle" and not isinstance(record.get(key), str):
            return f"an oracle record whose {key} is {record.get(key)!r}"
    for key, fits in HOST_LOAD_FIELDS.items():
        if key in (record.get("host_load") or {}) and not fits(record["host_load"][key]):
            return f"host_load.{key} {record['host_load'][key]!r} is not what testbed writes there"
    return None


def unreadable_records(inp: "Inputs") -> Section | None:
    if not inp.unreadable:
        return None
    rows = [[cell(r["record_id"][:12]), cell(r["experiment"]), cell(r["device"]), cell(r["case"]), cell(r["kind"]),
             cell(r["run_id"]), cell(why, cls="fail")] for r, why in inp.unreadable]
    return Section("unreadable", "Records the report cannot read", [
        f"{len(rows)} stored record(s) hold a value testbed never writes where the report reads (a damaged "
        "store, a hand edit, an older testbed): each is named here with what is wrong, and left out of every "
        "table, plot and judgement. An oracle record among them counts as a verdict that did not pass. "
        "`testbed records verify` checks the store."],
        [Table("records left out", ["record", "experiment", "device", "case", "kind", "run", "what is wrong"], rows)])


# --- runs stopped before they ended: incomplete (grey), never failing for it, never current ----------


def series_of(record: dict) -> tuple:
    """What `latest_runs` keeps the newest run of: the experiment, device and config, an A/B job's apart."""
    return record["experiment"], record["device"], history.config_key(record), is_ab(record)


@dataclass
class IncompleteRun:
    """A run stopped before it ended (killed, or interrupted by a signal) and replaced by no complete run of
    its series since: the newest attempt there did not finish."""

    run_id: str
    how: str  # how it was stopped (results.stopped_runs)
    stop: dict  # the error record that says it was stopped
    records: list[dict]  # what it stored before the stop
    shown: dict | None  # a record of the complete run the page shows for the same series instead, if any

    @property
    def first(self) -> dict:
        return self.records[0] if self.records else self.stop

    @property
    def reached(self) -> Tally:
        """The verdicts it stored before the stop, as stored: a pass of a run that never finished is no pass
        (the gates read it as an error), but what it had reached is worth saying."""
        return Tally.of_records(self.records, strict=False)

    @property
    def failing(self) -> list[dict]:
        """The fails and errors it reached before the stop: each was decided, whatever came after."""
        return [r for r in self.records if r["kind"] == "oracle" and r.get("verdict") in FAILING]

    @property
    def figures(self) -> int:
        return sum(len(r.get("figures") or {}) for r in self.records if r["kind"] == "measure")


def incomplete_runs(inp: "Inputs") -> list[IncompleteRun]:
    """The stopped runs that started after the current run of their series (or whose series has none).
    A stopped run a complete run of the same series came after is history, and left out."""
    shown: dict[tuple, dict] = {}
    for r in inp.current:
        key = series_of(r)
        if key not in shown or (r["started"], r["run_id"]) > (shown[key]["started"], shown[key]["run_id"]):
            shown[key] = r
    runs: dict[str, list[dict]] = {}
    for r in inp.stopped:
        runs.setdefault(r["run_id"], []).append(r)
    out = []
    for run_id, rows in runs.items():
        stop = next((r for r in rows if r["case"] == "run" and r.get("verdict") == "error"), rows[0])
        own = [r for r in rows if r is not stop]
        current = shown.get(series_of(own[0] if own else stop))
        if current is not None and (current["started"], current["run_id"]) > (stop["started"], run_id):
            continue
        out.append(IncompleteRun(run_id, inp.stopped_how.get(run_id, "stopped"), stop, own, current))
    return sorted(out, key=lambda run: (run.stop["device"], run.stop["started"], run.run_id))


def incomplete(inp: Inputs) -> Section | None:
    runs = inp.incomplete
    if not runs:
        return None
    older = len(set(inp.stopped_how)) - len(runs)
    rows = [[cell(run.run_id), cell(run.first["experiment"]), cell(run.first["device"]),
             cell(implementations.of(run.first).backend), cell(run.stop["started"]), cell(run.how, cls="unjudged"),
             cell(run.reached.as_dict(), text=run.reached.phrase(), cls="fail" if run.failing else "unjudged"),
             cell(run.figures, text=f"{run.figures} (not shown)" if run.figures else "none", cls="unjudged"),
             cell(None if run.shown is None else run.shown["run_id"],
                  text="none: no complete run of it" if run.shown is None
                  else f"run {run.shown['run_id']}, started {run.shown['started']}")]
            for run in runs]
    return Section("incomplete", "Incomplete runs", [
        f"{len(runs)} run(s) were stopped before they ended (killed, or interrupted by a signal: a time limit, "
        "Ctrl-C) and no complete run of the same experiment, device and config came after them. A stopped run is "
        "incomplete, drawn grey: being stopped says nothing about the code, so it is never a failing verdict; and "
        "what it did not finish is never current: a pass it reached is not a pass, its figures are neither shown "
        "as current nor judged for a regression. A fail or an error it reached before the stop was decided, and "
        "counts as one. Where the same series has a complete run, the page shows that run instead (\"shown "
        "instead\")." + (f" {older} older stopped run(s), each followed by a complete run, are left out."
                          if older else "")],
        [Table("runs stopped before they ended", ["run", "experiment", "device", "backend", "started",
                                                  "how it ended", "reached", "figures", "shown instead"], rows)])


# --- sections -------------------------------------------------------------------------------------


# Oracles that pass only on equality, bit for bit or byte for byte (their margin is minus the count of
# values that differ): a pass is "bit-exact", never "margin 0", which would read as "on the edge".
EXACT_ORACLES = frozenset({"bitexact", "cache_bytes", "exact_state", "pad_identity", "determinism"})


def verdict_text(oracle: str, tally: Tally, margin: float | None, reason: str = "") -> str:
    """A cell's words: each state's count ("3 pass, 1 not supported"), bit-exact or the smallest margin where
    something was judged, and a refusal's own reason where nothing was."""
    if not tally.judged and tally.unjudged == tally.total:
        return tally.phrase() + (f": {reason}" if reason else "")
    if oracle in EXACT_ORACLES and tally[PASS] == tally.total:
        return f"{tally.phrase()}, bit-exact"
    return tally.phrase() + (f", margin {format_number(margin)}" if margin is not None else "")


def verdict_class(tally: Tally) -> str:
    """A cell's colour: red where a verdict fails or errs, grey where nothing was judged (a refusal is never
    red), green otherwise."""
    return "fail" if tally.failed else "unjudged" if not tally[PASS] else "pass"


def oracle_matrix(inp: Inputs) -> Section | None:
    """Device x backend x model x oracle: how many passed, the smallest margin (or bit-exact), a link
    to the worst record."""
    oracles = [r for r in inp.current if r["kind"] == "oracle"]
    if not oracles:
        return None
    columns = sorted({f"{r['experiment']}:{r['oracle']}" for r in oracles})
    rows = []
    for impl in sorted({implementations.of(r) for r in oracles}):
        row = [cell(impl.device), cell(impl.backend), cell(impl.model)]
        for column in columns:
            group = [r for r in oracles if implementations.of(r) == impl and f"{r['experiment']}:{r['oracle']}" == column]
            if not group:
                row.append(cell(None))
                continue
            # the worst: a failing verdict, then a pass by its margin, then a refusal (never worse than a pass)
            worst = min(group, key=lambda r: (verdicts.of(r) not in FAILING, verdicts.of(r) in UNJUDGED,
                                              _number(r.get("margin"), math.inf)))
            tally = Tally.of_records(group)
            margin = _number(worst.get("margin"), None) if tally.judged else None
            value = {"passed": tally[PASS], "total": tally.total, **tally.as_dict(), "margin": margin,
                     "bit_exact": worst["oracle"] in EXACT_ORACLES and tally[PASS] == tally.total,
                     "worst_record": worst["record_id"]}
            row.append(cell(value, inp.cite(worst), verdict_class(tally),
                            text=verdict_text(worst["oracle"], tally, margin, str(worst.get("detail") or ""))))
        rows.append(row)
    for r in oracles:
        if verdicts.of(r) in FAILING:
            inp.cite(r)
    lines = [f"Oracle verdicts in the current runs: {Tally.of_records(oracles).phrase()}. Each cell links to its "
             "worst record (the failing one, else the smallest margin). A verdict of a run that did not end "
             "complete never counts as a pass; a refusal (not supported) or a verdict not judged is grey, never "
             "red, and never a pass."]
    return Section("oracles", "Oracle matrix", lines,
                   [Table("device x backend x model x experiment:oracle", ["device", "backend", "model", *columns],
                          rows, framed=True)])


def _number(value, default):
    number = pd.to_numeric(value, errors="coerce") if value is not None else None
    return default if number is None or pd.isna(number) else float(number)


def tail_sweep(inp: Inputs) -> Section | None:
    """The tail experiment's sweep per device and source, in breakeven's columns (the experiment's own
    sweep_frame reads its records), with the seed's sweep beside it tail by tail."""
    records = inp.current_of("tail", "measure")
    if not records:
        return None
    sweep_frame = experiments.load("tail").sweep_frame
    seed_df = breakeven.read_sweep_csv(inp.fixtures / seed.TAIL_SWEEP)
    seed_breakeven = breakeven.breakeven_tail(seed_df)
    beside = seed_df.set_index("tail")
    section = Section("tail", "Breakeven: padded vs scalar tail", [
        f"Seed ({seed.source_line(inp.fixtures / seed.TAIL_SWEEP)}): breakeven tail {seed_breakeven}, "
        f"{breakeven.breakeven_interval(seed_df)['says']}; tails below it stay scalar. Each measured breakeven "
        "below says its interval at 95% (a bootstrap over its repetitions), or that it is undecided and about "
        "how many more repetitions would decide it."])
    for impl in sorted({implementations.of(r) for r in records}):
        of_impl = [r for r in records if implementations.of(r) == impl]
        flat = pd.json_normalize(of_impl, sep=".")
        frame = sweep_frame(flat)
        if frame.empty:  # an emulated device's tail runs: its times listed apart, its exact counts decide
            counted_breakevens(inp, section, impl, sweep_frame(flat, "instructions"), of_impl[0]["config"])
            continue
        for source, rows in frame.groupby("source", sort=False):
            name = sweep_name(impl, str(source), of_impl[0]["config"])
            table = breakeven.tail_table(rows)
            point = breakeven.breakeven_tail(rows)
            # the decision with its confidence (testbed.measure.decisions): an interval, or undecided
            decision = breakeven.breakeven_interval(rows)
            said = decision["says"] if point is not None else f"not reached up to tail {int(rows['tail'].max())}"
            table["seed padded tok/s"] = [beside.padded_tps.get(t) for t in table["tail"]]
            table["seed scalar tok/s"] = [beside.scalar_tps.get(t) for t in table["tail"]]
            table["seed winner"] = [breakeven.winner(beside.padded_tps[t], beside.scalar_tps[t])
                                    if t in beside.index else None for t in table["tail"]]
            section.tables.append(frame_table(f"{name}: breakeven tail {said} (seed: {seed_breakeven})", table))
            of_seed = str(source).startswith("fixture:")  # the seed's own sweep, loaded as records
            section.images.append({"file": plots.tail_plot(inp.out, name, rows, point,
                                                           None if of_seed else seed_df, seed_breakeven),
                                   "caption": f"{name}: throughput against tail (log scale), breakeven {said}"
                                              + ("" if of_seed else f", the seed's {seed_breakeven} dashed")})
            inp.breakevens.append({"device": impl.device, "backend": impl.backend, "model": impl.model,
                                   "source": source, "tail": point,
                                   "threshold": breakeven.threshold_from_breakeven(point),
                                   **{key: decision.get(key) for key in ("lo", "hi", "decided", "level", "method",
                                                                         "reps", "says")}})
    return section


def counted_breakevens(inp: Inputs, section: Section, impl: implementations.Implementation, counted: pd.DataFrame,
                       config: dict) -> None:
    """A device that counts and whose times are never speed (emulated): each source's table of
    instructions per mode and its breakeven by instructions, exact (the tail experiment's own
    MIN_SWEEP_TAILS: fewer tails are a comparison, not a sweep)."""
    for source, rows in counted.groupby("source", sort=False) if len(counted) else ():
        if rows["tail"].nunique() < experiments.load("tail").MIN_SWEEP_TAILS:
            continue
        name = sweep_name(impl, str(source), config)
        point, decision = breakeven.breakeven_tail(rows), breakeven.breakeven_interval(rows, by="instructions")
        said = decision["says"] if point is not None else f"not reached up to tail {int(rows['tail'].max())}"
        section.tables.append(frame_table(f"{name}: breakeven tail by instructions {said}",
                                          breakeven.instruction_table(rows)))
        inp.breakevens.append({"device": impl.device, "backend": impl.backend, "model": impl.model,
                               "source": source, "tail": point, "by": "instructions",
                               "threshold": breakeven.threshold_from_breakeven(point),
                               **{key: decision.get(key) for key in ("lo", "hi", "decided", "level", "method",
                                                                     "reps", "says")}})


def sweep_name(impl: implementations.Implementation, source: str, config: dict) -> str:
    """A tail sweep's name: its implementation's label, then the words of its source (tail.source_label:
    "device/backend hHIDDENxLAYERS wWINDOW C=.. dtype sink=..", or the seed's "fixture:FILE") the label
    does not already say. Label and source side by side named the device, the backend and the model
    twice ("host / refimpl / 6 layers x 512, window 512 host/refimpl h512x6 w512 C=128 ...")."""
    said = {f"{impl.device}/{impl.backend}"}
    shape = [config.get(f"shape.{k}") for k in ("layers", "hidden", "window")]
    if None not in shape and impl.model == f"{shape[0]} layers x {shape[1]}, window {shape[2]}":
        said |= {f"h{shape[1]}x{shape[0]}", f"w{shape[2]}"}
    if config.get("fixture") and impl.model == f"seed {PurePath(str(config['fixture'])).stem}":
        said.add(f"fixture:{config['fixture']}")
    rest = [word for word in source.split() if word not in said]
    return ", ".join([impl.label, " ".join(rest)]) if rest else impl.label


def chunk_choice_table(measured: ChunkMeasures, lengths: list[int], weights, reply: int,
                       choices: list[dict]) -> pd.DataFrame:
    """Projected cost per chunk size C over the utterance-length distribution (chunk_prefill's
    projection: ceil(n / C) chunk calls then the reply's decode steps), a last row token by token, and
    beside each the choice as the decisions made it, with their confidence (chunk_prefill.choices): the
    best C alone, the C not distinguishable from it ("undecided"), a tie of exact counts, and whether
    token by token is faster than the best C. By time; on a device whose times are not speed, by
    instructions."""
    by = "time" if measured.time and not measured.emulated else "instructions"
    calls = measured.time if by == "time" else measured.instructions
    decode = measured.decode if by == "time" else measured.decode_instructions
    unit = "s" if by == "time" else "instructions"
    steps = [float(np.median(v)) for v in decode.values() if v]
    step = float(np.median(steps)) if steps else None
    p = np.asarray(weights if weights is not None else [1.0] * len(lengths), float)
    mean_tokens = float(np.dot(p / p.sum(), lengths))
    best = next((d for d in choices if d["decision"] == "best C" and d["by"] == by), None)
    versus = next((d for d in choices if d["decision"].endswith("vs token by token") and d["by"] == by), None)
    rows = []
    for c, xs in sorted(calls.items()):
        call = float(np.median(xs))
        mark = ""
        if best is not None and c in best["candidates"]:
            if best["tie"]:
                mark = f"<- best, a tie ({decisions.label(best)})"
            elif best["decided"]:
                mark = f"<- best ({best['level']:.0%} confidence)"
            else:
                mark = "undecided: best by median" if c == best["best"] else "undecided: not distinguishable"
        if (best is None or c == best["best"]) and versus is not None and versus["faster"] == "token by token":
            mark += ("; " if mark else "") + "token by token is faster"
        rows.append({"C": c, f"chunk call {unit}": call,
                     f"expected {unit}": chunk_prefill.calls_per_utterance(c, lengths, weights) * call
                     + reply * (step or 0.0), "choice": mark})
    if step is not None:
        mark = ""
        if versus is not None:
            mark = (f"<- faster than C={versus['chunk']}" if versus["faster"] == "token by token" else
                    f"undecided against C={versus['chunk']}" if not versus["decided"] else "")
        rows.append({"C": "token by token", f"chunk call {unit}": None,
                     f"expected {unit}": (mean_tokens + reply) * step, "choice": mark})
    return pd.DataFrame(rows)


def chunk_choice(inp: Inputs) -> Section | None:
    section = Section("chunk", "Chunk-size choice, with its confidence")
    quoted = inp.settings["seed_decode_s_per_token"]
    measures = inp.current_of("chunk_prefill", "measure")
    # one choice per device, backend and model: refimpl's calls say nothing about native's best C
    for label, measured, settings in chunk_prefill.measured_chunks(pd.json_normalize(measures, sep=".")
                                                                   if measures else pd.DataFrame()):
        lengths = settings["lengths"] or list(inp.settings["utterance_lengths"])
        if not measured.decode and settings["device"] in quoted:  # no decode step measured: the seed's quoted one
            measured.decode = {c: [quoted[settings["device"]]] for c in measured.time}
        choices = chunk_prefill.choices(measured, lengths, settings["weights"], settings["reply"])
        if not (measured.time or measured.instructions):
            continue
        section.tables.append(frame_table(f"{label}: utterances of {lengths} tokens, reply {settings['reply']}",
                                          chunk_choice_table(measured, lengths, settings["weights"],
                                                             settings["reply"], choices)))
        section.lines += [f"{label}: {chunk_prefill.choice_line(d)}" for d in choices]
        inp.choices += [decisions.as_choice(d, label) for d in choices]
    for impl in sorted({implementations.of(r) for r in measures}):
        calls, decode_s, spread = chunk_times([r for r in measures if implementations.of(r) == impl])
        if calls:
            section.images.append({"file": plots.chunk_plot(inp.out, impl.label, calls, decode_s or quoted.get(
                impl.device), spread), "caption": f"{impl.label}: chunk call and decode time against C"})
    if not section.tables:
        return None
    lengths = inp.settings["utterance_lengths"]
    seed_calls = pd.read_csv(inp.fixtures / seed.CHUNK_PREFILL, comment="#").dropna(subset=["chunk_call_s"])
    for target, rows in seed_calls.groupby("target", sort=False):
        calls = {int(c): [float(t)] for c, t in zip(rows.chunk, rows.chunk_call_s)}
        measured = ChunkMeasures(calls, {c: [quoted[target]] for c in calls} if target in quoted else {})
        choices = chunk_prefill.choices(measured, lengths, None, 0)
        section.tables.append(frame_table(f"seed: {target}, utterances of {lengths} tokens, no reply "
                                          f"({seed.CHUNK_PREFILL})",
                                          chunk_choice_table(measured, lengths, None, 0, choices)))
        section.lines += [f"seed {target}: {chunk_prefill.choice_line(d)}" for d in choices]
    section.lines.insert(0, "Each C's expected cost per utterance: ceil(n / C) chunk calls then the reply's decode "
                            "steps, over the run's utterance lengths; token by token: every token a decode step. The "
                            "choice is a decision with its confidence (testbed/measure/decisions.py): the best C alone "
                            "at 95%, or undecided with the C not distinguishable from it; the seed's figures are "
                            "medians without repetitions, so they decide nothing. Decode without a measured step: "
                            "the time the seed quotes for it (experiments/report.yaml).")
    return section


def chunk_times(records: list[dict]) -> tuple[dict[int, float], float | None, dict[int, tuple[float, float]]]:
    """Seconds per chunk call by C (median, and its min and max), and per decode step, from
    chunk_prefill's measure records (params.form chunk_call / decode_step, figures.time)."""
    calls, decode, spread = {}, None, {}
    for r in records:
        fig = r["figures"].get("time")
        if r["kind"] != "measure" or fig is None:
            continue
        scale = chunk_prefill.TIME_SCALE[fig["unit"]]
        if r["params"].get("form") == "chunk_call":
            c = int(r["params"]["chunk"])
            calls[c] = fig["median"] * scale
            spread[c] = (fig.get("min", fig["median"]) * scale, fig.get("max", fig["median"]) * scale)
        elif r["params"].get("form") == "decode_step":
            decode = fig["median"] * scale
    return calls, decode, spread


def engines(inp: Inputs) -> Section | None:
    """The engines under test side by side (chunk_prefill's engines table over the current chunk_prefill and
    tail records of every engine:NAME backend): verdict per technique, speed at the best C with its
    confidence, peak RSS and export size."""
    records = [r for r in inp.current_of("chunk_prefill") + inp.current_of("tail")
               if str(r.get("backend", "")).startswith("engine:")]
    if not records:
        return None
    table = experiments.load("chunk_prefill").engines(pd.json_normalize(records, sep="."))
    if table.empty:
        return None
    return Section("engines", "Engines under test", [
        "One row per engine, technique, device and model: the verdict over the technique's oracles (a refusal "
        "is not supported, with the engine's reason, never a failure); at the best C by projected utterance "
        "latency (with its confidence), the chunk call's prefill tokens/s and CPU time, each the median with "
        "the 95% interval of the median (lo, hi); the engine process's largest peak RSS (VmHWM) and, for an "
        "exporter-based engine, its export's size on disk."], [frame_table("engines", table)])


def spread_cell(fig: dict) -> dict:
    """A figure's spread: the standard deviation of its repetitions (as llama-bench prints t/s +- sd), or
    its least and greatest where the record keeps no repetitions (a seed's quoted figure, an ingested row)."""
    samples = fig.get("samples") or []
    if len(samples) >= 2:
        sd = float(np.std(samples, ddof=1))
        return cell(sd, text=f"± {format_number(sd)}")
    if fig["min"] == fig["max"] == fig["median"]:
        return cell(None, text="one repetition" if fig["reps"] == 1 else "")
    return cell(None, text=f"{format_number(float(fig['min']))}-{format_number(float(fig['max']))} (min-max)")


def threads_of(record: dict):
    return record["params"].get("threads", record["config"].get("threads", record["config"].get("bench.threads")))


def numbers(inp: Inputs) -> Section | None:
    """Per device, one table of the numbers that matter, one row per figure of its current runs (as
    llama-bench prints model, backend, threads, test, t/s +- sd): what it is of, its value and spread,
    the record's exact instruction count where it has one, and the commit it was measured at. Machine
    probes measure the machine and are left out; an emulated device's times are not speeds (they are
    listed apart): its rows are its counts."""
    section = Section("numbers", "The numbers, per device", [
        "One row per figure of each device's current runs: value is the median of the repetitions, ± their "
        "standard deviation (or their least-greatest where only those are stored); instructions is the same "
        "record's exact count, where it was counted. Each column is explained under \"Reading the tables\"."])
    columns = ["experiment", "backend", "model", "shape (case)", "threads", "figure", "value", "spread", "unit",
               "instructions", "commit"]
    measures = [r for r in inp.current if r["kind"] == "measure"]
    for device in sorted({r["device"] for r in measures}):
        rows = []
        for r in sorted((r for r in measures if r["device"] == device),
                        key=lambda r: (r["experiment"], implementations.of(r), r["case"])):
            impl = implementations.of(r)
            counts = [f for f in r["figures"].values() if history.is_count(f)]
            count = cell(counts[0]["median"], text=f"{counts[0]['median']:,.0f}") if counts else cell(None)
            shown = [(n, f) for n, f in sorted(r["figures"].items()) if not history.is_count(f)
                     and not history.is_probe(r, n)] or ([("instructions", None)] if counts else [])
            for name, fig in shown:
                rows.append([cell(r["experiment"]), cell(impl.backend), cell(impl.model), cell(r["case"]),
                             cell(threads_of(r)), cell(name),
                             cell(None if fig is None else fig["median"]),
                             cell(None) if fig is None else spread_cell(fig),
                             cell(None if fig is None else fig["unit"]), count, cell(str(r["git_commit"])[:10])])
        if rows:
            section.tables.append(Table(f"{device}: every figure of its current runs", columns, rows))
    return section if section.tables else None


GDN_BENCH_FIGURES = {"time", "tokens_per_s", "gflops"}


def is_gdn_bench(record: dict) -> bool:
    """A gdn experiment's own bench record (ingested test-backend-ops perf rows are gdn measures too)."""
    return (record["params"].keys() >= {"chunk", "tokens", "form"} and record["figures"].keys() >= GDN_BENCH_FIGURES
            and "speedup_vs_serial" in record["metrics"])  # sgemm_fraction: host runs only


def gdn_throughput(inp: Inputs) -> Section | None:
    measures = [r for r in inp.current_of("gdn", "measure") if is_gdn_bench(r)]
    if not measures:
        return None
    section = Section("gdn", "GDN throughput per device, backend and model")
    section.lines.append("Median of the repetitions with their min and max; GFLOP/s on gdn_flops' serial count "
                         "for both forms. No ratio over numpy's sgemm is printed here: the gdn run times sgemm "
                         "between the kernel's repetitions by the wall clock, and on a loaded night the two medians "
                         "drift apart (\"of sgemm\" read 1.3-8.2 on one night). The ratio that means something is "
                         "measured interleaved, pair by pair (testbed/measure/blas_reference.py): `testbed run "
                         "native_bench` stores it, shown under Other measurements.")
    for impl in sorted({implementations.of(r) for r in measures}):
        rows = [{"tokens": r["params"]["tokens"], "form": r["params"]["form"], "chunk": r["params"]["chunk"],
                 "threads": r["params"].get("threads", 1), "ms": r["figures"]["time"]["median"],
                 "min ms": r["figures"]["time"]["min"], "max ms": r["figures"]["time"]["max"],
                 "tokens/s": r["figures"]["tokens_per_s"]["median"],
                 "GFLOP/s": r["figures"]["gflops"]["median"], "x serial": r["metrics"]["speedup_vs_serial"],
                 "reps": r["figures"]["time"]["reps"]}
                for r in measures if implementations.of(r) == impl]
        df = pd.DataFrame(rows).sort_values(["tokens", "form", "chunk", "threads"]).reset_index(drop=True)
        section.tables.append(frame_table(impl.label, df))
        if impl.backend in REFERENCE_NOTES:
            section.lines.append(f"{impl.label}: {REFERENCE_NOTES[impl.backend]}")
    return section


# What a reference backend's times mean, said beside them: a reference path slower than serial is by design.
REFERENCE_NOTES = {
    "refimpl": "the numpy reference, the oracles' ground truth, is written to be read, not to be fast: its "
               "chunkwise form, many small numpy calls per chunk, is meant to be slower than its serial one "
               "(x serial below 1), and its times say nothing of a kernel's."}


def other_measurements(inp: Inputs) -> Section | None:
    """Every current measurement no section above is about (e.g. ingested test-backend-ops perf rows):
    each figure's median with its spread, so whatever the project stores is in the report."""
    shown = {"tail", "chunk_prefill"}
    rest = [r for r in inp.current if r["kind"] == "measure" and r["experiment"] not in shown
            and not (r["experiment"] == "gdn" and is_gdn_bench(r))]
    if not rest:
        return None
    rows = [[cell(r["experiment"]), cell(r["device"]), cell(implementations.of(r).backend),
             cell(implementations.of(r).model), cell(r["case"]),
             cell(name, text=f"{name} (machine probe)" if history.is_probe(r, name) else name),
             cell(_number(fig.get("median"), None)), cell(_number(fig.get("min"), None)),
             cell(_number(fig.get("max"), None)), cell(fig.get("reps")), cell(fig.get("unit")),
             cell(r["record_id"][:12], inp.cite(r))]
            for r in sorted(rest, key=lambda r: (r["experiment"], implementations.of(r), r["case"]))
            for name, fig in sorted(r["figures"].items()) if isinstance(fig, dict) and not history.is_count(fig)]
    if not rows:
        return None
    return Section("measurements", "Other measurements", [
        "Current measurements of experiments and tools the sections above do not cover (instruction counts "
        "have their own section). A machine probe measures the machine, never the code: it is not judged."],
        [Table("measure records", ["experiment", "device", "backend", "model", "case", "figure", "median", "min",
                                   "max", "reps", "unit", "record"], rows)])


def instruction_counts(inp: Inputs) -> Section | None:
    """Exact instruction counts per device x backend x model, one row per kernel and shape (the case),
    the latest count beside the one before it and the time of the same record (never in a table of
    times); then every change of a count in the window, with its commit range."""
    latest = [row for row in history.count_series(inp.records) if row["record"]["run_id"] in
              {r["run_id"] for r in inp.current}]
    changes = history.count_changes(inp.records, inp.settings.get("instruction_rise", history.INSTRUCTION_RISE))
    if not latest and not changes:
        return None
    rise = inp.settings.get("instruction_rise", history.INSTRUCTION_RISE)
    section = Section("instructions", "Instruction counts", [
        f"Exact counts (unit instructions: emulated devices, valgrind on the host): any change from one run to the "
        f"next is listed with its commit range (the last commit with the old count .. the first with the new); a "
        f"rise above {rise:.1%} (instruction_rise) is a regression of the run where it first appears, named once; "
        "a fall is an improvement. Emulated devices' counts are judged (they are exact); their times never are."])
    by_record = {r["record_id"]: r for r in inp.current}
    for impl in sorted({implementations.of(row["record"]) for row in latest}):
        rows = []
        for row in sorted((x for x in latest if implementations.of(x["record"]) == impl),
                          key=lambda x: (x["series"][0], x["series"][3], x["what"])):
            record = row["record"]
            full = by_record.get(record["record_id"], record)
            timing = next((f for n, f in full["figures"].items() if history.kind_of(full, n) == "speed"
                           and history.lower_is_better(f.get("unit", ""))), None)
            change = (None if row["previous"] in (None, 0) else row["count"] / row["previous"] - 1)
            rows.append([cell(record["experiment"]), cell(record["case"], inp.cite(record)), cell(row["what"]),
                         cell(row["count"], text=f"{row['count']:,.0f}"),
                         cell(row["previous"], text="" if row["previous"] is None else f"{row['previous']:,.0f}"),
                         cell(None if change is None else 100 * change,
                              text="" if change is None else f"{change:+.2%}",
                              cls="fail" if change is not None and change > rise else None),
                         cell(None if timing is None or record.get("emulated") else _number(timing.get("median"), None),
                              text="emulated: not a speed" if record.get("emulated") else None),
                         cell(None if timing is None or record.get("emulated") else timing.get("unit")),
                         cell(row["runs"])])
        section.tables.append(Table(f"{impl.label}: instructions per kernel and shape",
                                    ["experiment", "case (kernel, shape)", "figure", "instructions", "run before",
                                     "change", "time (median)", "time unit", "runs"], rows))
    if changes:
        section.tables.append(Table("every change of a count, oldest first", [
            "experiment", "device", "case", "figure", "before", "after", "change", "verdict", "commits"],
            [[cell(c.series[0]), cell(c.series[1]), cell(c.series[3], inp.cite(c.new)), cell(c.what),
              cell(c.before, text=f"{c.before:,.0f}"), cell(c.after, text=f"{c.after:,.0f}"),
              cell(100 * c.change, text=f"{c.change:+.2%}", cls="fail" if c.regression else None), cell(c.verdict),
              cell(f"{str(c.old['git_commit'])[:10]}..{str(c.new['git_commit'])[:10]}")] for c in changes]))
    return section


def nights_over_time(inp: Inputs) -> Section | None:
    judged, unplotted = plots.judged_plots(inp.out, history.judge_figures(
        inp.records, inp.settings["judged_runs"], inp.settings["min_history"]), inp.flags)
    images = judged + plots.history_plots(inp.out, inp.records, inp.settings["history_nights"])
    if not images:
        return None
    lines = ["Then one plot per experiment, device, backend and model; one point per run, placed by its commit "
             "and night."]
    if judged:
        lines.insert(0, "First, each judged timing with at least two runs, flagged or not (the flagged ones first, "
                        "then each step the machine or a revert explained): the runs' medians with their min-max "
                        "bars on an axis of commits and nights; where a step was found, the level before as a "
                        f"band (+-{plots.BAND:g} x its run-to-run noise), the new level dashed and its runs "
                        "marked." + (f" {unplotted} more judged timings are not drawn (at most "
                                     f"{plots.MAX_JUDGED_PLOTS}); report.json and `testbed compare` have them."
                                     if unplotted else ""))
    return Section("history", "Throughput over recent nights", lines, images=images)


def regressions(inp: Inputs) -> Section:
    flags = inp.flags
    rise = inp.settings.get("instruction_rise", history.INSTRUCTION_RISE)
    alpha = inp.settings.get("ab_alpha", history.AB_ALPHA)
    section = Section("regressions", "Regressions", [
        f"A timing is flagged once (the rates computed from it named beside it) when the per-run medians of the "
        f"same experiment, device and config (the last {inp.settings['judged_runs']} runs) step to a worse level, "
        f"seen in at least {history.MIN_LATEST} runs after at least {inp.settings['min_history']}, by more than the "
        f"run-to-run noise allows and by at least {history.MIN_CHANGE:.0%}, its latest run still nearer the new "
        "level, and the new level begins with a commit never measured at the old one (a step over runs of one "
        "commit is the machine's); where the machine probe ran, the flag says how much the machine slowed, and a "
        f"step the machine explains (less than {history.MIN_CHANGE:.0%} beside it) is not flagged (testbed.measure.history).",
        f"An instruction count (exact) is flagged on the run where it first rises by more than {rise:.1%}; an A/B "
        f"ratio on the night its paired test says B is slower (p < {alpha:g} after Holm's correction over the "
        f"night's A/B figures, and at least {history.MIN_CHANGE:.0%}); an oracle when it passed before and fails "
        "now. A machine probe is never flagged."])
    judged = history.judge_figures(inp.records, inp.settings["judged_runs"], inp.settings["min_history"])
    unjudged = [j for j in judged if j.verdict.reason.startswith("not judged")]
    if unjudged:
        section.lines.append(f"Not judged yet: {len(unjudged)} of {len(judged)} current measured quantities, whose "
                             f"history is too short (e.g. {unjudged[0].what} of {unjudged[0].series[0]} "
                             f"{unjudged[0].series[3]} on {unjudged[0].series[1]}: {unjudged[0].verdict.reason}).")
    explained = [j for j in judged if j.verdict.reason.startswith(("the machine's", "back:"))]
    for j in explained:
        section.lines.append(f"Not flagged: {j.what} of {j.series[0]} {j.series[3]} on {j.series[1]}: "
                             f"{j.verdict.reason}.")
    if not flags:
        section.lines.append("None: no current figure has stepped to a worse level beyond the run-to-run noise "
                             "of its history, no instruction count rose, no A/B pair says B is slower, and no "
                             "oracle that passed before fails now.")
        return section
    rows = []
    for f in flags:
        record = next(r for r in inp.records if r["record_id"] == f.record_id)
        what = f"{f.what} (and {', '.join(f.derived)})" if f.derived else f.what
        evidence = (f"{f.ab.get('pairs')} pairs, {f.ab.get('test')}: p {f.ab.get('p'):.2g}, Holm "
                    f"{f.ab.get('p_corrected'):.2g}; A {str(f.ab.get('a_commit'))[:10]}, B "
                    f"{str(f.ab.get('b_commit'))[:10]}; its own verdict: {f.ab.get('verdict')}") if f.ab else ""
        rows.append([cell(f.kind), cell(f.experiment), cell(f.device), cell(implementations.of(record).backend),
                     cell(f.config_key),
                     cell(f.case, inp.cite(record)), cell(what), cell(f.now), cell(f.before), cell(f.spread),
                     cell(f.change, cls="fail"), cell(f.since), cell(f.commit_range()), cell(f.machine),
                     cell(f.ab, text=evidence)])
    section.tables.append(Table("flags", ["kind", "experiment", "device", "backend", "config", "case", "what", "now",
                                          "before (level)", "before (noise)", "change", "since",
                                          "commits (last old .. first new)", "machine", "A/B evidence"], rows))
    return section


def nights(inp: Inputs) -> Section | None:
    if not inp.nights:
        return None
    rows = [[cell(n["night"]), cell(n["suite"]), cell(n["started"]),
             cell(n.get("finished"), text=n.get("finished") or "never: the night was killed, or is still running"),
             cell("; ".join(f"{d}: {s['status']}" + (f" ({s['reason']})" if s["reason"] else "")
                            for d, s in n.get("devices", {}).items())),
             cell(n.get("exit_status"), cls="pass" if n.get("exit_status") == 0 else "fail")]
            for n in inp.nights[-inp.settings["history_nights"]:]]
    return Section("nights", "Recent nights", tables=[Table("nightly runs", ["night", "suite", "started",
                                                                             "finished", "devices", "exit"], rows)])


def run_line(r: dict) -> str:
    """One run in one line: what ran where, when, at which commit."""
    impl = implementations.of(r)
    return (f"{r['experiment']} on {impl.label}, started {r['started']}, commit {str(r['git_commit'])[:10]}, "
            f"testbed {r['testbed_version']}, run {r['run_id']}, config {history.config_key(r)}")


def provenance(inp: Inputs) -> Section:
    """Each current run and each device's fingerprint as one line, its values folded away beneath it."""
    runs = {}
    for r in inp.current:
        runs.setdefault(r["run_id"], r)
    details = [{"summary": run_line(r),
                "data": {k: v for k, v in r["config"].items() if not k.startswith("device.")}}
               for r in sorted(runs.values(), key=lambda r: (r["experiment"], implementations.of(r), r["started"]))]
    fingerprints = {}
    for r in sorted(inp.current, key=lambda r: r["started"]):
        fingerprints[r["device"]] = r["fingerprint"]
    details += [{"summary": f"{device}: device fingerprint of its latest run", "data": fingerprint}
                for device, fingerprint in sorted(fingerprints.items())]
    tools = dict(inp.nights[-1]["tools"]) if inp.nights else tool_versions()
    return Section("provenance", "Provenance", [
        "Tool versions " + ("of the last night: " if inp.nights else "where the report was built: ")
        + ", ".join(f"{k} {v}" for k, v in tools.items()),
        f"{len(runs)} current runs, then each device's fingerprint, one line each; the values are folded beneath "
        "each line on the page, and in report.json."], details=details)


def cited_records(inp: Inputs) -> Section | None:
    if not inp.referenced:
        return None
    rows = [[cell(r["record_id"][:12], cls="anchor"), cell(r["experiment"]), cell(r["device"]),
             cell(implementations.of(r).backend), cell(r["case"]), cell(r.get("oracle") or ""),
             cell(r.get("verdict") or ""), cell(_number(r.get("margin"), None)),
             cell(r["run_id"]), cell(r["started"]), cell(r.get("detail", ""))]
            for r in sorted(inp.referenced.values(), key=lambda r: (r["experiment"], r["device"], r["case"]))]
    return Section("records", "Records referenced above",
                   ["Every record is in the results store (records.jsonl) under its record_id."],
                   [Table("records", ["record", "experiment", "device", "backend", "case", "oracle", "verdict",
                                      "margin", "run", "started", "detail"], rows)])


# --- reading the tables: each column explained once -------------------------------------------------

# Every column a table of the report may have, said once. The oracle matrix's columns are named
# EXPERIMENT:ORACLE (ORACLE_COLUMN). tests/test_report_commands.py checks that every column on a page is here.
GLOSSARY = {
    "engine": "the engine under test (engines/NAME.yaml, or a lab's): backend=engine engine=NAME",
    "technique": "the experiment its verdicts and figures come from (chunk_prefill, tail)",
    "oracles": "how many of the technique's oracle verdicts are in each state (pass, fail, not supported, ...)",
    "reason": "the engine's own words where it refused (not supported): never a failure, never a pass",
    "best C": "the chunk size of lowest projected utterance latency over the measured C (by the medians)",
    "best C says": "that choice with its confidence: the C not distinguishable from it at 95% (bootstrap)",
    "prefill tok/s": "rows of the chunk call of C rows (at the best C) per second of its wall time, median",
    "tok/s lo": "the low end of the 95% bootstrap interval of that median (none below 5 repetitions)",
    "tok/s hi": "the high end of that interval",
    "CPU ms": "the chunk call's CPU time at the best C (the engine process's, by its own clock), median",
    "CPU ms lo": "the low end of the 95% bootstrap interval of that median",
    "CPU ms hi": "the high end of that interval",
    "peak RSS MB": "the largest peak resident memory (VmHWM) of the engine process over its requests, where the "
                   "device lets it be read (not on emulated devices)",
    "export MB": "an exporter-based engine's export on disk (what a phone holds): bytes of its files",
    "device": "the device profile the run used (devices/NAME.yaml); host is this machine",
    "backend": "what computed it: refimpl (the numpy reference), native (testbed's C kernels), iree, llamacpp, "
               "or engine:NAME (an engine under test)",
    "model": "what was run: a checkpoint or seed, or the size of the reference model or GDN shape",
    "experiment": "the experiment that stored the record (experiments/experiment/NAME.yaml)",
    "case": "what the record is of within its experiment: a kernel and shape, an oracle's input, an A/B call",
    "shape (case)": "the record's case: the kernel or call and the shape it was measured at",
    "case (kernel, shape)": "the record's case: the kernel or call and the shape it was counted at",
    "threads": "the threads the kernel ran on",
    "figure": "which measured quantity of the record: time, tokens_per_s, gflops, instructions, an A/B ratio",
    "value": "the figure's median over its repetitions",
    "spread": "± the standard deviation of its repetitions, or their least-greatest where only those are kept",
    "unit": "the figure's unit (ms, tokens/s, instructions, ratio = B's over A's)",
    "instructions": "the exact count of instructions executed (valgrind on the host, the emulator elsewhere)",
    "commit": "the git commit of the tree that was measured (first 10 characters; + or -dirty: uncommitted)",
    "commits": "the last commit with the old count .. the first with the new one",
    "commits (last old .. first new)": "the last commit measured at the old level .. the first at the new one",
    "oracle": "the check that judged the case against the reference (testbed/oracles)",
    "verdict": "pass, fail or error; for counts and A/B, what the change is judged to be",
    "margin": "how far a verdict is from failing, in its oracle's own unit: positive passes, negative fails "
              "(nmse: log10 of threshold over the error, 2 = a hundred times under it); bit-exact oracles pass "
              "only on equality and are said as such",
    "record": "the record's id in the store (records.jsonl), linked to the records listed at the end",
    "run": "the run's id: every record one `testbed run` or job stored",
    "started": "when the run started (UTC)",
    "detail": "what the oracle or the runner said about it",
    "what is wrong": "why the report cannot read the record (a value testbed never writes there)",
    "kind": "oracle (a verdict) or measure (figures); for flags: figure, instructions, ab or oracle",
    "config": "a digest of the run's settings: runs with the same digest are compared with each other",
    "what": "the flagged quantity (and the rates computed from the same timing)",
    "now": "the latest level of the flagged quantity",
    "before (level)": "its level before the step",
    "before (noise)": "its run-to-run noise before the step (what a step must exceed)",
    "change": "the change of the newest against the one before (a rise in time or count is worse)",
    "since": "the first run at the new level",
    "machine": "how much the machine itself slowed over the same runs (the sgemm probe), if it ran",
    "A/B evidence": "the paired test behind an A/B flag: pairs, test, p and Holm's p, A's and B's commits",
    "N": "prompt length in tokens",
    "tail": "tokens after the last full chunk",
    "padded tok/s": "prefill throughput padding the tail to a full chunk",
    "scalar tok/s": "prefill throughput running the tail token by token",
    "winner": "the faster mode and by how much (a tie under the tie percentage)",
    "padded TTFT (ms)": "time to first token, padding the tail",
    "scalar TTFT (ms)": "time to first token, tail token by token",
    "padded spread %": "(max - min) / median of the padded throughput's repetitions",
    "scalar spread %": "(max - min) / median of the scalar throughput's repetitions",
    "seed padded tok/s": "the seed's measured padded throughput at the same tail (fixtures/)",
    "seed scalar tok/s": "the seed's measured scalar throughput at the same tail",
    "seed winner": "the seed's faster mode at the same tail",
    "C": "chunk size in tokens",
    "chunk call s": "one chunk call's median time",
    "chunk call instructions": "one chunk call's exact instructions (a device that counts)",
    "expected s": "projected time per utterance over the run's length distribution: ceil(n / C) chunk calls, "
                  "then the reply's decode steps (token by token: every token a decode step)",
    "expected instructions": "the same projection in exact instructions",
    "choice": "the decision with its confidence: the best C at 95%, or undecided with the C not "
              "distinguishable from it, a tie of exact counts, and whether token by token is faster",
    "tokens": "tokens per call",
    "form": "serial (the recurrence token by token) or chunkwise (the WY form, a chunk at a time)",
    "chunk": "the chunkwise form's chunk size",
    "ms": "the call's median time",
    "min ms": "its fastest repetition",
    "max ms": "its slowest repetition",
    "tokens/s": "tokens over the median time",
    "GFLOP/s": "gdn_flops' serial count over the median time (both forms, so they compare)",
    "x serial": "serial's time over this form's: above 1, the form is faster",
    "reps": "how many repetitions the figure is the median of",
    "median": "the figure's median over its repetitions",
    "min": "its least repetition",
    "max": "its greatest repetition",
    "run before": "the same series' count in the run before",
    "time (median)": "the same record's median time, beside its count (never compared with it)",
    "time unit": "that time's unit",
    "runs": "how many runs of the series the store holds",
    "before": "the count in the run before",
    "after": "the count in the run that changed it",
    "night": "the nightly run's id",
    "suite": "the suite the night ran (experiments/suite/NAME.yaml)",
    "finished": "when the night ended",
    "devices": "each device's status that night",
    "exit": "the night's exit status (0: all passed)",
    "figures left out": "emulated figures not shown as speeds",
    "how it ended": "how a run was stopped before it ended: interrupted by a signal (a time limit, Ctrl-C), or "
                    "killed outright (no end mark): incomplete, never a failing verdict",
    "reached": "the verdicts a stopped run had stored before the stop, as stored (a pass there is no pass)",
    "figures": "how many figures a stopped run had stored: incomplete, never shown as current or judged",
    "shown instead": "the complete run of the same experiment, device and config the page shows, if any",
}
ORACLE_COLUMN = ("EXPERIMENT:ORACLE", "the oracle's verdicts of the experiment's current runs: how many passed of "
                 "how many, and the smallest margin (or bit-exact); linked to the worst record")


def glossary(sections: list[Section]) -> Section | None:
    """Each column of this page's tables, explained once, in the order they first appear."""
    columns = dict.fromkeys(c for s in sections for t in s.tables for c in t.columns)
    if not columns:
        return None
    oracle_columns = [c for c in columns if ":" in c and c not in GLOSSARY]
    rows = [[cell(c), cell(GLOSSARY.get(c, "not explained yet (a gap of the report's GLOSSARY)"))]
            for c in columns if c not in oracle_columns]
    if oracle_columns:
        rows.append([cell(ORACLE_COLUMN[0]), cell(ORACLE_COLUMN[1])])
    return Section("glossary", "Reading the tables", [
        "Each column of the tables above, once. A figure is a median over repetitions, with its spread beside it "
        "wherever the record keeps one."], [Table("columns", ["column", "what it is"], rows)])


# The page, in order. Each function returns None when it has nothing to show.
SECTIONS: list[Callable[[Inputs], Section | None]] = [
    oracle_matrix, incomplete, unreadable_records, regressions, numbers, engines, tail_sweep, chunk_choice,
    gdn_throughput, instruction_counts, other_measurements,
    nights_over_time, nights,
    provenance, cited_records,
]


# --- the verdict banner: one line per device at the top of the page -----------------------------------


def _busiest_load(record: dict) -> float:
    """The higher of the 1-minute load averages taken before and after the record's run."""
    load = record.get("host_load") or {}
    return max(load.get("load_1m_before", 0.0), load.get("load_1m_after", 0.0))


def _has_reading(record: dict) -> bool:
    return "noisy" in (record.get("host_load") or {})


@dataclass
class LoadReading:
    """What a device's current records say of this host's load while they ran (testbed.runner.host_load).
    The records behind its figures are its current measure records, the emulated ones listed apart
    included. The banner says it beside the verdict, never as its colour, and from this one reading, so
    its words never call a machine quiet that a record calls noisy."""

    measures: list[dict]  # the records behind the device's figures
    others: list[dict]  # its other current records (oracle verdicts, whose correctness load does not change)

    @property
    def noisy(self) -> list[dict]:
        return [r for r in self.measures if (r.get("host_load") or {}).get("noisy")]

    @property
    def unread(self) -> list[dict]:
        """Records behind figures that carry no reading (ingested output; records from before readings)."""
        return [r for r in self.measures if not _has_reading(r)]

    @staticmethod
    def load(records: list[dict]) -> str:
        """The busiest reading among `records`, as "load 26.0 on 2 cores"."""
        worst = max((r for r in records if _has_reading(r)), key=_busiest_load)
        return f"load {_busiest_load(worst):.1f} on {worst['host_load'].get('cores', '?')} cores"

    def note(self) -> str:
        """What the records say of the load, in words: a note beside the verdict, never its colour (a
        verdict of correctness does not depend on the load, and on a shared host every night is loaded)."""
        noisy = self.noisy
        if noisy:
            runs = {r["run_id"] for r in noisy}
            figures = sum(len(r.get("figures") or {}) for r in self.measures if r["run_id"] in runs)
            return (f"{figures} figure{'s' * (figures != 1)} of {len(runs)} run{'s' * (len(runs) != 1)} measured "
                    f"under {self.load(noisy)} (noisy): judged like the others (none left out); where the machine "
                    "probe ran, a flag says how much the machine slowed")
        read = [r for r in self.measures if _has_reading(r)]
        if read:
            said = f"figures measured under {self.load(read)} (quiet)"
            if self.unread:
                said += f"; {len(self.unread)} record{'s' * (len(self.unread) != 1)} of figures carry no load reading"
            return said
        if self.measures:
            return "figures with no load reading (the records carry none)"
        said = "no figures in its current runs"
        read = [r for r in self.others if _has_reading(r)]
        if read:
            loud = [r for r in read if r["host_load"]["noisy"]]
            said += (f"; its verdicts were taken under {self.load(loud or read)} "
                     f"({'noisy, which a verdict of correctness does not depend on' if loud else 'quiet'})")
        return said


def load_reading(inp: Inputs, device: str) -> LoadReading:
    current = [r for r in inp.current if r["device"] == device]
    apart = [r for r in inp.set_apart if r["device"] == device and r["run_id"] in {c["run_id"] for c in current}]
    return LoadReading([r for r in current + apart if r["kind"] == "measure"],
                       [r for r in current if r["kind"] != "measure"])


def current_oracles(inp: Inputs) -> list[dict]:
    """The current runs' oracle verdicts, each record the report cannot read among them as an error: a
    verdict that cannot be read never counts as a pass."""
    return [r for r in inp.current if r["kind"] == "oracle"] + [
        {**r, "verdict": "error", "detail": f"the report cannot read it: {why}"}
        for r, why in inp.unreadable if r["kind"] == "oracle" and r["run_id"] in inp.current_runs]


def reached_failing(inp: Inputs) -> list[dict]:
    """The fails and errors that incomplete runs reached before they were stopped (IncompleteRun.failing)."""
    return [r for run in inp.incomplete for r in run.failing]


def device_counts(tally: Tally, not_run: int) -> dict:
    """A device's line of counts: each verdict state (error only where there is one), then its incomplete
    runs as "not run"."""
    counts = {state: tally[state] for state in (PASS, FAIL, verdicts.ERROR, verdicts.NOT_SUPPORTED,
                                                  verdicts.NOT_JUDGED)}
    said = [f"{n} {state}" for state, n in counts.items() if n or state != verdicts.ERROR]
    said.append(f"{not_run} not run (incomplete)" if not_run else "0 not run")
    return {"counts": {**{k.replace(" ", "_"): v for k, v in counts.items()}, "not_run": not_run},
            "line": ", ".join(said)}


def device_verdict(inp: Inputs, device: str) -> dict:
    """The colour says the result, nothing else. Red: a current oracle fails or errs (a run that broke
    counts as an error, as does a verdict the report cannot read), or a run stopped before it ended had
    reached a fail or an error. Amber: every current oracle passes, but a figure, count or oracle is flagged
    as a regression, or the passes cannot be trusted to be tonight's (the device's runs are stale, it was
    missing from the last night, it has no verdicts at all). Grey: the device's only runs were stopped
    before they ended (incomplete: no verdict either way). Green otherwise, whatever the load. The reason
    names what decided the colour, then the load the records carry (LoadReading.note), and any record
    left out as unreadable; `line` counts each state, and the incomplete runs as "not run"."""
    records = [r for r in inp.current if r["device"] == device]
    stopped = [run for run in inp.incomplete if run.first["device"] == device]
    reached = [r for run in stopped for r in run.failing]
    oracles = [r for r in current_oracles(inp) if r["device"] == device]
    reading = load_reading(inp, device)
    unread = [why for r, why in inp.unreadable if r["device"] == device]
    notes = f"load: {reading.note()}" + (f"; {len(unread)} record{'s' * (len(unread) != 1)} the report cannot "
                                        f"read (first: {unread[0]})" if unread else "")
    if stopped:
        notes += (f"; {len(stopped)} run{'s were' if len(stopped) > 1 else ' was'} stopped before the end "
                  f"({stopped[0].how}: {stopped[0].first['experiment']}, "
                  f"{implementations.of(stopped[0].first).backend}): incomplete, under Incomplete runs")
    failing = [r for r in oracles if verdicts.of(r) in FAILING] + reached
    tally = Tally.of_records(oracles) + Tally(verdicts.of(r) for r in reached)
    counted = device_counts(tally, len(stopped))
    if failing:
        first = worst_of(failing)
        said = ("its run did not end complete" if first.get("verdict") == PASS
                else first.get("detail") or first.get("verdict"))
        stop = " (reached before its run was stopped)" if any(first is r for r in reached) else ""
        return {"device": device, "colour": "red", **counted,
                "reason": f"{len(failing)} of {len(oracles) + len(reached)} oracle verdicts fail or err "
                          f"({tally.phrase()}); worst: {first['experiment']} {first['case']} "
                          f"({implementations.of(first).backend}){stop}: {said}. {notes}"}
    if stopped and not records:
        return {"device": device, "colour": "grey", **counted,
                "reason": f"incomplete: no run here ended; nothing they reached fails. {notes}"}
    concerns = []
    flags = [f for f in inp.flags if f.device == device]
    if flags:  # every flag by name: the first alone hides the rest
        concerns.append(f"{len(flags)} regression flag{'s' * (len(flags) != 1)}: "
                        + "; ".join(f"({i}) {f.line()}" for i, f in enumerate(flags, 1)))
    if records:
        newest = max(started_at(r) for r in records)
        age = inp.now - newest
        if age > dt.timedelta(days=inp.settings["stale_after_days"]):
            concerns.append(f"stale: its newest run started {age.days} days before this report "
                            f"({newest.date().isoformat()})")
    else:
        concerns.append("no current runs")
    last_night = (inp.nights[-1].get("devices") or {}).get(device) if inp.nights else None
    if last_night and last_night.get("status") != "ok":
        concerns.append(f"missing from the last night: {last_night['status']}"
                        + (f" ({last_night['reason']})" if last_night.get("reason") else ""))
    if records and not oracles:
        concerns.append("no oracle verdicts in its current runs")
    elif oracles and not tally.judged:
        concerns.append(f"nothing judged: {tally.phrase()}")
    # a refusal is said beside the verdict, in its own words, never as its colour
    refused = [r for r in oracles if verdicts.of(r) in UNJUDGED]
    aside = (f" Not judged here: {refused[0]['experiment']} {refused[0]['case']} "
             f"({implementations.of(refused[0]).backend}): {refused[0].get('detail') or refused[0]['verdict']}"
             + (f" (and {len(refused) - 1} more)" if len(refused) > 1 else "") + ".") if refused else ""
    passing = f"all {len(oracles)} oracle verdicts pass" if tally[PASS] == len(oracles) else \
        f"no oracle verdict fails ({tally.phrase()})"
    if concerns:
        return {"device": device, "colour": "amber", **counted,
                "reason": (f"{passing}, but " if oracles else "") + "; ".join(concerns) + f". {notes}{aside}"}
    return {"device": device, "colour": "green", **counted,
            "reason": f"{passing}; no regression flag; newest run {newest.date().isoformat()}. {notes}{aside}"}


def verdict_banner(inp: Inputs) -> list[dict]:
    """One verdict per device of the current runs, of its incomplete runs and of the last night."""
    devices = {r["device"] for r in inp.current} | {r["device"] for r, _ in inp.unreadable
                                                     if r["run_id"] in inp.current_runs}
    devices |= {run.first["device"] for run in inp.incomplete}
    if inp.nights:
        devices |= set(inp.nights[-1].get("devices") or {})
    return [device_verdict(inp, device) for device in sorted(devices)]


# --- the first screen: what broke, where, what next -------------------------------------------------


def worst_of(failing: list[dict]) -> dict:
    """The worst of failing verdicts: a fail (a wrong answer) before an error (a run that broke), then the
    furthest from passing (the smallest margin), then the newest."""
    newest_first = sorted(failing, key=lambda r: str(r["started"]), reverse=True)  # min keeps the first of equals
    return min(newest_first, key=lambda r: (verdicts.of(r) != FAIL, _number(r.get("margin"), math.inf)))


def reproduce_command(record: dict) -> str:
    """The command that runs again what stored `record`: `testbed run EXPERIMENT` (an A/B job: `testbed ab A
    B`) with the overrides its run was given, the device named. A record stored before runs kept their
    overrides gets the settings that choose the code under test (device, backend, engine); report.json
    holds its whole config."""
    overrides = record.get("overrides")
    config = record.get("config") or {}
    if not isinstance(overrides, list):
        overrides = [f"{key}={config[key]}" for key in ("backend", "engine") if config.get(key) not in (None, "")]
    overrides = [str(o) for o in overrides]
    if not any(o.split("=", 1)[0].lstrip("+") == "device" for o in overrides):
        overrides.append(f"device={record['device']}")
    ab = (record.get("metrics") or {}).get("ab") if is_ab(record) else None
    if ab:
        words = ["testbed", "ab", str(ab.get("a_commit", "A"))[:12], str(ab.get("b_commit", "B"))[:12]]
    else:
        words = ["testbed", "run", str(record["experiment"])]
    return shlex.join([*words, *overrides])


def replay_of(record: dict) -> str | None:
    """The replay command an engine's failing call left in its record (testbed.backends.engine.keep: the
    kept request's `replay`, in the evidence of a call that broke the contract, or in metrics.where.kept
    of an oracle that failed), or None."""
    places = []
    for evidence in record.get("evidence") or []:
        if isinstance(evidence, dict):
            places += [evidence, evidence.get("detail")]
    where = (record.get("metrics") or {}).get("where")
    places += where.get("kept") or [] if isinstance(where, dict) and isinstance(where.get("kept"), list) else []
    return next((place["replay"] for place in places if isinstance(place, dict)
                 and isinstance(place.get("replay"), str) and place["replay"]), None)


def regression_line(inp: Inputs, flag: history.Flag) -> str:
    """A flag in one line that names the backend (the engine, for an engine under test) and its commits."""
    record = next((r for r in inp.records if r["record_id"] == flag.record_id), None)
    backend = implementations.of(record).backend if record else "?"
    what = f"{flag.what} (and {', '.join(flag.derived)})" if flag.derived else flag.what
    return (f"{flag.experiment} on {flag.device} ({backend}): {flag.case} {what} {flag.change}, {flag.now} vs "
            f"{flag.before}; commits {flag.commit_range()} (last old .. first new), since {flag.since[:16]}")


def first_screen(inp: Inputs) -> dict:
    """What the page opens with under the device lines: the worst failure and the commands that reproduce
    it (the run, and the engine's kept call where there is one), what regressed with its commits, and what
    to do next."""
    failing = [r for r in current_oracles(inp) if verdicts.of(r) in FAILING]
    reached = reached_failing(inp)
    worst = None
    if failing or reached:
        record = worst_of(failing + reached)
        stopped = any(record is r for r in reached)
        line = verdict_line({**record, "verdict": verdicts.of(record) if not stopped else record["verdict"],
                             "backend": implementations.of(record).backend})
        if record.get("verdict") == PASS:  # a pass of a run that did not end complete: an error, and why
            line += ": its run did not end complete"
        worst = {"line": line, "record": record["record_id"], "href": inp.cite(record),
                 "run": record["run_id"], "started": record["started"], "commit": str(record["git_commit"])[:10],
                 "stopped": inp.stopped_how.get(record["run_id"]) if stopped else None,
                 "of": len(failing) + len(reached), "reproduce": reproduce_command(record), "replay": replay_of(record)}
    regressed = [{"line": regression_line(inp, f), "commit_range": f.commit_range(), "record": f.record_id}
                 for f in inp.flags]
    steps = []
    if worst:
        steps.append({"say": "run the worst failure again", "command": worst["reproduce"]})
        if worst["replay"]:
            steps.append({"say": "run the engine's failing call once more, from the request its run kept",
                          "command": worst["replay"]})
    first_flag = next((f for f in inp.flags if f.last_clean_commit and f.since_commit), None)
    if first_flag:
        steps.append({"say": "every change between the commits around the first regression",
                      "command": shlex.join(["testbed", "compare", first_flag.last_clean_commit[:12],
                                             first_flag.since_commit[:12]])})
    stopped_runs = inp.incomplete
    if stopped_runs and not worst:
        steps.append({"say": f"finish the newest incomplete run ({stopped_runs[-1].how})",
                      "command": reproduce_command(stopped_runs[-1].first)})
    if not steps:
        steps.append({"say": "nothing to do: no verdict fails, nothing regressed, no run is incomplete",
                      "command": None})
    return {"worst": worst, "regressed": regressed, "next": steps}


# --- building and writing -------------------------------------------------------------------------


def tool_versions() -> dict[str, str]:
    out = {}
    for name in TOOLS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def markdown_text(value) -> str:
    """A value as inert Markdown text: no HTML (Markdown passes HTML through), no links, no table
    breaks, one line, no control characters (tables.printable)."""
    text = printable(str(value).replace("\r", " ").replace("\n", " "))
    for raw, safe in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("\\", "\\\\"), ("|", "\\|"), ("[", "\\["),
                      ("]", "\\]"), ("`", "\\`")):
        text = text.replace(raw, safe)
    return text


# HTML is escaped everywhere (the templates' names end in .html.j2); Markdown through `markdown_text`.
TEMPLATE_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                                  autoescape=jinja2.select_autoescape(enabled_extensions=("html.j2",),
                                                                      default_for_string=True),
                                  undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                  trim_blocks=True, lstrip_blocks=True)
TEMPLATE_ENV.filters["md"] = markdown_text
TEMPLATE_ENV.filters["pretty"] = lambda data: json.dumps(data, indent=1, sort_keys=True, default=str)
# A table cell whose text is longer than this may break anywhere on the page (an op's parameters,
# a commit range); shorter ones (units, record ids, "bandwidth") break only between words.
TEMPLATE_ENV.globals["long_cell"] = 24


def is_ab(record: dict) -> bool:
    """A record of an A/B job (`testbed ab`, the nightly's A/B): B's figures over A's, paired."""
    return isinstance(record["metrics"].get("ab"), dict)


def latest_runs(records: list[dict]) -> set[str]:
    """The current runs: the newest of each experiment, device and config, an A/B job's apart from the
    experiment's own. The nightly's A/B job runs with the experiment's config; were it the "current run"
    of that config, the experiment's own verdicts and figures would drop off the page."""
    return (history.latest_runs([r for r in records if not is_ab(r)])
            | history.latest_runs([r for r in records if is_ab(r)]))


def build(records: list[dict], out: Path, fixtures: Path, settings: dict, night_log: list[dict] = (),
          since: dt.datetime | None = None) -> dict:
    """Write the report folder `out` from `records`; return its JSON content."""
    chosen = select(records, since)
    # runs stopped before they ended are set apart first: never current, never judged, never failing for it
    stopped_how = results.stopped_runs(chosen)
    stopped = [r for r in chosen if r["run_id"] in stopped_how and unreadable(r) is None]
    chosen = [r for r in chosen if r["run_id"] not in stopped_how]
    current_runs = latest_runs(chosen)
    judged = {id(r): unreadable(r) for r in chosen}
    window, emulated = emulation.split([r for r in chosen if judged[id(r)] is None])
    flags = history.flags(window, settings)
    out = Path(out)
    check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tidy(out)
    staging = out.with_name(f".{out.name}.staging-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    staging.mkdir(mode=0o700)
    try:
        (staging / MARKER).write_text("a testbed report: `testbed report` replaces this folder\n")
        inp = Inputs(window, [r for r in window if r["run_id"] in current_runs], fixtures, staging,
                     dt.datetime.now(dt.timezone.utc), settings, list(night_log), flags, set_apart=emulated,
                     unreadable=[(r, judged[id(r)]) for r in chosen if judged[id(r)] is not None],
                     current_runs=current_runs, stopped=stopped, stopped_how=stopped_how)
        inp.incomplete = incomplete_runs(inp)
        screen = first_screen(inp)  # before the sections: the records it links to are listed at the end
        drawn = [draw(fn, inp) for fn in SECTIONS]
        sections = [s for s, _ in drawn if s is not None]
        broken = [why for _, why in drawn if why is not None]
        if emulated:
            sections.insert(1, Section("emulated", "Figures left out",
                                       [f"{len(emulated)} figure(s) {emulation.REASON}."],
                                       [frame_table("emulated figures by device", emulation.listing(emulated))]))
        sections += [s for s in (glossary(sections),) if s is not None]
        content = {
            "generated": inp.now.isoformat(timespec="seconds"),
            "since": since.isoformat() if since else None,
            "records": len(window),
            "current_runs": sorted(current_runs),
            "summary": summary(inp, flags),
            "first_screen": screen,
            "flags": [history.flag_data(f) for f in flags],
            "breakevens": inp.breakevens,
            "choices": inp.choices,
            "sections": [section_data(s) for s in sections],
            "broken_sections": broken,
        }
        for name in ("report.html", "report.md"):  # for people: the sections' cells, rendered
            page = TEMPLATE_ENV.get_template(name + ".j2").render({**content,
                                                                   "sections": [asdict(s) for s in sections]})
            (staging / name).write_text(page, encoding="utf-8")
        (staging / "report.json").write_text(json.dumps(content, indent=1, default=str), encoding="utf-8")
        staging.chmod(0o755)  # mkdtemp made it private; a report is for reading, e.g. from a web server
        _replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return content


def draw(fn: Callable[[Inputs], Section | None], inp: Inputs) -> tuple[Section | None, str | None]:
    """One section, or in its place a notice of why it could not be drawn, and that reason. Records the
    report cannot read are set apart first (`unreadable`); what a section still trips on (a record of an
    experiment that lacks a figure its sweep needs, a parameter of another type) costs that section,
    never the page, and the command exits 6 naming it: the page is built, yet incomplete."""
    try:
        return fn(inp), None
    except Exception as e:  # noqa: BLE001 - any failure of one section is shown in its place
        title = fn.__name__.replace("_", " ")
        why = f"section {title!r} could not be drawn: {type(e).__name__}: {e}"
        return Section(f"broken-{fn.__name__}", f"{title} (not drawn)", [
            f"{why}. The other sections are complete; `testbed records verify` checks the store, and if it "
            "finds nothing, this is a bug of testbed's report."]), why


def is_report(folder: Path) -> bool:
    """A folder `build` wrote: it has the marker, or (written before the marker existed) it holds
    nothing but a report's own files."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    if (folder / MARKER).is_file():
        return True
    names = {p.name for p in folder.iterdir()}
    own = {"report.html", "report.md", "report.json"}
    return own <= names and all(n in own or (n.endswith(".png") and (folder / n).is_file()) for n in names)


def check_replaceable(out: Path) -> None:
    """Refuse (one line, exit 2) to build into an existing path that is not a previous report."""
    if (out.exists() or out.is_symlink()) and not is_report(out):
        raise UsageError(f"--out {out} exists and is not a testbed report (it has no {MARKER}); "
                         "accepted: a new folder, or a report folder to replace")


def tidy(out: Path) -> None:
    """Undo what a killed build left beside `out`: staging folders of dead builds, and the previous
    report if the build died between moving it aside and moving the new one in."""
    ours = re.compile(re.escape(f".{out.name}.staging-") + r"(\d+)-[0-9a-f]{6}")
    for leftover in out.parent.glob(f".{out.name}.staging-*"):
        match = ours.fullmatch(leftover.name)
        if match and process_alive(socket.gethostname(), int(match.group(1))) is False:
            shutil.rmtree(leftover, ignore_errors=True)
    old = out.with_name(f".{out.name}.old")
    if old.is_dir() and (old / MARKER).is_file():
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.rename(out)


def _replace(staging: Path, out: Path) -> None:
    """Move the finished folder into place; the previous report is removed only after."""
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        out.rename(old)
        staging.rename(out)
        shutil.rmtree(old)
    else:
        staging.rename(out)


def summary(inp: Inputs, flags: list[history.Flag]) -> dict:
    oracles = current_oracles(inp)
    tally = Tally.of_records(oracles)
    reached = reached_failing(inp)  # decided before their runs were stopped: a fail is a fail
    return {"oracles": len(oracles), "oracles_passed": tally[PASS], "oracles_failed": tally.failed + len(reached),
            "oracles_unjudged": tally.unjudged, "oracle_verdicts": tally.phrase(),
            "incomplete_runs": len(inp.incomplete),
            "measurements": sum(r["kind"] == "measure" for r in inp.current),
            "regressions": len(flags), "devices": sorted({r["device"] for r in inp.current}),
            "verdicts": verdict_banner(inp)}


# --- the command ----------------------------------------------------------------------------------

def settings() -> dict:
    from omegaconf import OmegaConf

    from testbed.config import CONFIG_DIR

    return OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "report.yaml"), resolve=True)


def night_log(results_root: Path) -> list[dict]:
    """The nightly runs' own log (testbed.lab.nightly), oldest first: each night's last entry, so a night
    that was killed after its "started" entry reads as such, with no exit status."""
    from testbed.results import ResultsStore

    latest = {}
    for entry in ResultsStore(results_root / "nights").rows():
        if "night" in entry and "started" in entry:
            latest[entry["night"]] = entry
    return sorted(latest.values(), key=lambda n: n["started"])


def write(store, out: Path | None, since: dt.datetime | None = None) -> tuple[Path, dict]:
    """The report of everything in `store` (since `since`) into `out` (default: beside the records)."""
    from testbed import config

    rc = config.load([])
    out = Path(out) if out else store.root / "report"
    content = build(store.records(), out, seed.fixtures_dir(rc.cfg.fixtures_dir), settings(),
                    night_log(store.root), since)
    return out, content


def summary_line(out: Path, content: dict) -> str:
    s = content["summary"]
    return (f"report {out / 'report.html'}: {content['records']} records, {len(content['current_runs'])} current "
            f"runs on {', '.join(s['devices']) or 'no device'}; oracles {s['oracle_verdicts']}; "
            f"{s['regressions']} regressions; " + (", ".join(f"{v['device']} {v['colour']}" for v in s["verdicts"])
                                                    or "no device verdicts"))


def command(args) -> int:
    """`testbed report [--since DATE] [--out DIR]`. Exit 1 when a current oracle fails or a figure
    regressed (as nightly); 7 when no current verdict was judged (each not supported or not judged); 0
    otherwise; 2 on bad input; 6 when a section could not be drawn (`draw`)."""
    from testbed import config, runner

    since = parse_since(args.since)
    store = runner.results_store(config.load([]))
    if not select(store.records(), since):
        print(f"no records{' since ' + args.since if args.since else ''} in {store.path}; "
              "run `testbed nightly` or `testbed run EXPERIMENT` first", file=sys.stderr)
        return 1
    try:
        out, content = write(store, Path(args.out) if args.out else None, since)
    except OSError as e:  # a read-only or full store, a folder not ours to write: one line, exit 5
        raise StoreError(f"the report cannot be written: {e.strerror or e} ({e.filename or args.out or store.path}); "
                         "give a writable folder with --out") from None
    print(tables.wrap(summary_line(out, content)))
    worst = content["first_screen"]["worst"]
    if worst:  # what the page opens with, on the terminal too: the worst failure and how to run it again
        print(tables.wrap(printable(f"worst of {worst['of']} failing: {worst['line']}")))
        print(tables.wrap(printable(f"run it again: {worst['reproduce']}"
                                    + (f"; the engine's call alone: {worst['replay']}" if worst["replay"] else ""))))
    if content["broken_sections"]:
        print(f"testbed: the report is incomplete: {content['broken_sections'][0]}"
              + (f" (and {len(content['broken_sections']) - 1} more)" if len(content['broken_sections']) > 1 else ""),
              file=sys.stderr)
        return INTERNAL_ERROR
    s = content["summary"]
    if s["regressions"] or s["oracles_failed"]:
        return 1
    return NOTHING_JUDGED if s["oracles"] and not s["oracles_passed"] else 0


def register(commands) -> None:
    r = commands.add_parser("report", help="the report folder (HTML, Markdown, JSON) from stored records")
    r.add_argument("--since", help="only records of runs started on or after this date (YYYY-MM-DD)")
    r.add_argument("--out", help="the report folder (default: RESULTS/report)")
    r.set_defaults(fn=command)
