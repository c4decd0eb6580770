"""`testbed compare A B`: the figures and verdicts of two sets of runs side by side, each change judged.

A side is one of (tried in this order):

  a results store   a folder holding records.jsonl: every record in it
  a night id        a night of `testbed nightly` (its night log, RESULTS/nights): the runs it made
  a commit          a hex prefix (4+ digits) of the records' git commit, in the configured store
  a setting         KEY=VALUE: the runs in the configured store whose configuration has KEY = VALUE,
                    e.g. two llama.cpp forks swept in one store (`testbed sweep experiment=llamacpp
                    llamacpp.source=UPSTREAM,PATCHED`): `testbed compare llamacpp.source=UPSTREAM
                    llamacpp.source=PATCHED` gives their tallies, perf per case and pp512 side by side

Records are matched on experiment, device, backend, configuration (as testbed.measure.history compares runs:
where results and fixtures live is not part of it, nor the KEY of a setting side), case and the measured quantity or oracle. A
measured quantity is a timing with the rates computed from it (testbed.measure.history.quantities): one row,
the derived figures named beside it.

The unit of noise is the run, not the repetition: a night on a busier machine moves all its
repetitions together (issue 14), so the samples compared are each run's median. Each quantity's two
sides are tested with a two-sided Mann-Whitney U test (scipy.stats.mannwhitneyu: its exact
distribution when neither side has ties and neither has more than EXACT_UP_TO runs; with ties, the
exact permutation distribution of the tie-corrected statistic while the orderings number at most
PERMUTATIONS; the tie-corrected normal limit beyond). One comparison tests many quantities at once, so
the p-values are corrected for that (Holm's step-down method over every quantity tested: it bounds the
chance of calling any quantity slower by chance at ALPHA, which is what exit status 1 needs; the
Benjamini-Hochberg false-discovery rate would allow a share of false "slower" rows, each an exit 1).
A change is beyond noise when the corrected p (column `p_adjusted`, beside the uncorrected `p`) is
below ALPHA and the medians differ by at least testbed.measure.history.MIN_CHANGE; too few runs to reach
p < ALPHA at all (fewer than 4 a side, or 3 against 5) says so instead of guessing.

Each speed row also says the smallest change the comparison could have detected (`detectable_pct`, for
the runs `detectable_at`): the change the test calls with chance POWER, at the runs' spread (the pooled
standard deviation of the log per-run values around each side's mean), were it the only change among
the quantities judged (Holm's first step: p < ALPHA / quantities), found by simulating the exact test
on normal log values shifted by it (SIMULATIONS draws, a fixed seed), and never below MIN_CHANGE. Where
the runs cannot reach that p at all, it is the figure for the fewest equal runs a side that can.

The machine is a covariate: where every run on both sides has the machine probe beside it
(testbed.measure.history.is_probe: the probe in the same run, or in a run on the same device within
testbed.measure.history.PROBE_HOURS), each run's median is divided by the probe's level in that run (a time
by the probe's time; a rate multiplied), and the test and the verdict are of those normalised values:
a drift of the machine shared by every quantity (the same commit measured on nights 1-6 and 7-12)
cancels. The row then shows the raw change, the machine's change (`machine_pct`, positive: the machine
was slower in B) and the normalised change. The probe's own rows are said ("machine probe"), never
slower.

Instruction counts (unit instructions) are exact: no test, the change itself; "more instructions"
beyond testbed.measure.history.INSTRUCTION_RISE counts as slower does, and they are shown in their own table.
Emulated figures are never compared for speed (testbed.measure.emulation); their counts and oracle verdicts are.
Exit status: 1 when B is slower (or has more instructions) or an oracle passed in A and fails in B, 0
otherwise, 2 bad input, 6 an internal error of testbed (a traceback; never 1, which means a regression).
"""

from __future__ import annotations

import functools
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.errors import INTERNAL_ERROR, UsageError
from testbed.measure import emulation, history
from testbed.report import tables
from testbed.results import ResultsStore
from testbed.verdicts import FAIL, NOT_JUDGED, PASS, Tally

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

# Orderings of the two sides up to which ties are tested by their exact permutation distribution.
PERMUTATIONS = 20_000


def mann_whitney_p(a: list[float], b: list[float]) -> float:
    """The two-sided p-value of the Mann-Whitney U test that a and b come from one distribution
    (scipy.stats.mannwhitneyu): exact without ties up to EXACT_UP_TO values a side; with ties, the
    exact permutation distribution up to PERMUTATIONS orderings; the tie-corrected normal limit beyond."""
    from scipy import stats

    n, m = len(a), len(b)
    ties = len(set(a) | set(b)) < n + m
    if not ties and max(n, m) <= EXACT_UP_TO:
        method = "exact"
    elif ties and math.comb(n + m, n) <= PERMUTATIONS:
        method = stats.PermutationMethod(n_resamples=math.comb(n + m, n))  # every ordering: exact
    else:
        method = "asymptotic"
    return min(1.0, float(stats.mannwhitneyu(a, b, alternative="two-sided", method=method).pvalue))


def judge_change(a: list[float], b: list[float], unit: str) -> tuple[float | None, float | None, str]:
    """(relative change of B's median run against A's, p, verdict) for per-run medians a and b, the
    verdict at p < ALPHA uncorrected (`frame` corrects over all quantities: `verdict_of`)."""
    if not np.median(a) > 0:
        return None, None, "no change to state: A's median is not above 0"
    change = float(np.median(b) / np.median(a) - 1)
    if not reachable(len(a), len(b), ALPHA):
        return change, None, f"too few runs to tell ({len(a)} vs {len(b)})"
    p = mann_whitney_p(a, b)
    return change, p, verdict_of(change, p, unit)


def verdict_of(change: float, p: float, unit: str) -> str:
    if p >= ALPHA or abs(change) < history.MIN_CHANGE:
        return "within noise"
    if history.lower_is_better(unit):
        return "slower" if change > 0 else "faster"
    if history.higher_is_better(unit):
        return "slower" if change < 0 else "faster"
    return "higher" if change > 0 else "lower"


# --- the smallest change a comparison could have detected ------------------------------------------

# The chance of calling a change that is there (the power) at which a change counts as detectable.
POWER = 0.8
# Simulated comparisons per effect size tried, and the seed: the same runs always give the same figure.
SIMULATIONS = 400
SEED = 33
# The effect sizes tried (in pooled standard deviations of a run's log value), halved until within this.
EFFECT_PRECISION = 0.02
LARGEST_EFFECT = 64.0


def spread(a: list[float], b: list[float]) -> float | None:
    """The runs' spread: the pooled standard deviation of log(per-run value) around each side's mean
    (a relative spread, the same for a time and a rate), or None without two runs on one side."""
    with np.errstate(divide="ignore", invalid="ignore"):  # a run at 0 or below: no relative spread
        logs = [np.log(np.asarray(side, dtype=float)) for side in (a, b)]
    dof = sum(x.size for x in logs) - 2
    if dof < 1 or not all(np.all(np.isfinite(x)) for x in logs):
        return None
    return float(np.sqrt(sum(float(((x - x.mean()) ** 2).sum()) for x in logs) / dof))


def reachable(n: int, m: int, alpha: float) -> bool:
    """Whether n against m runs can reach p < alpha at all: the most extreme ordering's p."""
    return n > 0 and m > 0 and 2 / math.comb(n + m, n) < alpha


def power(n: int, m: int, effect: float, alpha: float) -> float:
    """The chance that the two-sided Mann-Whitney test (exact up to EXACT_UP_TO runs a side) gives
    p < alpha for n against m runs whose log values are normal with unit spread, B's shifted by
    `effect`: SIMULATIONS comparisons drawn with a fixed seed (so the same runs, the same figure)."""
    from scipy import stats

    rng = np.random.default_rng(SEED)
    a = rng.standard_normal((SIMULATIONS, n))
    b = rng.standard_normal((SIMULATIONS, m)) + effect
    method = "exact" if max(n, m) <= EXACT_UP_TO else "asymptotic"
    p = stats.mannwhitneyu(a, b, alternative="two-sided", method=method, axis=1).pvalue
    return float(np.mean(p < alpha))


@functools.lru_cache(maxsize=None)
def detectable_effect(n: int, m: int, alpha: float) -> float | None:
    """The smallest shift (in spreads) the test finds with chance POWER at n against m runs, or None
    where no shift can reach alpha (too few runs). Bisection: power grows with the shift. Rows with
    the same runs and quantities share it (cached)."""
    if not reachable(n, m, alpha) or power(n, m, LARGEST_EFFECT, alpha) < POWER:
        return None
    low, high = 0.0, LARGEST_EFFECT
    while high - low > EFFECT_PRECISION:
        middle = (low + high) / 2
        low, high = (low, middle) if power(n, m, middle, alpha) >= POWER else (middle, high)
    return high


def runs_needed(n: int, m: int, alpha: float) -> int:
    """The fewest runs a side (at least the larger side's) with which some change can reach alpha."""
    k = max(n, m, 1)
    while not reachable(k, k, alpha):
        k += 1
    return k


def detectable_change(a: list[float], b: list[float], tested: int) -> tuple[float | None, str | None]:
    """(the smallest change in % the comparison detects with chance POWER, the runs a side it holds for:
    "n vs m"), for per-run values a and b at their spread, were it the only change among the `tested`
    quantities (Holm's first step: p < ALPHA / tested), and never below history.MIN_CHANGE (the verdict's
    own floor). Where these runs cannot reach that p at all: the figure for the fewest equal runs a side
    that can. (None, None) without a spread."""
    sigma = spread(a, b)
    if sigma is None:
        return None, None
    alpha = ALPHA / max(tested, 1)
    n, m = len(a), len(b)
    if not reachable(n, m, alpha):
        n = m = runs_needed(n, m, alpha)
    effect = detectable_effect(n, m, alpha)
    if effect is None:
        return None, None
    return 100 * max(math.expm1(effect * sigma), history.MIN_CHANGE), f"{n} vs {m}"


def count_verdict(a: list[float], b: list[float]) -> tuple[float | None, str]:
    """An exact count: (its change, verdict); no test, the change itself."""
    before, after = float(np.median(a)), float(np.median(b))
    if before == after:
        return 0.0, "same count"
    change = after / before - 1 if before > 0 else math.inf
    if change > history.INSTRUCTION_RISE:
        return change, "more instructions"
    return change, f"more instructions, within {history.INSTRUCTION_RISE:.0%}" if change > 0 else "fewer instructions"


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


def probe_levels(records: list[dict]) -> dict[str, float]:
    """Per run id of `records`: the machine probe's slowness (its median as a time; higher, a slower
    machine) in that run, else in the nearest run on the same device within history.PROBE_HOURS, as a
    median over probe series relative to that series' own median (so series of different sizes mix)."""
    probes = history.probe_runs(records)
    runs = {r["run_id"]: (r["device"], history._when(r)) for r in records if r["kind"] == "measure"}
    levels: dict[str, list[float]] = {}
    for device, by_series in probes.items():
        for series in by_series.values():
            typical = float(np.median([s for _, _, s in series]))
            for run_id, (run_device, when) in runs.items():
                if run_device != device:
                    continue
                same = [s for _, rid, s in series if rid == run_id]
                near = same or [s for w, _, s in sorted(series, key=lambda x: abs(x[0] - when))[:1]
                                if abs(w - when) <= history.PROBE_HOURS * 3600]
                if near:
                    levels.setdefault(run_id, []).append(float(np.median(near)) / typical)
    return {run_id: float(np.median(v)) for run_id, v in levels.items()}


def figure_rows(a: list[dict], b: list[dict], ignoring: tuple[str, ...] = ()) -> list[dict]:
    """One row per measured quantity of every series, judged where both sides measured it; the p-values
    of all quantities tested corrected together (Holm)."""
    rows, judged = [], []  # judged: (row, (A's values, B's values)) of each speed quantity tested
    sides = {"A": emulation.split([r for r in a if r["kind"] == "measure"])[0],
             "B": emulation.split([r for r in b if r["kind"] == "measure"])[0]}
    # the probe on both sides together: one scale for its slowness
    machine = probe_levels(history.speed_records(sides["A"] + sides["B"]))
    for key in sorted({_match_key(r, ignoring) for side in sides.values() for r in side}):
        runs = {s: history.by_run_time([r for r in recs if _match_key(r, ignoring) == key]) for s, recs in sides.items()}
        for name, derived in history.quantities(runs["A"] + runs["B"]):
            with_it = {s: [r for r in rs if name in r.get("figures", {})] for s, rs in runs.items()}
            figs = {s: [r["figures"][name] for r in rs] for s, rs in with_it.items()}
            unit = (figs["B"] or figs["A"])[-1]["unit"]
            kind = history.kind_of((with_it["B"] or with_it["A"])[-1], name)
            row = {"experiment": key[0], "device": key[1], "backend": key[2], "config": key[3],
                   "case": key[4], "quantity": name, "derived": ", ".join(derived), "unit": unit,
                   **_summary("a", figs["A"]), **_summary("b", figs["B"]), "change_pct": None, "machine_pct": None,
                   "normalised_pct": None, "p": None, "p_adjusted": None, "verdict": None,
                   "detectable_pct": None, "detectable_at": None}
            if not (figs["A"] and figs["B"]):
                row["verdict"] = "only in A" if figs["A"] else "only in B"
                rows.append(row)
                continue
            values = {s: [float(f["median"]) for f in fs] for s, fs in figs.items()}
            if kind == "count":
                change, row["verdict"] = count_verdict(values["A"], values["B"])
                row["change_pct"] = 100 * change
                rows.append(row)
                continue
            change, p, verdict = judge_change(values["A"], values["B"], unit)
            row.update(change_pct=None if change is None else 100 * change, p=p, verdict=verdict)
            if kind == "probe":
                row["verdict"] = "machine probe" + ("" if change is None else f": {100 * change:+.1f}%")
                row["p"] = None  # the machine, not the code: not tested among the quantities
            elif kind == "speed" and all(r["run_id"] in machine for rs in with_it.values() for r in rs):
                # every run has the machine beside it: the quantity judged on the machine's scale
                scale = {s: [machine[r["run_id"]] for r in rs] for s, rs in with_it.items()}
                norm = {s: [v / m if history.lower_is_better(unit) else v * m for v, m in zip(values[s], scale[s])]
                        for s in values}
                n_change, n_p, n_verdict = judge_change(norm["A"], norm["B"], unit)
                row.update(machine_pct=100 * (float(np.median(scale["B"])) / float(np.median(scale["A"])) - 1),
                           normalised_pct=None if n_change is None else 100 * n_change, p=n_p, verdict=n_verdict)
            if kind == "speed":
                judged.append((row, (norm["A"], norm["B"]) if row["normalised_pct"] is not None
                               else (values["A"], values["B"])))
            rows.append(row)
    tested = [r for r in rows if r["p"] is not None]
    for r, adjusted in zip(tested, history.holm([r["p"] for r in tested])):
        r["p_adjusted"] = adjusted
        change = r["normalised_pct"] if r["normalised_pct"] is not None else r["change_pct"]
        r["verdict"] = verdict_of(change / 100, adjusted, r["unit"])
        if r["verdict"] == "within noise" and not reachable(r["a_runs"], r["b_runs"], ALPHA / len(tested)) \
                and abs(change) >= 100 * history.MIN_CHANGE:
            r["verdict"] = (f"too few runs to tell after correction ({r['a_runs']} vs {r['b_runs']} runs, "
                            f"{len(tested)} quantities tested)")
    for r, (a_values, b_values) in judged:  # every speed quantity both sides measured, on the scale judged
        r["detectable_pct"], r["detectable_at"] = detectable_change(a_values, b_values, len(judged))
    return rows


def _tally(records: list[dict]) -> str:
    return Tally.of_records(records).phrase()


def _state(records: list[dict]) -> str | None:
    """One side's verdicts in one word: fail (any fails or errs), pass (none fails, one passed), not judged
    (each a refusal or not judged); None where the side has none."""
    if not records:
        return None
    tally = Tally.of_records(records)
    return FAIL if tally.failed else PASS if tally[PASS] else NOT_JUDGED


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
        state = {"A": _state(ra), "B": _state(rb)}
        if state["A"] is None or state["B"] is None:
            verdict = "only in A" if state["B"] is None else "only in B"
        elif state["A"] == state["B"]:
            verdict = "pass" if state["A"] == PASS else f"{state['A']}, as before"
        elif state["B"] == FAIL:  # the one change that is a regression
            verdict = f"{state['A'].upper()} -> FAIL"
        else:  # better, or now refused / not judged: said, never a regression
            verdict = f"{state['A']} -> {state['B']}"
        rows.append({"experiment": key[0], "device": key[1], "backend": key[2], "config": key[3], "case": key[4],
                     "quantity": key[5], "derived": "", "unit": "verdict",
                     "a_verdict": _tally(ra) if ra else "", "b_verdict": _tally(rb) if rb else "",
                     "verdict": verdict})
    return rows


def frame(a: list[dict], b: list[dict], ignoring: tuple[str, ...] = ()) -> pd.DataFrame:
    """The comparison as data: numeric columns for figures, pass counts for oracles."""
    columns = ["experiment", "device", "backend", "config", "case", "quantity", "derived", "unit",
               "a_median", "a_min", "a_max", "a_runs", "b_median", "b_min", "b_max", "b_runs", "change_pct",
               "machine_pct", "normalised_pct", "p", "p_adjusted", "detectable_pct", "detectable_at",
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
                         "machine %": [None if pd.isna(c) else f"{c:+.1f}" for c in df["machine_pct"]],
                         "beside the machine %": [None if pd.isna(c) else f"{c:+.1f}" for c in df["normalised_pct"]],
                         "p": [None if pd.isna(p) else f"{p:.2g}" for p in df["p"]],
                         "p (Holm)": [None if pd.isna(p) else f"{p:.2g}" for p in df["p_adjusted"]],
                         "detectable %": [None if pd.isna(d) else f"{d:.1f} ({at} runs)"
                                          for d, at in zip(df["detectable_pct"], df["detectable_at"])],
                         "verdict": df["verdict"]})


# --- the command ------------------------------------------------------------------------------------


def command(args) -> int:
    """Exit 1 when B is slower beyond noise (or runs more instructions) or an oracle that passed in A
    fails in B, 0 otherwise; 2 on bad input (a side that matches nothing); 6 when testbed itself broke
    (INTERNAL_ERROR: a traceback, and never 1, which would read as a regression)."""
    try:
        return _compare(args)
    except (UsageError, KeyboardInterrupt):
        raise
    except Exception:  # noqa: BLE001 -- a bug of testbed's, not a regression of the code compared
        import traceback

        traceback.print_exc()
        print(f"testbed compare: internal error (a bug in testbed, not a regression); exit {INTERNAL_ERROR}",
              file=sys.stderr)
        return INTERNAL_ERROR


def _compare(args) -> int:
    from testbed import config, runner
    from testbed.report import build as report

    default = runner.results_store(config.load([]))
    nights = report.night_log(default.root)
    a, b = (resolve(spec, default, nights) for spec in (args.a, args.b))
    df = frame(a.records, b.records, tuple({s.setting for s in (a, b) if s.setting}))
    if df.empty:
        print(f"A ({a.label}) and B ({b.label}) have no experiment, device and case in common", file=sys.stderr)
        return 1
    legend = (f"A: {a.label} ({len({r['run_id'] for r in a.records})} runs); B: {b.label} "
              f"({len({r['run_id'] for r in b.records})} runs); beyond noise: two-sided Mann-Whitney U on the "
              f"runs' medians (scipy), p < {ALPHA} after Holm's correction over the {int(df['p'].notna().sum())} "
              f"quantities tested, and at least {history.MIN_CHANGE:.0%}; beside the machine where its probe ran "
              f"in every run; instruction counts exact, more than {history.INSTRUCTION_RISE:.0%} more counts; "
              f"detectable: the smallest change found {POWER:.0%} of the time at the runs' spread with the runs "
              "named (simulated exact test, p < 0.05 / quantities)")
    if args.format == "md":
        counts = df["unit"] == history.INSTRUCTIONS
        text = tables.wrap(legend) + "\n\n" + tables.markdown(for_people(df[~counts]))
        if counts.any():  # never in a table of times
            text += "\n\ninstruction counts (exact):\n\n" + tables.markdown(for_people(df[counts]))
        print(text)
    else:  # data on stdout, nothing else
        print(tables.wrap(legend), file=sys.stderr)
        print(tables.render(df, args.format))
    flips = df[df["verdict"].astype(str).str.endswith("-> FAIL")]
    for _, r in flips.iterrows():
        print(tables.printable(f"{r['verdict']}: {r['experiment']} on {r['device']} ({r['backend']}) {r['case']} "
                               f"{r['quantity']}: {r['a_verdict']} in A, {r['b_verdict']} in B"), file=sys.stderr)
    return 1 if len(flips) or df["verdict"].isin(["slower", "more instructions"]).any() else 0


def register(commands) -> None:
    c = commands.add_parser("compare", help="two commits, nights or stores side by side: each change and whether "
                                            "it is beyond noise")
    c.add_argument("a", help="a results store folder, a night id (testbed nightly's log), a commit prefix, or "
                                "KEY=VALUE of a stored run's configuration (e.g. llamacpp.source=PATH)")
    c.add_argument("b", help="the same kinds as A; changes are B against A")
    c.add_argument("--format", choices=tables.FORMATS, default="md")
    c.set_defaults(fn=command)
