"""`testbed compare A B`: the figures and verdicts of two sets of runs side by side, each change judged.

A side is one of (tried in this order):

  a results store   a folder holding records.jsonl: every record in it
  a night id        a night of `testbed nightly` (its night log, RESULTS/nights): the runs it made
  a commit          a hex prefix (4+ digits) of the records' git commit, in the configured store
  a setting         KEY=VALUE: the runs in the configured store whose configuration has KEY = VALUE,
                    e.g. two llama.cpp forks swept in one store (`testbed sweep experiment=llamacpp
                    llamacpp.source=UPSTREAM,PATCHED`): `testbed compare llamacpp.source=UPSTREAM
                    llamacpp.source=PATCHED` gives their tallies, perf per case and pp512 side by side

Records are matched on experiment, device, backend, configuration (as testbed.history compares runs:
where results and fixtures live is not part of it, nor the KEY of a setting side), case and the measured quantity or oracle. A
measured quantity is a timing with the rates computed from it (testbed.history.quantities): one row,
the derived figures named beside it.

The unit of noise is the run, not the repetition: a night on a busier machine moves all its
repetitions together (issue 14), so the samples compared are each run's median. A change is beyond
noise when a two-sided exact Mann-Whitney U test on the two sides' run medians gives p < ALPHA and the
medians differ by at least testbed.history.MIN_CHANGE; too few runs to reach p < ALPHA at all (fewer
than 4 a side, or 3 against 5) says so instead of guessing. Emulated figures are never compared for
speed (testbed.emulation); their oracle verdicts are.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from testbed import emulation, history, tables
from testbed.errors import UsageError
from testbed.results import ResultsStore, passed

ALPHA = 0.05
COMMIT = re.compile(r"[0-9a-f]{4,40}(-dirty)?")  # what testbed.results.git_commit stores, or a prefix
SETTING = re.compile(r"(?P<key>[A-Za-z_][A-Za-z0-9_.]*)=(?P<value>.*)", re.S)
# Runs per side up to which the Mann-Whitney distribution is counted exactly; beyond, its normal limit.
EXACT_UP_TO = 25
NAMED = 3  # how many known commits and nights an error about a side names


@dataclass
class Side:
    label: str  # what the user gave, and what it turned out to be
    records: list[dict]
    setting: str | None = None  # a setting side's KEY: the two sides differ in it, so matching ignores it


def _same_value(stored, given: str) -> bool:
    """A stored config value against a command line's text: as text, or as YAML reads it (64, true)."""
    import yaml

    try:
        parsed = yaml.safe_load(given)
    except yaml.YAMLError:
        parsed = given
    return str(stored) == given or (stored == parsed and type(stored) is type(parsed))


def resolve(spec: str, default: ResultsStore, nights: list[dict]) -> Side:
    """The records `spec` names (see the module's docstring); UsageError, naming what is accepted, if none."""
    folder = Path(spec)
    if folder.is_dir():
        store = ResultsStore(folder)
        if not store.path.is_file():
            raise UsageError(f"{spec!r} is a folder without {ResultsStore.FILE}; accepted: a results store folder, "
                             "a night id or a commit prefix")
        records = store.records()
        if records:
            return Side(f"store {spec}", records)
        raise UsageError(f"results store {spec!r} holds no records; accepted: a store with records")
    records = default.records()
    night = next((n for n in nights if n["night"] == spec), None)
    if night is not None:
        runs = {run for d in night.get("devices", {}).values() for run in d.get("runs", [])}
        chosen = [r for r in records if r["run_id"] in runs]
        if chosen:
            return Side(f"night {spec}", chosen)
        raise UsageError(f"night {spec!r} left no records in {default.path} (killed before its first run, or its "
                         "records were removed)")
    commits = sorted({r["git_commit"] for r in records if r["git_commit"].startswith(spec)}
                     if COMMIT.fullmatch(spec) else [])
    if spec in commits:  # a whole commit, though a dirty tree's runs of it start the same way
        commits = [spec]
    if len(commits) > 1:
        raise UsageError(f"commit prefix {spec!r} names {len(commits)} commits "
                         f"({', '.join(c[:12] for c in commits[:NAMED])}); accepted: a prefix long enough to name one")
    if commits:
        return Side(f"commit {commits[0][:12]}", [r for r in records if r["git_commit"] == commits[0]])
    if (setting := SETTING.fullmatch(spec)) is not None:
        key, value = setting["key"], setting["value"]
        chosen = [r for r in records if key in r.get("config", {}) and _same_value(r["config"][key], value)]
        if chosen:
            return Side(f"{key}={value}", chosen, key)
        known = sorted({str(r["config"][key]) for r in records if key in r.get("config", {})})[:NAMED]
        raise UsageError(f"setting {spec!r} matches no record in {default.path}; accepted: KEY=VALUE of a stored run's "
                         + (f"configuration ({key} was: {', '.join(known)})" if known else
                            f"configuration ({key!r} is in none)"))
    known_commits = sorted({r["git_commit"][:10] for r in records})[:NAMED]
    known_nights = [n["night"] for n in nights][-NAMED:]
    raise UsageError(f"{spec!r} matches nothing; accepted: a results store folder (with {ResultsStore.FILE}), a "
                     f"night id (e.g. {', '.join(known_nights) or 'none logged'}) or a commit prefix of 4+ hex digits "
                     f"(e.g. {', '.join(known_commits) or f'none stored in {default.path}'}), or KEY=VALUE of a run's "
                     "configuration")


# --- the two-sample rule ---------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _u_counts(n: int, m: int) -> tuple[int, ...]:
    """How many orderings of n + m distinct values give each U = 0 .. n*m (the count of pairs (x, y),
    x from the n, y from the m, with x > y): the largest value is either one of the n (adding m) or not."""
    if n == 0 or m == 0:
        return (1,)
    with_x, without = _u_counts(n - 1, m), _u_counts(n, m - 1)
    return tuple((with_x[u - m] if 0 <= u - m < len(with_x) else 0) + (without[u] if u < len(without) else 0)
                 for u in range(n * m + 1))


def mann_whitney_p(a: list[float], b: list[float]) -> float:
    """The two-sided p-value of the Mann-Whitney U test that a and b come from one distribution. Ties
    count a half; the distribution is the one without ties (exact up to EXACT_UP_TO values a side, its
    normal limit beyond)."""
    n, m = len(a), len(b)
    u = sum((x > y) + 0.5 * (x == y) for x in a for y in b)
    tail = min(u, n * m - u)
    if max(n, m) <= EXACT_UP_TO:
        counts = _u_counts(n, m)
        return min(1.0, 2 * sum(counts[:math.floor(tail) + 1]) / math.comb(n + m, n))
    sd = math.sqrt(n * m * (n + m + 1) / 12)
    z = (tail + 0.5 - n * m / 2) / sd
    return min(1.0, math.erfc(-z / math.sqrt(2)))


def can_decide(n: int, m: int) -> bool:
    """Whether n against m runs can reach p < ALPHA at all: the most extreme ordering's p."""
    return n > 0 and m > 0 and 2 / math.comb(n + m, n) < ALPHA


def judge_change(a: list[float], b: list[float], unit: str) -> tuple[float | None, float | None, str]:
    """(relative change of B's median run against A's, p, verdict) for per-run medians a and b."""
    if not np.median(a) > 0:
        return None, None, "no change to state: A's median is not above 0"
    change = float(np.median(b) / np.median(a) - 1)
    if not can_decide(len(a), len(b)):
        return change, None, f"too few runs to tell ({len(a)} vs {len(b)})"
    p = mann_whitney_p(a, b)
    if p >= ALPHA or abs(change) < history.MIN_CHANGE:
        return change, p, "within noise"
    if history.lower_is_better(unit):
        return change, p, "slower" if change > 0 else "faster"
    if history.higher_is_better(unit):
        return change, p, "slower" if change < 0 else "faster"
    return change, p, "higher" if change > 0 else "lower"


# --- matching ---------------------------------------------------------------------------------------


def _match_key(r: dict, ignoring: tuple[str, ...] = ()) -> tuple:
    return r["experiment"], r["device"], r.get("backend", ""), history.config_key(r, ignoring), r["case"]


def _summary(side: str, figs: list[dict]) -> dict:
    """The median of the runs' medians, the least and greatest repetition of any run, how many runs."""
    if not figs:
        return {f"{side}_median": None, f"{side}_min": None, f"{side}_max": None, f"{side}_runs": 0}
    return {f"{side}_median": float(np.median([float(f["median"]) for f in figs])),
            f"{side}_min": min(float(f["min"]) for f in figs), f"{side}_max": max(float(f["max"]) for f in figs),
            f"{side}_runs": len(figs)}


def figure_rows(a: list[dict], b: list[dict], ignoring: tuple[str, ...] = ()) -> list[dict]:
    """One row per measured quantity of every series, judged where both sides measured it."""
    rows = []
    sides = {"A": emulation.split([r for r in a if r["kind"] == "measure"])[0],
             "B": emulation.split([r for r in b if r["kind"] == "measure"])[0]}
    for key in sorted({_match_key(r, ignoring) for side in sides.values() for r in side}):
        runs = {s: history.by_run_time([r for r in recs if _match_key(r, ignoring) == key]) for s, recs in sides.items()}
        for name, derived in history.quantities(runs["A"] + runs["B"]):
            figs = {s: [r["figures"][name] for r in rs if name in r.get("figures", {})] for s, rs in runs.items()}
            unit = (figs["B"] or figs["A"])[-1]["unit"]
            if figs["A"] and figs["B"]:
                change, p, verdict = judge_change([float(f["median"]) for f in figs["A"]],
                                                  [float(f["median"]) for f in figs["B"]], unit)
            else:
                change, p, verdict = None, None, "only in A" if figs["A"] else "only in B"
            rows.append({"experiment": key[0], "device": key[1], "backend": key[2], "config": key[3],
                         "case": key[4], "quantity": name, "derived": ", ".join(derived), "unit": unit,
                         **_summary("a", figs["A"]), **_summary("b", figs["B"]),
                         "change_pct": None if change is None else 100 * change, "p": p, "verdict": verdict})
    return rows


def _tally(records: list[dict]) -> str:
    return f"{sum(passed(r) for r in records)}/{len(records)} pass"


def oracle_rows(a: list[dict], b: list[dict], ignoring: tuple[str, ...] = ()) -> list[dict]:
    """One row per oracle of every matched case: its pass counts on either side, and what changed."""
    def by_key(records):
        out: dict[tuple, list[dict]] = {}
        for r in records:
            if r["kind"] == "oracle":
                out.setdefault((*_match_key(r, ignoring), r.get("oracle") or ""), []).append(r)
        return out

    sides = {"A": by_key(a), "B": by_key(b)}
    rows = []
    for key in sorted(sides["A"].keys() | sides["B"].keys()):
        ra, rb = sides["A"].get(key, []), sides["B"].get(key, [])
        ok = {s: all(passed(r) for r in rs) if rs else None for s, rs in (("A", ra), ("B", rb))}
        if ok["A"] is None or ok["B"] is None:
            verdict = "only in A" if ok["B"] is None else "only in B"
        elif ok["A"] == ok["B"]:
            verdict = "pass" if ok["A"] else "fail, as before"
        else:
            verdict = "PASS -> FAIL" if ok["A"] else "fail -> pass"
        rows.append({"experiment": key[0], "device": key[1], "backend": key[2], "config": key[3], "case": key[4],
                     "quantity": key[5], "derived": "", "unit": "verdict",
                     "a_verdict": _tally(ra) if ra else "", "b_verdict": _tally(rb) if rb else "",
                     "verdict": verdict})
    return rows


def frame(a: list[dict], b: list[dict], ignoring: tuple[str, ...] = ()) -> pd.DataFrame:
    """The comparison as data: numeric columns for figures, pass counts for oracles."""
    columns = ["experiment", "device", "backend", "config", "case", "quantity", "derived", "unit",
               "a_median", "a_min", "a_max", "a_runs", "b_median", "b_min", "b_max", "b_runs", "change_pct", "p",
               "a_verdict", "b_verdict", "verdict"]
    df = pd.DataFrame(figure_rows(a, b, ignoring) + oracle_rows(a, b, ignoring), columns=columns)
    return df.astype({"a_runs": "Int64", "b_runs": "Int64"})  # counts, null on an oracle's row


def for_people(df: pd.DataFrame) -> pd.DataFrame:
    """The Markdown view: A and B as "median [min-max], n runs" (or the pass count), the change in %."""
    def side(row, s):
        if row["unit"] == "verdict":
            return row[f"{s}_verdict"]
        if not row[f"{s}_runs"]:
            return ""
        return (f"{tables._cell(row[f'{s}_median'])} [{tables._cell(row[f'{s}_min'])}-{tables._cell(row[f'{s}_max'])}]"
                f" {row['unit']}, {int(row[f'{s}_runs'])} runs")

    quantity = [f"{q} (and {d})" if d else q for q, d in zip(df["quantity"], df["derived"])]
    # a config digest is no label: shown only where two configs would otherwise read as one row
    configs = df.groupby(["experiment", "device", "backend", "case"])["config"].nunique()
    shown = {"config": df["config"]} if (configs > 1).any() else {}
    return pd.DataFrame({"experiment": df["experiment"], "device": df["device"], "backend": df["backend"], **shown,
                         "case": df["case"], "quantity": quantity,
                         "A (median [min-max], n)": [side(r, "a") for _, r in df.iterrows()],
                         "B (median [min-max], n)": [side(r, "b") for _, r in df.iterrows()],
                         "change %": [None if pd.isna(c) else f"{c:+.1f}" for c in df["change_pct"]],
                         "verdict": df["verdict"]})


# --- the command ------------------------------------------------------------------------------------


def command(args) -> int:
    """Exit 1 when B is slower beyond noise or an oracle that passed in A fails in B, 0 otherwise; 2 on
    bad input (a side that matches nothing)."""
    from testbed import config, report, runner

    default = runner.results_store(config.load([]))
    nights = report.night_log(default.root)
    a, b = (resolve(spec, default, nights) for spec in (args.a, args.b))
    df = frame(a.records, b.records, tuple({s.setting for s in (a, b) if s.setting}))
    if df.empty:
        print(f"A ({a.label}) and B ({b.label}) have no experiment, device and case in common", file=sys.stderr)
        return 1
    legend = (f"A: {a.label} ({len({r['run_id'] for r in a.records})} runs); B: {b.label} "
              f"({len({r['run_id'] for r in b.records})} runs); beyond noise: two-sided Mann-Whitney U on the "
              f"runs' medians, p < {ALPHA}, and at least {history.MIN_CHANGE:.0%}")
    if args.format == "md":
        print(legend + "\n\n" + tables.markdown(for_people(df)))
    else:  # data on stdout, nothing else
        print(legend, file=sys.stderr)
        print(tables.render(df, args.format))
    flips = df[df["verdict"] == "PASS -> FAIL"]
    for _, r in flips.iterrows():
        print(f"PASS -> FAIL: {r['experiment']} on {r['device']} ({r['backend']}) {r['case']} {r['quantity']}: "
              f"{r['a_verdict']} in A, {r['b_verdict']} in B", file=sys.stderr)
    return 1 if len(flips) or (df["verdict"] == "slower").any() else 0


def register(commands) -> None:
    c = commands.add_parser("compare", help="two commits, nights or stores side by side: each change and whether "
                                            "it is beyond noise")
    c.add_argument("a", help="a results store folder, a night id (testbed nightly's log), a commit prefix, or "
                                "KEY=VALUE of a stored run's configuration (e.g. llamacpp.source=PATH)")
    c.add_argument("b", help="the same kinds as A; changes are B against A")
    c.add_argument("--format", choices=tables.FORMATS, default="md")
    c.set_defaults(fn=command)
