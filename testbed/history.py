"""History over stored records: which runs are comparable, which is the latest, what regressed.

Two runs are comparable when they ran the same experiment on the same device with the same
configuration (every config value except where results and fixtures live). An oracle regresses when
it passed before and does not pass now.

A figure regresses when its history steps to a worse level and stays there (asv's approach). The
detector, `judge_step`, is a plain function of one figure's per-run medians, oldest first:

  * On a log scale (a slowdown is a ratio, whatever the figure's size), the medians are fitted with a
    piecewise-constant model: the levels minimising the sum of absolute deviations plus a penalty per
    level (`fit_levels`), so one odd night costs less as a deviation than as a level of its own.
  * The noise is the spread of one run's median, estimated robustly from the runs before the latest
    level (`run_noise`: from consecutive differences and from deviations around the fitted levels, so
    an earlier step or an outlier night barely moves it).
  * A regression is a latest level, seen in at least `min_latest` runs (one slow night is an outlier
    until the next confirms it) and preceded by at least `min_history` runs, that is worse than the
    level before by more than `noise_multiple` standard errors of that change (the noise scaled by the
    runs on either side) AND by more than `min_change`.

Derived figures of one timing (seconds, tokens/s, GFLOP/s of the same repetitions) are one measured
quantity and are flagged once: `quantities` finds them in the records (a figure that is an exact
multiple, or an exact multiple of the reciprocal, of another in every run), the primary timing is
judged, and the flag names the figures derived from it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from itertools import groupby

# Where records and fixtures are kept says nothing about what was measured.
NOT_PART_OF_CONFIG = ("results_dir", "fixtures_dir")


def config_key(record: dict, ignoring: tuple[str, ...] = ()) -> str:
    """A short digest of the record's configuration: equal digests mean comparable runs. `ignoring`:
    settings left out besides where things live (the one two sides of a comparison differ in)."""
    config = {k: v for k, v in record.get("config", {}).items() if k not in NOT_PART_OF_CONFIG + tuple(ignoring)}
    return hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]


def series_key(record: dict) -> tuple:
    return (record["experiment"], record["device"], config_key(record), record["case"], record.get("oracle"))


def by_run_time(records: list[dict]) -> list[dict]:
    return sorted(records, key=lambda r: (r["started"], r["run_id"]))


def latest_runs(records: list[dict]) -> set[str]:
    """The run ids that are the newest of their (experiment, device, config)."""
    newest: dict[tuple, dict] = {}
    for r in records:
        key = (r["experiment"], r["device"], config_key(r))
        if key not in newest or (r["started"], r["run_id"]) > (newest[key]["started"], newest[key]["run_id"]):
            newest[key] = r
    return {r["run_id"] for r in newest.values()}


def lower_is_better(unit: str) -> bool:
    """Times are better low, rates (anything per second) high; a fraction or count is not judged."""
    return unit in ("s", "ms", "us", "ns")


def higher_is_better(unit: str) -> bool:
    return unit.endswith("/s")


@dataclass
class Flag:
    """One regression: what, on which device and config, by how much, since when."""

    kind: str  # "figure" or "oracle"
    experiment: str
    device: str
    config_key: str
    case: str
    what: str  # the figure's name, or the oracle's
    now: str
    before: str
    spread: str  # the run-to-run noise of the earlier runs, or the earlier verdict
    change: str
    since: str  # the start time of the first run at the new level, or of the failing streak
    since_commit: str
    record_id: str
    run_id: str
    derived: list[str] = field(default_factory=list)  # figures computed from the same timing, not judged apart

    def line(self) -> str:
        what = f"{self.what} (and {', '.join(self.derived)})" if self.derived else self.what
        return (f"{self.experiment} on {self.device} {self.case} {what} {self.change}: {self.now} vs "
                f"{self.before}, since {self.since[:16]} ({self.since_commit[:8]})")


# --- the step detector: a plain function of one figure's per-run medians -----------------------------

# The median of |x - y| for two independent standard normal draws (sqrt(2) x 0.6745): dividing the median
# absolute difference of consecutive runs by it estimates the standard deviation of one run's median.
MEDIAN_ABS_DIFFERENCE_OF_NORMALS = 0.9539
# The standard deviation of a normal distribution over its median absolute deviation (1 / 0.6745).
NORMAL_MAD = 1.4826
# The detector's settings (judge_step), chosen on simulated histories (tests/test_history.py): runs at a
# new level that confirm a step, standard errors of the change it must exceed, the least relative change
# that counts, and the cost of one more level in units of the noise.
MIN_LATEST = 2
NOISE_MULTIPLE = 3.5
MIN_CHANGE = 0.05
PENALTY = 5.0
# Added to the penalty of a level so that, where the data cannot tell, the fit keeps fewer levels.
FEWER_LEVELS_ON_A_TIE = 1e-12


@dataclass
class StepVerdict:
    """What `judge_step` found, and why it flags or does not, in one line."""

    regressed: bool
    reason: str
    start: int | None = None  # the index of the first run of the latest level
    before: float | None = None  # the level before it (a median of per-run medians)
    after: float | None = None  # the latest level
    change: float | None = None  # after / before - 1
    noise: float | None = None  # the run-to-run spread of one run's median, relative


def _median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def _absolute_deviation(values: list[float]) -> float:
    level = _median(values)
    return sum(abs(v - level) for v in values)


def fit_levels(values: list[float], penalty: float) -> list[int]:
    """The starts of the levels of the piecewise-constant fit minimising the sum of absolute deviations
    from each level's median plus `penalty` per level: exact, by dynamic programming over where the last
    level of each prefix begins (O(n^3), for the few dozen runs of a history)."""
    n = len(values)
    cost = [0.0] + [math.inf] * n  # cost[j]: the best fit of values[:j]
    begins = [0] * (n + 1)  # begins[j]: where the last level of that fit starts
    for j in range(1, n + 1):
        for i in range(j):
            c = cost[i] + _absolute_deviation(values[i:j]) + penalty
            if c < cost[j]:
                cost[j], begins[j] = c, i
    starts, j = [], n
    while j > 0:
        starts.append(begins[j])
        j = begins[j]
    return starts[::-1]


def difference_noise(logs: list[float]) -> float:
    """The spread of one run's value (as a standard deviation) from the median absolute difference of
    consecutive runs: a step among them moves one difference, so it barely moves this estimate."""
    return _median([abs(b - a) for a, b in zip(logs, logs[1:])]) / MEDIAN_ABS_DIFFERENCE_OF_NORMALS


def run_noise(logs: list[float], starts: list[int]) -> float:
    """The spread of one run's value in a history fitted with levels starting at `starts`: the larger of
    `difference_noise` and the median absolute deviation from the fitted levels. Each alone comes out
    low in some short histories, and a noise taken too low is a false alarm."""
    bounds = [*starts, len(logs)]
    deviations = [abs(v - _median(logs[a:b])) for a, b in zip(bounds, bounds[1:]) for v in logs[a:b]]
    return max(difference_noise(logs), NORMAL_MAD * _median(deviations))


def judge_step(medians: list[float], lower_is_better: bool, *, min_history: int = 5, min_latest: int = MIN_LATEST,
               noise_multiple: float = NOISE_MULTIPLE, min_change: float = MIN_CHANGE,
               penalty: float = PENALTY) -> StepVerdict:
    """Whether the latest of `medians` (per-run medians, oldest first) sits on a worse level than the
    level before it, beyond noise: the change of levels exceeds `noise_multiple` standard errors of a
    difference of two means of m and n runs (noise x sqrt(1/m + 1/n)), and `min_change`. `penalty` is
    the cost of one more level in units of the noise."""
    if min_history < 2:
        raise ValueError(f"min_history={min_history}: at least 2 earlier runs are needed to measure their noise")
    earlier = len(medians) - 1
    if earlier < min_history:
        return StepVerdict(False, f"not judged: {earlier} earlier runs, {min_history} needed")
    if not all(m > 0 and math.isfinite(m) for m in medians):
        return StepVerdict(False, "not judged: a median is not a positive number")
    logs = [math.log(m) for m in medians]
    starts = fit_levels(logs, penalty * difference_noise(logs) + FEWER_LEVELS_ON_A_TIE)
    start = starts[-1]
    if start == 0:
        return StepVerdict(False, f"within noise: one level over all {len(medians)} runs",
                           noise=math.exp(run_noise(logs, starts)) - 1)
    if start < min_history:
        return StepVerdict(False, f"not judged: the latest level began after {start} runs, {min_history} needed "
                                  "before it", start=start)
    before, after = _median(logs[starts[-2]:start]), _median(logs[start:])
    noise = run_noise(logs[:start], starts[:-1])
    latest, previous = len(medians) - start, start - starts[-2]
    verdict = StepVerdict(False, "", start, math.exp(before), math.exp(after), math.exp(after - before) - 1,
                          math.exp(noise) - 1)
    worse = after > before if lower_is_better else after < before
    beyond = f"{verdict.change:+.1%} against a run-to-run noise of {verdict.noise:.1%}"
    if not worse:
        verdict.reason = f"improved: {beyond}"
    elif abs(after - before) <= noise_multiple * noise * math.sqrt(1 / latest + 1 / previous):
        verdict.reason = (f"within noise: {beyond} ({noise_multiple:g} standard errors of a change between "
                          f"{previous} and {latest} runs needed)")
    elif abs(verdict.change) < min_change:
        verdict.reason = f"too small: {verdict.change:+.1%}, below the {min_change:.0%} that counts"
    elif latest < min_latest:
        verdict.reason = (f"not yet: {beyond} in the latest {latest} run(s); {min_latest} runs at the new level "
                          "confirm a step")
    else:
        verdict.regressed = True
        verdict.reason = f"regressed: {beyond}, over the last {latest} runs"
    return verdict


# --- the records: one series per experiment, device, config and case; one quantity per timing -------


def derived_from(a: str, b: str, rows: list[dict]) -> bool:
    """Whether figure b is computed from figure a: b = c * a or b = c / a (a rate of a time, whose min
    is the time's max) for one constant c, median, min and max alike, in every run that has both.
    Untestable, so False, when a's values are all one number."""
    both = [(r["figures"][a], r["figures"][b]) for r in rows if a in r.get("figures", {}) and b in r["figures"]]
    values = [float(f[k]) for pair in both for f in pair for k in ("median", "min", "max")]
    if len({fa[k] for fa, _ in both for k in ("median", "min", "max")}) < 2 or not all(
            v > 0 and math.isfinite(v) for v in values):
        return False
    for reciprocal in (False, True):
        pairs = [pair for fa, fb in both for pair in (
            (fa["median"], fb["median"]), (fa["min"], fb["max" if reciprocal else "min"]),
            (fa["max"], fb["min" if reciprocal else "max"]))]
        constants = [x * y if reciprocal else y / x for x, y in pairs]
        if max(constants) - min(constants) <= 1e-9 * max(constants):
            return True
    return False


def quantities(rows: list[dict]) -> list[tuple[str, list[str]]]:
    """The figures of the latest of `rows` (one series' runs), grouped by what was measured: (the
    figure that stands for the group, the figures derived from it). That is the group's first timing,
    else its first rate, else its first figure (a fraction, a count)."""
    groups: list[list[str]] = []
    for name in rows[-1].get("figures", {}):
        home = next((g for g in groups if any(derived_from(m, name, rows) for m in g)), None)
        if home is None:
            groups.append([name])
        else:
            home.append(name)
    out = []
    for group in groups:
        units = {n: rows[-1]["figures"][n]["unit"] for n in group}
        primary = next((n for n in group if lower_is_better(units[n])), None) or next(
            (n for n in group if higher_is_better(units[n])), group[0])
        out.append((primary, [n for n in group if n != primary]))
    return out


@dataclass
class Judgement:
    """One measured quantity of one series, judged over its history."""

    series: tuple  # series_key
    what: str
    derived: list[str]
    rows: list[dict]  # the runs judged, oldest first; the last is the latest
    verdict: StepVerdict


def judge_figures(records: list[dict], history: int, min_history: int) -> list[Judgement]:
    """Every measured quantity of each series' latest run, judged over at most `history` runs before."""
    out = []
    # emulated figures are not a device's speed (testbed.emulation): no regression is judged on them
    measures = by_run_time([r for r in records if r["kind"] == "measure" and not r.get("emulated")])
    measures.sort(key=series_key)  # stable: each series stays in run-time order
    for key, group in groupby(measures, key=series_key):
        rows = list(group)[-(history + 1):]
        for name, derived in quantities(rows):
            unit = rows[-1]["figures"][name]["unit"]
            if not (lower_is_better(unit) or higher_is_better(unit)):
                continue  # a fraction or a count: neither better high nor low
            runs = [r for r in rows if name in r.get("figures", {})]
            medians = [float(r["figures"][name]["median"]) for r in runs]  # "nan" is stored as a string
            verdict = judge_step(medians, lower_is_better(unit), min_history=min_history)
            out.append(Judgement(key, name, derived, runs, verdict))
    return out


def figure_regressions(records: list[dict], history: int, min_history: int) -> list[Flag]:
    """One flag per measured quantity whose latest level is worse than the one before, beyond noise."""
    flags = []
    for j in judge_figures(records, history, min_history):
        v = j.verdict
        if not v.regressed:
            continue
        latest, first = j.rows[-1], j.rows[v.start]
        fig = latest["figures"][j.what]
        flags.append(Flag(
            "figure", *j.series[:4], j.what,
            now=f"{fig['median']:.4g} {fig['unit']} [{fig['min']:.4g}, {fig['max']:.4g}]",
            before=f"{v.before:.4g} {fig['unit']}",
            spread=f"run-to-run noise {v.noise:.1%} over {v.start} runs",
            change=f"{v.change:+.1%}", since=first["started"], since_commit=first["git_commit"],
            record_id=latest["record_id"], run_id=latest["run_id"], derived=j.derived,
        ))
    return flags


def oracle_flips(records: list[dict]) -> list[Flag]:
    """Oracles whose latest verdict is not a pass although an earlier comparable run passed."""
    flags = []
    oracles = by_run_time([r for r in records if r["kind"] == "oracle"])
    oracles.sort(key=series_key)
    for key, group in groupby(oracles, key=series_key):
        rows = list(group)
        last_pass = max((i for i, r in enumerate(rows) if r["verdict"] == "pass"), default=None)
        if rows[-1]["verdict"] == "pass" or last_pass is None:
            continue
        first_fail, passed = rows[last_pass + 1], rows[last_pass]
        flags.append(Flag(
            "oracle", key[0], key[1], key[2], key[3], key[4] or "",
            now=f"{rows[-1]['verdict']} (margin {rows[-1].get('margin')})",
            before=f"pass (margin {passed.get('margin')})", spread=f"last passed {passed['started']}",
            change="pass -> " + rows[-1]["verdict"], since=first_fail["started"],
            since_commit=first_fail["git_commit"], record_id=rows[-1]["record_id"], run_id=rows[-1]["run_id"],
        ))
    return flags
