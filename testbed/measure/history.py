"""History over stored records: which runs are comparable, which is the latest, what regressed.

Two runs are comparable when they ran the same experiment on the same device with the same
configuration (every config value except where results and fixtures live). An oracle regresses when
it passed before and does not pass now.

A stored figure is judged by one of four rules, chosen by what it is (`kind_of`):

  exact count   unit "instructions" (emulated devices and valgrind on the host count them exactly):
                `count_changes`. Any change between consecutive runs of one series is reported, with
                the commit range (the last commit with the old count .. the first with the new); a
                rise above `instruction_rise` (default INSTRUCTION_RISE = 1%, report.yaml) is a
                regression of the run where it first appears, named once, with both counts; a fall
                is an improvement. Never judged by the step detector, never in a table with times.
                Emulated devices' counts are judged (they are exact); their times never are
                (testbed.measure.emulation).
  machine probe a figure marked `"role": "machine_probe"` (gdn's numpy sgemm rate, stored once per
                run in its own record; older records: LEGACY_PROBES). It measures the machine, not
                the code: never flagged, never compared as a regression; it says how much the machine
                slowed over the same runs beside a flag (`machine_slowdown`), and a step the machine
                explains (the figure's change over the probe's is below MIN_CHANGE) is not flagged.
  A/B ratio     unit "ratio" with an `ab` block (the A/B-in-one-job command): judged per run,
                directly (`ab_judgements`), never by the step detector. See "A/B records" below.
  timing, rate  the step detector (below), on non-emulated devices only.

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
    runs on either side) AND by more than `min_change`, whose latest run is itself nearer the new
    level than the old one (a revert measured back at the old level clears the flag that night).
  * The level starts at its first run nearer the new level than the old one, and the flag names it:
    `since_commit` is the first commit measured at the new level, `last_clean_commit` the last one
    measured at the old level before it. A commit measured at both levels is clean: the new level
    starts at the first run of a commit never measured at the old level, and a step whose runs are all
    of commits measured at the old level too is the machine's, not the code's (not flagged).

Derived figures of one timing (seconds, tokens/s, GFLOP/s of the same repetitions) are one measured
quantity and are flagged once: `quantities` finds them in the records (a figure that is an exact
multiple, or an exact multiple of the reciprocal, of another in every run), the primary timing is
judged, and the flag names the figures derived from it.

A/B records (the contract with the A/B-in-one-job command, which writes exactly this): a record of
kind "measure" whose figure is a paired ratio,

    figures: {"ab_ratio_cpu": {"median": m, "min": .., "max": .., "reps": PAIRS, "unit": "ratio",
                               "samples": [B's time / A's time, one per pair],
                               "ab": {"a_commit": SHA, "b_commit": SHA, "p": P, "pairs": PAIRS,
                                      "test": "wilcoxon", "verdict": "slower" | "faster" | "no change"}},
              "ab_ratio_wall": {... the same on the wall clock ...}}

The ratio is B's time over A's time, per pair, so above 1 is B slower; `p` is the paired test's own
two-sided p-value, uncorrected; `verdict` is the command's reading, shown beside the judge's. (An `ab`
block at the record's top level is taken for every ratio figure of the record that has none.) The
judge corrects the p-values of all A/B figures of one run together (Holm, `holm`) and flags a figure
whose corrected p < `ab_alpha` (default AB_ALPHA, report.yaml) and whose median ratio is at least
1 + MIN_CHANGE: a regression of that night, carrying the block as its evidence.

Every flag (`Flag`) carries its quantity, the levels before and after (numbers and text), the commit
range, what the machine probe said over the same runs, and the A/B evidence where there is one; the
nightly stores each in its night log (`flag_data`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from itertools import groupby

from testbed.report.tables import number
from testbed.verdicts import PASS, UNJUDGED

# Where records and fixtures are kept says nothing about what was measured. Nor does a device
# profile's `sizes` mapping: it holds every experiment's sizes on that device, and what applied to this
# run is in the experiment's own keys (bench.tokens, matrix, ...); editing one experiment's sizes must
# not start every other experiment's series on that device again.
NOT_PART_OF_CONFIG = ("results_dir", "fixtures_dir", "device.sizes")


def config_key(record: dict, ignoring: tuple[str, ...] = ()) -> str:
    """A short digest of the record's configuration: equal digests mean comparable runs. `ignoring`:
    settings left out besides where things live (the one two sides of a comparison differ in)."""
    left_out = NOT_PART_OF_CONFIG + tuple(ignoring)
    config = {k: v for k, v in record.get("config", {}).items()
              if not any(k == o or k.startswith(o + ".") for o in left_out)}
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


# --- what a figure is: an exact count, a machine probe, an A/B ratio, or a timing ----------------------

INSTRUCTIONS = "instructions"  # the unit of an exact count (emulated devices, valgrind on the host)
MACHINE_PROBE = "machine_probe"  # a figure's `role` when it measures the machine, not the code
AB_RATIO = "ratio"  # the unit of a paired A/B ratio (B's time over A's, per pair)
AB_FIELDS = ("a_commit", "b_commit", "p", "pairs", "test", "verdict")
# A count that rises by more than this fraction from one run to the next is a regression (report.yaml:
# instruction_rise); any change at all is reported.
INSTRUCTION_RISE = 0.01
# The A/B judge's level, after Holm's correction over one run's A/B figures (report.yaml: ab_alpha).
AB_ALPHA = 0.05
# Figures stored before probes were marked (and by modules that do not mark them yet): experiment and
# figure name, or experiment and the record's params.kernel (every figure of such a record).
LEGACY_PROBES = {("gdn", "sgemm"), ("engine_bench", "sgemm")}
LEGACY_PROBE_KERNELS = {("native_bench", "sgemm")}


def is_count(fig: dict) -> bool:
    return isinstance(fig, dict) and fig.get("unit") == INSTRUCTIONS


def is_probe(record: dict, name: str) -> bool:
    """Whether figure `name` of `record` measures the machine (role machine_probe, or LEGACY_PROBES)."""
    fig = record.get("figures", {}).get(name)
    if isinstance(fig, dict) and fig.get("role") == MACHINE_PROBE:
        return True
    return ((record["experiment"], name) in LEGACY_PROBES
            or (record["experiment"], (record.get("params") or {}).get("kernel")) in LEGACY_PROBE_KERNELS)


def ab_block(record: dict, name: str) -> dict | None:
    """The A/B evidence of figure `name` (a ratio figure's own `ab`, else the record's), or None."""
    fig = record.get("figures", {}).get(name)
    if not isinstance(fig, dict) or fig.get("unit") != AB_RATIO:
        return None
    block = fig.get("ab") if isinstance(fig.get("ab"), dict) else record.get("ab")
    return block if isinstance(block, dict) and "p" in block else None


def kind_of(record: dict, name: str) -> str:
    """Which rule judges figure `name`: "count", "probe", "ab", "speed" (the step detector) or "other"."""
    fig = record["figures"][name]
    if is_count(fig):
        return "count"
    if is_probe(record, name):
        return "probe"
    if ab_block(record, name) is not None:
        return "ab"
    if lower_is_better(fig.get("unit", "")) or higher_is_better(fig.get("unit", "")):
        return "speed"
    return "other"


@dataclass
class Flag:
    """One regression: what, on which device and config, by how much, since when."""

    kind: str  # "figure" (the step detector), "instructions" (an exact count rose), "ab" (an A/B pair), "oracle"
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
    since_commit: str  # the first commit measured at the new level (for an A/B pair: B)
    record_id: str
    run_id: str
    derived: list[str] = field(default_factory=list)  # figures computed from the same timing, not judged apart
    unit: str = ""
    before_level: float | None = None  # the level before, as a number in `unit`
    after_level: float | None = None  # the new level
    last_clean_commit: str = ""  # the last commit measured at the old level (for an A/B pair: A)
    machine: str = ""  # what the machine probe said over the same runs ("" where none was measured)
    ab: dict | None = None  # the A/B evidence: the record's block and the judge's corrected p

    def commit_range(self) -> str:
        old = self.last_clean_commit[:8] or "?"
        return f"{old}..{self.since_commit[:8]}"

    def line(self) -> str:
        what = f"{self.what} (and {', '.join(self.derived)})" if self.derived else self.what
        text = (f"{self.experiment} on {self.device} {self.case} {what} {self.change}: {self.now} vs "
                f"{self.before}, since {self.since[:16]} ({self.commit_range()})")
        if self.ab:
            text += f"; A/B: {self.ab.get('pairs')} pairs, p {self.ab.get('p_corrected', self.ab.get('p')):.2g} (Holm)"
        return text + (f"; {self.machine}" if self.machine else "")


def flag_data(flag: Flag) -> dict:
    """A flag as the night log and report.json store it."""
    return {**asdict(flag), "commit_range": flag.commit_range(), "line": flag.line()}


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
    previous: int | None = None  # the index of the first run of the level before
    last_before: int | None = None  # the index of the last run at the level before (the last clean one)


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


def judge_step(medians: list[float], lower_is_better: bool, *, commits: list[str] | None = None,
               min_history: int = 5, min_latest: int = MIN_LATEST, noise_multiple: float = NOISE_MULTIPLE,
               min_change: float = MIN_CHANGE, penalty: float = PENALTY, _yesterday: bool = True) -> StepVerdict:
    """Whether the latest of `medians` (per-run medians, oldest first) sits on a worse level than the
    level before it, beyond noise: the change of levels exceeds `noise_multiple` standard errors of a
    difference of two means of m and n runs (noise x sqrt(1/m + 1/n)), and `min_change`. `penalty` is
    the cost of one more level in units of the noise. `commits` (one per median): where the new level
    starts is moved past runs of commits also measured at the old level (clean ones). A step flagged
    without the latest run is not flagged when the latest run is back nearer its old level (a revert:
    refitted with it, the levels can blur, and the flag would stay a night too long)."""
    if min_history < 2:
        raise ValueError(f"min_history={min_history}: at least 2 earlier runs are needed to measure their noise")
    earlier = len(medians) - 1
    if earlier < min_history:
        return StepVerdict(False, f"not judged: {earlier} earlier runs, {min_history} needed")
    if not all(m > 0 and math.isfinite(m) for m in medians):
        return StepVerdict(False, "not judged: a median is not a positive number")
    logs = [math.log(m) for m in medians]
    n = len(logs)
    starts = fit_levels(logs, penalty * difference_noise(logs) + FEWER_LEVELS_ON_A_TIE)
    start = starts[-1]
    if start == 0:
        return StepVerdict(False, f"within noise: one level over all {n} runs",
                           noise=math.exp(run_noise(logs, starts)) - 1)
    previous = starts[-2]
    # The fit may give the new level a run that sits nearer the old one (a noisy night just before the
    # step): the level starts at its first run nearer the new level than the old.
    before, after = _median(logs[previous:start]), _median(logs[start:])
    while start < n - 1 and abs(logs[start] - after) >= abs(logs[start] - before):
        start += 1
        before, after = _median(logs[previous:start]), _median(logs[start:])
    old_end = start  # the old level is logs[previous:old_end]
    if commits is not None:
        clean = {c for c in commits[previous:old_end] if c != "unknown"}
        while start < n and commits[start] in clean:
            start += 1
        if start == n:
            shown = ", ".join(sorted(c[:8] for c in set(commits[old_end:])))
            return StepVerdict(False, f"the machine's: every run at the new level is of a commit also measured at "
                                      f"the old level ({shown})", old_end, math.exp(before), math.exp(after),
                               math.exp(after - before) - 1, previous=previous, last_before=old_end - 1)
        after = _median(logs[start:])
    if old_end < min_history:
        return StepVerdict(False, f"not judged: the latest level began after {old_end} runs, {min_history} needed "
                                  "before it", start=start)
    noise = run_noise(logs[:old_end], [s for s in starts if s < old_end])
    latest, earlier_runs = n - start, old_end - previous
    verdict = StepVerdict(False, "", start, math.exp(before), math.exp(after), math.exp(after - before) - 1,
                          math.exp(noise) - 1, previous, old_end - 1)
    worse = after > before if lower_is_better else after < before
    beyond = f"{verdict.change:+.1%} against a run-to-run noise of {verdict.noise:.1%}"
    back = abs(logs[-1] - after) >= abs(logs[-1] - before)  # the latest run: nearer the old level
    if not worse:
        verdict.reason = f"improved: {beyond}"
    elif abs(after - before) <= noise_multiple * noise * math.sqrt(1 / latest + 1 / earlier_runs):
        verdict.reason = (f"within noise: {beyond} ({noise_multiple:g} standard errors of a change between "
                          f"{earlier_runs} and {latest} runs needed)")
    elif abs(verdict.change) < min_change:
        verdict.reason = f"too small: {verdict.change:+.1%}, below the {min_change:.0%} that counts"
    elif latest < min_latest:
        verdict.reason = (f"not yet: {beyond} in the latest {latest} run(s); {min_latest} runs at the new level "
                          "confirm a step")
    elif back:
        verdict.reason = (f"back: the latest run ({math.exp(logs[-1] - before) - 1:+.1%} against the old level) is "
                          f"nearer the old level than the new one ({beyond}); a revert, or noise")
    else:
        verdict.regressed = True
        verdict.reason = f"regressed: {beyond}, over the last {latest} runs"
        if _yesterday:  # the same judgement without the latest run: was it flagged, and is the latest back?
            before_it = judge_step(medians[:-1], lower_is_better, commits=None if commits is None else commits[:-1],
                                   min_history=min_history, min_latest=min_latest, noise_multiple=noise_multiple,
                                   min_change=min_change, penalty=penalty, _yesterday=False)
            if before_it.regressed and abs(logs[-1] - math.log(before_it.before)) < abs(
                    logs[-1] - math.log(before_it.after)):
                verdict.regressed = False
                verdict.reason = (f"back: the latest run ({math.exp(logs[-1]) / before_it.before - 1:+.1%} against the "
                                  f"old level) is nearer the old level than the step flagged before it "
                                  f"({before_it.change:+.1%}); a revert, or noise")
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
    latest = rows[-1]
    for name in latest.get("figures", {}):
        kind = kind_of(latest, name)  # a count, a probe or an A/B ratio is never derived from a timing
        home = None if kind in ("count", "ab") else next(
            (g for g in groups if kind_of(latest, g[0]) == kind and any(derived_from(m, name, rows) for m in g)), None)
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
    machine: float | None = None  # how much the machine slowed over the same runs (the probe), or None
    machine_text: str = ""


def speed_records(records: list[dict]) -> list[dict]:
    """The measure records whose times may be judged: not emulated (testbed.measure.emulation)."""
    return [r for r in records if r["kind"] == "measure" and not r.get("emulated")]


def judge_figures(records: list[dict], history: int, min_history: int) -> list[Judgement]:
    """Every timing or rate of each series' latest run (probes, counts and A/B ratios have their own
    rules), judged over at most `history` runs before, the machine probe beside it."""
    out = []
    # emulated figures are not a device's speed (testbed.measure.emulation): no regression is judged on them
    measures = by_run_time(speed_records(records))
    probes = probe_runs(measures)
    measures.sort(key=series_key)  # stable: each series stays in run-time order
    for key, group in groupby(measures, key=series_key):
        rows = list(group)[-(history + 1):]
        for name, derived in quantities(rows):
            if kind_of(rows[-1], name) != "speed":
                continue  # a count, a probe, an A/B ratio, a fraction: judged by their own rules or not at all
            unit = rows[-1]["figures"][name]["unit"]
            runs = [r for r in rows if name in r.get("figures", {})]
            medians = [float(r["figures"][name]["median"]) for r in runs]  # "nan" is stored as a string
            verdict = judge_step(medians, lower_is_better(unit), commits=[str(r["git_commit"]) for r in runs],
                                 min_history=min_history)
            judgement = Judgement(key, name, derived, runs, verdict)
            if verdict.start is not None and verdict.previous is not None:
                against_machine(judgement, probes.get(key[1], {}), lower_is_better(unit))
            out.append(judgement)
    return out


# --- the machine probe: how much the machine slowed over the same runs ----------------------------------

# A probe run stands for the judged run nearest in time within this many hours (the same night).
PROBE_HOURS = 12.0


def _when(record: dict) -> float:
    import datetime as dt

    return dt.datetime.fromisoformat(record["started"]).timestamp()


def probe_runs(records: list[dict]) -> dict[str, dict[tuple, list[tuple[float, str, float]]]]:
    """Per device, per probe series (experiment, case, figure): (start time, run id, slowness) per run,
    slowness being the probe's median as a time (a rate inverted), so higher is a slower machine."""
    out: dict[str, dict[tuple, list[tuple[float, str, float]]]] = {}
    for r in records:
        if r["kind"] != "measure" or r.get("emulated"):
            continue
        for name, fig in r.get("figures", {}).items():
            if not isinstance(fig, dict) or not is_probe(r, name):
                continue
            unit, value = fig.get("unit", ""), fig.get("median")
            if not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
                continue
            if not (lower_is_better(unit) or higher_is_better(unit)):
                continue
            slowness = float(value) if lower_is_better(unit) else 1.0 / float(value)
            out.setdefault(r["device"], {}).setdefault((r["experiment"], r["case"], name), []).append(
                (_when(r), r["run_id"], slowness))
    return out


def machine_slowdown(runs: list[dict], old: range, new: range, probes: dict[tuple, list]) -> float | None:
    """How much slower the machine was over runs[new] than over runs[old] by its probe (0.05: 5% slower),
    the median over probe series; None where no probe was measured near both. A probe run stands for
    the run with the same id, else the judged run nearest in time within PROBE_HOURS."""
    times = [_when(r) for r in runs]
    ids = {r["run_id"]: i for i, r in enumerate(runs)}
    changes = []
    for series in probes.values():
        side: dict[str, list[float]] = {"old": [], "new": []}
        for when, run_id, slowness in series:
            i = ids.get(run_id)
            if i is None:
                i = min(range(len(times)), key=lambda j: abs(times[j] - when))
                if abs(times[i] - when) > PROBE_HOURS * 3600:
                    continue
            if i in old:
                side["old"].append(slowness)
            elif i in new:
                side["new"].append(slowness)
        if side["old"] and side["new"]:
            changes.append(_median(side["new"]) / _median(side["old"]))
    return _median(changes) - 1 if changes else None


def against_machine(j: Judgement, probes: dict[tuple, list], lower: bool) -> None:
    """Put the machine's slowdown beside a step; a step the machine explains is not a regression."""
    v = j.verdict
    m = machine_slowdown(j.rows, range(v.previous, v.last_before + 1), range(v.start, len(j.rows)), probes)
    if m is None:
        return
    j.machine = m
    slowdown = (1 + v.change) if lower else 1 / (1 + v.change)  # the figure's: above 1 is slower
    normalised = slowdown / (1 + m) - 1
    j.machine_text = (f"machine {'slowed' if m >= 0 else 'sped up'} by {abs(m):.1%} over the same runs (its probe); "
                      f"{normalised:+.1%} slower beside the machine")
    if v.regressed and normalised < MIN_CHANGE:
        v.regressed = False
        v.reason = f"the machine's: {j.machine_text}, below the {MIN_CHANGE:.0%} that counts"


# --- the flags ----------------------------------------------------------------------------------------


def figure_regressions(records: list[dict], history: int, min_history: int, *,
                       instruction_rise: float = INSTRUCTION_RISE, ab_alpha: float = AB_ALPHA) -> list[Flag]:
    """One flag per measured quantity whose latest run regressed: a timing stepped to a worse level
    beyond noise (and beyond the machine), an instruction count rose in it, or its A/B pair says B is
    slower."""
    flags = []
    for j in judge_figures(records, history, min_history):
        v = j.verdict
        if not v.regressed:
            continue
        latest, first, clean = j.rows[-1], j.rows[v.start], j.rows[v.last_before]
        fig = latest["figures"][j.what]
        flags.append(Flag(
            "figure", *j.series[:4], j.what,
            now=f"{fig['median']:.4g} {fig['unit']} [{fig['min']:.4g}, {fig['max']:.4g}]",
            before=f"{v.before:.4g} {fig['unit']}",
            spread=f"run-to-run noise {v.noise:.1%} over {v.last_before + 1} runs",
            change=f"{v.change:+.1%}", since=first["started"], since_commit=first["git_commit"],
            record_id=latest["record_id"], run_id=latest["run_id"], derived=j.derived, unit=fig["unit"],
            before_level=v.before, after_level=v.after, last_clean_commit=clean["git_commit"],
            machine=j.machine_text,
        ))
    current = latest_runs(records)
    flags += [c.flag() for c in count_changes(records, instruction_rise)
              if c.regression and c.is_latest and c.run_id in current]
    flags += [a.flag() for a in ab_judgements(records, ab_alpha) if a.regression and a.record["run_id"] in current]
    return flags


def flags(records: list[dict], settings: dict) -> list[Flag]:
    """Every flag over `records` with the report's settings (experiments/report.yaml): oracles that
    flipped, then figures."""
    return oracle_flips(records) + figure_regressions(
        records, settings["judged_runs"], settings["min_history"],
        instruction_rise=settings.get("instruction_rise", INSTRUCTION_RISE),
        ab_alpha=settings.get("ab_alpha", AB_ALPHA))


# --- exact counts: every change reported, a rise beyond instruction_rise flagged where it appears -------


@dataclass
class CountChange:
    """An instruction count that changed between two consecutive runs of one series."""

    series: tuple  # series_key
    what: str
    before: float
    after: float
    old: dict  # the last record with the old count
    new: dict  # the first record with the new count
    rise: float  # the configured fraction above which a rise is a regression
    is_latest: bool  # the new count is the series' latest run

    @property
    def change(self) -> float:
        return self.after / self.before - 1 if self.before > 0 else math.inf

    @property
    def regression(self) -> bool:
        return self.change > self.rise

    @property
    def run_id(self) -> str:
        return self.new["run_id"]

    @property
    def verdict(self) -> str:
        if self.regression:
            return "regression"
        return "improvement" if self.after < self.before else "changed (within the rise that counts)"

    def line(self) -> str:
        return (f"{self.series[0]} on {self.series[1]} {self.series[3]} {self.what}: {self.before:,.0f} -> "
                f"{self.after:,.0f} instructions ({self.change:+.2%}), {self.verdict}, "
                f"{str(self.old['git_commit'])[:8]}..{str(self.new['git_commit'])[:8]}")

    def flag(self) -> Flag:
        return Flag("instructions", *self.series[:4], self.what, now=f"{self.after:,.0f} instructions",
                    before=f"{self.before:,.0f} instructions", spread="exact count",
                    change=f"{self.change:+.2%}", since=self.new["started"], since_commit=self.new["git_commit"],
                    record_id=self.new["record_id"], run_id=self.new["run_id"], unit=INSTRUCTIONS,
                    before_level=self.before, after_level=self.after, last_clean_commit=self.old["git_commit"])


def count_changes(records: list[dict], rise: float = INSTRUCTION_RISE) -> list[CountChange]:
    """Every change of an instruction count between consecutive runs of a series, oldest first. Emulated
    devices' counts included: a count is exact wherever it was taken."""
    out = []
    measures = by_run_time([r for r in records if r["kind"] == "measure"])
    measures.sort(key=series_key)
    for key, group in groupby(measures, key=series_key):
        rows = list(group)
        names = dict.fromkeys(n for r in rows for n, f in r.get("figures", {}).items() if is_count(f))
        for name in names:
            runs = [r for r in rows if is_count(r.get("figures", {}).get(name))
                    and isinstance(r["figures"][name].get("median"), (int, float))]
            for old, new in zip(runs, runs[1:]):
                a, b = float(old["figures"][name]["median"]), float(new["figures"][name]["median"])
                if a != b:
                    out.append(CountChange(key, name, a, b, old, new, rise, new is runs[-1]))
    return out


def count_series(records: list[dict]) -> list[dict]:
    """The latest instruction count of every series, with the count before it and the time beside it
    (for the report's own table: counts are never in a table of times)."""
    out = []
    measures = by_run_time([r for r in records if r["kind"] == "measure"])
    measures.sort(key=series_key)
    for key, group in groupby(measures, key=series_key):
        rows = list(group)
        for name in dict.fromkeys(n for r in rows for n, f in r.get("figures", {}).items() if is_count(f)):
            runs = [r for r in rows if is_count(r.get("figures", {}).get(name))]
            latest = runs[-1]
            previous = runs[-2]["figures"][name]["median"] if len(runs) > 1 else None
            out.append({"series": key, "what": name, "record": latest, "count": latest["figures"][name]["median"],
                        "previous": previous, "runs": len(runs)})
    return out


# --- A/B ratios: each run's pairs judged directly ---------------------------------------------------------


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjustment of p-values (family-wise error rate): the i-th smallest of m is
    multiplied by m - i, then made non-decreasing in that order, capped at 1."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adjusted, running = [1.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


# The verdict of an A/B job whose two sides are the same build (the nightly's first night of a build: no
# earlier night measured its kernels): it compared nothing, so it is neither "no change" nor ever a flag.
NO_BASELINE = "no baseline: first night of this build"


@dataclass
class ABJudgement:
    """One A/B ratio figure of one run, judged with the run's other A/B figures."""

    record: dict
    what: str
    block: dict
    p_corrected: float
    alpha: float

    @property
    def ratio(self) -> float:
        return float(self.record["figures"][self.what]["median"])

    @property
    def regression(self) -> bool:
        return self.verdict == "slower"

    @property
    def verdict(self) -> str:
        if self.block.get("verdict") == NO_BASELINE:
            return NO_BASELINE
        if self.p_corrected >= self.alpha or abs(self.ratio - 1) < MIN_CHANGE:
            return "no change"
        return "slower" if self.ratio > 1 else "faster"

    def flag(self) -> Flag:
        r, fig = self.record, self.record["figures"][self.what]
        b = self.block
        return Flag("ab", r["experiment"], r["device"], config_key(r), r["case"], self.what,
                    now=f"B/A {self.ratio:.4g} [{fig.get('min', self.ratio):.4g}, {fig.get('max', self.ratio):.4g}]",
                    before="A (1.0)", spread=f"paired {b.get('test', '?')} test over {b.get('pairs', '?')} pairs",
                    change=f"{self.ratio - 1:+.1%}", since=r["started"], since_commit=str(b.get("b_commit", "")),
                    record_id=r["record_id"], run_id=r["run_id"], unit=AB_RATIO, before_level=1.0,
                    after_level=self.ratio, last_clean_commit=str(b.get("a_commit", "")),
                    ab={**{k: b.get(k) for k in AB_FIELDS}, "p_corrected": self.p_corrected, "alpha": self.alpha,
                        "judged": self.verdict})


def ab_judgements(records: list[dict], alpha: float = AB_ALPHA) -> list[ABJudgement]:
    """Every A/B ratio figure, its p corrected (Holm) over the A/B figures of its own run."""
    by_run: dict[str, list[tuple[dict, str, dict]]] = {}
    for r in records:
        if r["kind"] != "measure":
            continue
        for name in r.get("figures", {}):
            block = ab_block(r, name)
            if block is not None:
                by_run.setdefault(r["run_id"], []).append((r, name, block))
    out = []
    for found in by_run.values():
        ps = [float(b["p"]) if isinstance(b.get("p"), (int, float)) else 1.0 for _, _, b in found]
        out += [ABJudgement(r, name, b, p, alpha) for (r, name, b), p in zip(found, holm(ps))]
    return out


def oracle_flips(records: list[dict]) -> list[Flag]:
    """Oracles whose latest verdict fails or errs although an earlier comparable run passed. A refusal or a
    verdict not judged after a pass is no regression (testbed.verdicts): `testbed compare` shows the change."""
    flags = []
    oracles = by_run_time([r for r in records if r["kind"] == "oracle"])
    oracles.sort(key=series_key)
    for key, group in groupby(oracles, key=series_key):
        rows = [r for r in group if r["verdict"] not in UNJUDGED]
        last_pass = max((i for i, r in enumerate(rows) if r["verdict"] == PASS), default=None)
        if not rows or rows[-1]["verdict"] == PASS or last_pass is None:
            continue
        first_fail, passed = rows[last_pass + 1], rows[last_pass]
        flags.append(Flag(
            "oracle", key[0], key[1], key[2], key[3], key[4] or "",
            now=f"{rows[-1]['verdict']} (margin {_margin(rows[-1])})",
            before=f"pass (margin {_margin(passed)})", spread=f"last passed {passed['started']}",
            change="pass -> " + rows[-1]["verdict"], since=first_fail["started"],
            since_commit=first_fail["git_commit"], record_id=rows[-1]["record_id"], run_id=rows[-1]["run_id"],
            last_clean_commit=passed["git_commit"],
        ))
    return flags


def _margin(record: dict) -> str:
    """An oracle record's margin as every number is printed (testbed.report.tables.number): 0.866, not
    0.8660254037844386."""
    margin = record.get("margin")
    return number(margin) if isinstance(margin, (int, float)) and not isinstance(margin, bool) else str(margin)
