"""`testbed records`: inspect and repair the results store.

  testbed records verify                  what the reader sets aside or has to explain: lines that
                                          are torn, not UTF-8, not objects or of a newer schema;
                                          batches that never committed; records stored twice; runs
                                          that never ended; output ingested twice. Exit 1 if any.
  testbed records rm SELECTOR [--dry-run] remove records, selected by --run ID, --night NIGHT (its
                                          runs and its log entries) and/or --where KEY=VALUE (dotted
                                          keys: experiment=gdn, config.chunk=64, verdict=error); all
                                          given must match. --run and --night remove a run's marks
                                          too; --where only records (so a broken run stays broken),
                                          and a run that loses records so is marked edited: its
                                          verdicts never count as passed again. A run without an end
                                          mark (still running, or killed) is refused, whatever
                                          selects it; --force removes it once its process is gone.
                                          The old file is kept beside it as records.jsonl.before-TIME.
  testbed records export [--where ...] [--format jsonl|csv|json]
                                          the records as the reader sees them (incomplete runs
                                          marked, unfinished runs' error records included)
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import sys
from collections import Counter

import pandas as pd

from testbed import config, runner
from testbed.devices.private import process_alive
from testbed.errors import UsageError
from testbed.report import build as report
from testbed.results import EDITED, ResultsStore, figure_problems, malformed, valid_id

SHOWN = 5  # line numbers or ids named per finding; the count is always whole


def parse_where(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise UsageError(f"--where {item!r} is not KEY=VALUE; accepted e.g. experiment=gdn, config.chunk=64")
        out.append((key, value))
    return out


def lookup(row: dict, dotted: str):
    """row["config"]["chunk"] for config.chunk; config keys are themselves dotted (bench.tokens), so
    the rest of the key after a mapping is tried whole first."""
    node = row
    parts = dotted.split(".")
    while parts:
        if not isinstance(node, dict):
            return None
        rest = ".".join(parts)
        if rest in node:
            return node[rest]
        node, parts = node.get(parts[0]), parts[1:]
    return node


def matches(row: dict, where: list[tuple[str, str]]) -> bool:
    """Every KEY=VALUE holds; values compare as their JSON text (64 == "64", true == "true")."""
    def text(v):
        return v if isinstance(v, str) else json.dumps(v)

    return all(text(lookup(row, key)) == value for key, value in where)


def store_of_config() -> ResultsStore:
    return runner.results_store(config.load([]))


def run_of(row: dict) -> str | None:
    """The row's run id; None where it is not one (a hostile or damaged row: the reader sets it aside)."""
    run = row.get("run_id")
    return run if valid_id(run) else None


def verify(store: ResultsStore) -> list[str]:
    found = store.scan()
    findings = []
    if found.problems:
        findings.append(f"{len(found.problems)} unusable lines (line {'; '.join(found.problems[:SHOWN])})")
    if found.uncommitted:
        rows = sum(found.uncommitted.values())
        findings.append(f"{len(found.uncommitted)} batches never committed ({rows} rows, not read): "
                        "a write cut short")
    rows = found.rows
    bad = [why for r in rows if "record_id" in r and (why := malformed(r))]
    bad_marks = sum("run_mark" in r and not valid_id(r.get("run_id")) for r in rows)
    if bad or bad_marks:
        findings.append(f"{len(bad) + bad_marks} records or run marks with a field missing or of a type testbed "
                        f"never writes (the reader sets them aside; first: {(bad or ['a run mark without a run id'])[0]})")
    figures = [f"run {r['run_id']} record {r['record_id']}: {why}" for r in rows
               if "record_id" in r and not malformed(r) for why in figure_problems(r).values()]
    if figures:
        findings.append(f"{len(figures)} figures that are not finite numbers or of a type testbed never writes (the "
                        f"reader sets them aside, keeping their records): {'; '.join(figures[:SHOWN])}")
    ids = Counter(r["record_id"] for r in rows if valid_id(r.get("record_id")))
    twice = [i for i, n in ids.items() if n > 1]
    if twice:
        findings.append(f"{len(twice)} records stored more than once ({', '.join(twice[:SHOWN])})")
    started = {run_of(r) for r in rows if r.get("run_mark") == "started"} - {None}
    ends = {run_of(r): r for r in rows if r.get("run_mark") == "ended" and run_of(r)}
    never = sorted(started - ends.keys())
    if never:
        findings.append(f"{len(never)} runs never ended (killed, or still running): {', '.join(never[:SHOWN])}")
    unmarked = sorted({run_of(r) for r in rows if "record_id" in r and r.get("schema") != 1}
                      - started - ends.keys() - {None})
    if unmarked:
        findings.append(f"{len(unmarked)} runs have records but no start or end mark (read as incomplete): "
                        f"{', '.join(unmarked[:SHOWN])}")
    edited = sorted(run for run, end in ends.items() if end.get("outcome") == EDITED)
    if edited:
        findings.append(f"{len(edited)} runs had records removed by `records rm` (their verdicts no longer count "
                        f"as passed): {', '.join(edited[:SHOWN])}")
    # how a run ended before any removal: an edited run that broke is listed as broke too
    broke = sorted(run for run, end in ends.items()
                   if (end.get("ended_as") if end.get("outcome") == EDITED else end.get("outcome")) != "complete")
    if broke:
        findings.append(f"{len(broke)} runs broke (each has its error record): {', '.join(broke[:SHOWN])}")
    sources = {}
    for r in rows:
        digest = r.get("config", {}).get("source_digest") if isinstance(r.get("config"), dict) else None
        if isinstance(digest, str) and digest and run_of(r):
            sources.setdefault(digest, set()).add(run_of(r))
    again = [sorted(runs) for runs in sources.values() if len(runs) > 1]
    if again:
        findings.append(f"{len(again)} ingested outputs stored more than once (runs {', '.join(again[0])}...)")
    return findings


def refuse_unended(rows: list[dict], runs: set[str], force: bool) -> None:
    """`rm` touching a run without an end mark: a run still going would lose its start mark or records
    and its later records would stand alone; refused, unless --force and its process is gone. Schema-1
    records never had marks: each such run was stored whole."""
    ended = {run_of(r) for r in rows if r.get("run_mark") == "ended"}
    starts = {run_of(r): r for r in rows if r.get("run_mark") == "started" and run_of(r)}
    present = {run_of(r) for r in rows if "record_id" in r and r.get("schema") != 1} | starts.keys()
    for run in sorted(runs & present - ended):
        start = starts.get(run, {})
        alive = process_alive(start.get("host"), start.get("pid"))
        where = f"process {start.get('pid')} on {start.get('host')}" if "pid" in start else "its process"
        if alive:
            raise UsageError(f"run {run}: the run has no end mark and {where} is still running; "
                             "accepted: a run that ended (wait for it, or stop it first)")
        if not force:
            raise UsageError(f"run {run}: the run has no end mark (still running, or killed); accepted: a run "
                             f"that ended, or --force once {where} is gone"
                             + ("" if alive is False else " (it cannot be checked from here)"))
        if alive is None and "pid" in start:
            raise UsageError(f"run {run}: the run has no end mark and {where} cannot be checked from here; "
                             "accepted: --force on that host")


def cmd_verify(args) -> int:
    store = store_of_config()
    findings = verify(store)
    found = store.scan()
    records = sum("record_id" in r for r in found.rows)
    runs = len({run_of(r) for r in found.rows if "record_id" in r} - {None})
    for line in findings:
        print(f"{store.path}: {line}")
    print(f"{store.path}: {records} records in {runs} runs; "
          + ("no problems" if not findings else f"{len(findings)} kinds of problem"))
    return 1 if findings else 0


def cmd_rm(args) -> int:
    if not (args.run or args.night or args.where):
        raise UsageError("records rm needs a selector; accepted: --run ID, --night NIGHT, --where KEY=VALUE")
    where = parse_where(args.where)
    store = store_of_config()
    runs = set(args.run)
    nights = set(args.night)
    if nights:
        log = {n["night"]: n for n in report.night_log(store.root)}
        unknown = sorted(nights - log.keys())
        if unknown:
            raise UsageError(f"--night {unknown[0]!r} is not in the night log; "
                             f"accepted: {', '.join(sorted(log)) or 'none'}")
        runs |= {run for n in nights for d in log[n].get("devices", {}).values() for run in d.get("runs", [])}

    found = store.scan()
    known = {run_of(r) for r in found.rows} - {None}
    unknown = sorted(set(args.run) - known)
    if unknown:
        raise UsageError(f"--run {unknown[0]!r} is not a run in {store.path}; nothing changed (`testbed records "
                         f"export` lists the runs)")

    def selected(row: dict) -> bool:
        by_run = not (args.run or args.night) or run_of(row) in runs
        if "record_id" in row:
            return by_run and matches(row, where)
        return bool(args.run or args.night) and run_of(row) in runs and not where  # a run's marks

    chosen = [r for r in found.rows if selected(r)]
    refuse_unended(found.rows, runs | {run_of(r) for r in chosen} - {None}, args.force)
    if not chosen:
        print(f"nothing in {store.path} matches; nothing changed")
        return 0
    if args.dry_run:
        records = [r for r in chosen if "record_id" in r]
        print(f"would remove {len(records)} records of {len({run_of(r) for r in records})} runs "
              f"(and {len(chosen) - len(records)} run marks) from {store.path}; nothing changed")
        return 0
    selectors = [f"--{option} {shlex.quote(value)}" for option in ("run", "night", "where")
                 for value in getattr(args, option)]
    how = f"records rm {' '.join(selectors)} at {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}"
    found, dropped = store.rewrite(lambda row: not selected(row), edited=how)
    if nights:
        ResultsStore(store.root / "nights").rewrite(lambda entry: entry.get("night") not in nights)
    records = [r for r in dropped if "record_id" in r]
    kept_ends = {run_of(r) for r in found.rows if r.get("run_mark") == "ended"} - \
        {run_of(r) for r in dropped if r.get("run_mark") == "ended"}
    edited = {run_of(r) for r in records} & kept_ends  # what rewrite(edited=...) marked
    print(f"removed {len(records)} records of {len({run_of(r) for r in records})} runs "
          f"(and {len(dropped) - len(records)} run marks) from {store.path}"
          + (f"; {len(edited)} runs that lost records keep their marks, marked edited (their verdicts no longer "
             "count as passed)" if edited else "")
          + (f"; also left out {len(found.problems)} unusable lines and {len(found.uncommitted)} uncommitted "
             "batches" if found.problems or found.uncommitted else "")
          + "; the previous file is kept beside it (records.jsonl.before-*)")
    return 0


# A spreadsheet runs a cell that begins with one of these as a formula (=HYPERLINK(...), +cmd|...)
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value):
    """A text cell a spreadsheet would run as a formula, quoted as text by a leading apostrophe;
    numbers and everything else as they are."""
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_START) else value


def cmd_export(args) -> int:
    where = parse_where(args.where)
    rows = [r for r in store_of_config().records() if matches(r, where)]
    if args.format == "jsonl":
        sys.stdout.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    elif args.format == "json":
        print(json.dumps(rows, indent=1, sort_keys=True))
    else:
        frame = pd.json_normalize(rows, sep=".") if rows else None
        sys.stdout.write(frame.map(csv_cell).to_csv(index=False) if frame is not None else "")
    return 0


def register(commands) -> None:
    r = commands.add_parser("records", help="inspect and repair the results store: verify, rm, export")
    sub = r.add_subparsers(dest="action", required=True)
    v = sub.add_parser("verify", help="torn lines, uncommitted batches, duplicates, unfinished runs; exit 1 if any")
    v.set_defaults(fn=cmd_verify)
    rm = sub.add_parser("rm", help="remove records by run, night or filter (the old file is kept beside)")
    rm.add_argument("--run", action="append", default=[], help="a run id (repeatable)")
    rm.add_argument("--night", action="append", default=[], help="a night of testbed nightly (repeatable)")
    rm.add_argument("--where", action="append", default=[], help="KEY=VALUE, e.g. experiment=gdn (repeatable)")
    rm.add_argument("--dry-run", action="store_true", help="say what would be removed; change nothing")
    rm.add_argument("--force", action="store_true",
                    help="also remove a run without an end mark, once its process is gone (killed)")
    rm.set_defaults(fn=cmd_rm)
    e = sub.add_parser("export", help="the records as the reader sees them")
    e.add_argument("--where", action="append", default=[], help="KEY=VALUE (repeatable)")
    e.add_argument("--format", choices=("jsonl", "json", "csv"), default="jsonl")
    e.set_defaults(fn=cmd_export)
