"""Decisions with their confidence: which variant is best, and from where on one beats another.

A decision testbed prints (the best chunk size, the breakeven tail, the hybrid's crossover context) is
drawn from repetitions, and repetitions on a loaded machine scatter. A point rule on medians names a
winner whatever the noise; here every decision comes with the set or interval the data cannot tell
apart at the stated confidence, from a percentile bootstrap over the repetitions:

  paired     variants timed interleaved (each repetition ran every variant once, testbed.measure.timing):
             a draw resamples repetitions, the same ones for every variant, so a repetition slowed by
             load slows all of them alike and cancels in their comparison
  unpaired   variants timed in separate jobs (a sweep's chunk sizes): each variant's repetitions are
             resampled on their own

The statistic is the median of the resampled repetitions, as the tables print. Where the data cannot
decide, the decision says "undecided" and how many more repetitions would about separate the closest
pair: the bootstrap interval narrows as 1/sqrt(repetitions), so about 2 n (halfwidth / distance)^2
repetitions separate a pair as far apart as measured 4 times out of 5 (more_repetitions). Exact
figures (instruction counts, one value each) decide without an interval, and equal counts are a tie,
every tied variant named; figures with too few repetitions (a seed's quoted medians) decide nothing:
their order by median is said, "undecided", with no confidence.

Three kinds of decision: `best_of` (the best of several variants: a chunk size), `crossing` (from
where on one beats another: a breakeven tail, a crossover context) and `ratio` (how many times one is
faster than another: chunked against token by token). Each returns its sentence (`says`) and its
parts as data; `label` is the short form a table cell holds and `as_data` the part JSON carries.

`by` names what a decision is made from ("time", "CPU time", "instructions") and is printed with it:
a decision reads one quantity, never instructions and time mixed.
"""

from __future__ import annotations

import math
from typing import Hashable, Mapping, Sequence

import numpy as np

LEVEL = 0.95    # the confidence every printed decision states
DRAWS = 2000    # bootstrap draws: the 2.5 % quantile then rests on 50 draws
# Fewer repetitions give no interval worth printing: resampling 3 values can only reproduce their own
# order, so three that happened to fall one way read as certain (a 30 % scatter then "decides" a tail
# 3 steps off the truth)
MIN_REPS = 5
MORE_REPS_CAP = 10_000  # beyond this the two are equal within any noise a person would wait for


def _medians(samples: np.ndarray, picks: np.ndarray) -> np.ndarray:
    """Per draw, the median of the picked repetitions. samples: (reps,), picks: (draws, reps)."""
    return np.median(samples[picks], axis=1)


def _draw_picks(reps: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, reps, size=(DRAWS, reps))


# An interval whose half-width equals the distance separates the pair half the time; 80 % of the time
# needs it narrower by z(0.975) / (z(0.975) + z(0.8)) = 1.96 / 2.80
POWER_FACTOR = (2.80 / 1.96) ** 2


def more_repetitions(reps: int, halfwidth: float, distance: float) -> int | None:
    """About how many more repetitions make an interval of `halfwidth` (at `reps`) narrow enough to
    separate a pair `distance` apart 4 times out of 5; None when the distance is nil or that would
    take more than MORE_REPS_CAP (the two are equal within any noise worth waiting out)."""
    if distance <= 0 or not math.isfinite(halfwidth):
        return None
    need = math.ceil(reps * POWER_FACTOR * (halfwidth / distance) ** 2) - reps
    return max(need, 1) if need < MORE_REPS_CAP else None


def _too_few(reps: int) -> str:
    return ("medians only, no repetitions to resample" if reps == 1
            else f"{reps} repetitions: too few for an interval, need {MIN_REPS - reps} more") + ", no confidence"


def _more_for_an_interval(reps: int) -> int | None:
    """With too few repetitions for an interval: how many more give one (None: medians only)."""
    return MIN_REPS - reps if 1 < reps < MIN_REPS else None


def _undecided_text(more: int | None) -> str:
    return (f"undecided at this noise (need about {more} more repetitions)" if more
            else f"undecided at this noise (the closest are too near for even {MORE_REPS_CAP} more repetitions "
                 "to separate)")


def _count(value: float) -> str:
    """An exact count as a person reads it: 4,280,474."""
    return f"{value:,.0f}"


def _names(keys) -> str:
    """'64', '64 and 128', '32, 64 and 128'."""
    words = [str(k) for k in keys]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def median_interval(samples: Sequence[float], level: float = LEVEL, seed: int = 0) -> tuple[float, float] | None:
    """The percentile-bootstrap interval of the median of `samples` at `level` (the statistic the tables
    print); None with fewer than MIN_REPS repetitions, which give no interval worth printing."""
    values = np.asarray(samples, float)
    if values.size < MIN_REPS:
        return None
    medians = _medians(values, _draw_picks(values.size, np.random.default_rng(seed)))
    tail = (1 - level) / 2
    lo, hi = np.quantile(medians, [tail, 1 - tail])
    return float(lo), float(hi)


def best_of(samples: Mapping[Hashable, Sequence[float]], lower_is_better: bool = True, paired: bool = False,
            by: str = "time", level: float = LEVEL, seed: int = 0) -> dict:
    """The best variant by median, and every variant not distinguishable from it at `level`: a variant
    is distinguishable when the bootstrap interval of log(its median / the best's) excludes 0.

    Returns {best, candidates (the best first), decided, tie, more_reps, method, reps, level, by, says}.
    `says` is the sentence to print. Exact counts that are equal are a tie: decided, every tied
    variant a candidate, each named. With too few repetitions for an interval nothing is told apart:
    undecided, every variant a candidate (by median). paired=True needs every variant to have the same
    repetitions, in the same order."""
    keys = list(samples)
    values = {k: np.asarray(samples[k], float) for k in keys}
    sign = 1.0 if lower_is_better else -1.0
    point = {k: float(np.median(v)) for k, v in values.items()}
    best = min(keys, key=lambda k: sign * point[k])
    reps = min(v.size for v in values.values())
    out = {"best": best, "level": level, "by": by, "reps": reps, "tie": False}
    if len(keys) == 1:
        return out | {"candidates": [best], "decided": True, "more_reps": None, "method": "one variant",
                      "says": f"{best} (the only one measured)"}
    exact = by == "instructions" and all(np.ptp(v) == 0 for v in values.values())
    if exact:
        ties = [best, *(k for k in keys if k != best and point[k] == point[best])]
        says = (f"{best} (by instructions, exact)" if len(ties) == 1 else
                f"a tie: {_names(ties)} (by instructions, exact: {_count(point[best])} each)")
        return out | {"candidates": ties, "decided": True, "tie": len(ties) > 1, "more_reps": None,
                      "method": "exact counts", "says": says}
    if reps < MIN_REPS:  # no interval: nothing is told apart, the medians' order is all there is
        method = _too_few(reps)
        ranked = sorted(keys, key=lambda k: (sign * point[k], keys.index(k)))
        return out | {"candidates": ranked, "decided": False, "more_reps": _more_for_an_interval(reps),
                      "method": method, "says": f"undecided ({method}): {best} by the medians alone"}
    if paired and len({v.size for v in values.values()}) != 1:
        raise ValueError("paired samples need the same number of repetitions for every variant")
    rng = np.random.default_rng(seed)
    shared = _draw_picks(reps, rng) if paired else None
    logs = {k: np.log(_medians(v, shared if paired else _draw_picks(v.size, rng))) for k, v in values.items()}
    tail = (1 - level) / 2
    candidates, needs = [best], []
    for k in keys:
        if k == best:
            continue
        diff = sign * (logs[k] - logs[best])  # > 0: k is worse than the best in that draw
        lo, hi = np.quantile(diff, [tail, 1 - tail])
        if lo <= 0:
            candidates.append(k)
            needs.append(more_repetitions(reps, (hi - lo) / 2, abs(math.log(point[k] / point[best]))))
    closest = None if None in needs else max(needs, default=None)
    method = f"bootstrap over repetitions ({'paired, interleaved' if paired else 'unpaired, separate jobs'})"
    decided = len(candidates) == 1
    how = f"{level:.0%} confidence by {by}, bootstrap over {reps} repetitions, {'paired' if paired else 'unpaired'}"
    if decided:
        says = f"{best} ({how})"
    else:
        others = ", ".join(str(k) for k in candidates[1:])
        says = f"{_undecided_text(closest)}: {best} by median, not distinguishable from {others} ({how})"
    return out | {"candidates": candidates, "decided": decided, "more_reps": None if decided else closest,
                  "method": method, "says": says}


def ratio(a: Sequence[float], b: Sequence[float], name_a: str, name_b: str, paired: bool = False, by: str = "time",
          level: float = LEVEL, seed: int = 0) -> dict:
    """How many times cheaper `a` is than `b` (costs: seconds or instructions, lower is better), as the
    ratio of their medians median(b) / median(a) with its bootstrap interval (paired: the same
    repetitions resampled for both, as when they ran interleaved in one job). Decided when the interval
    excludes 1: the cheaper one is named with the factor and its interval.

    Returns {faster (the name of the cheaper one; None when undecided), factor (b over a by the
    medians), lo, hi (of the factor), decided, more_reps, method, reps, level, by, says}."""
    av, bv = np.asarray(a, float), np.asarray(b, float)
    factor = float(np.median(bv) / np.median(av))
    reps = min(av.size, bv.size)
    out = {"factor": factor, "level": level, "by": by, "reps": reps}
    verb = "executes" if by == "instructions" else "is"
    adjective = "fewer instructions than" if by == "instructions" else "faster than"

    def faster(f: float, lo: float | None = None, hi: float | None = None, how: str = "") -> str:
        if f >= 1:
            span = f" ({lo:.2f}x to {hi:.2f}x, {how})" if lo is not None else f" ({how})"
            return f"{name_a} {verb} {f:.2f}x {adjective} {name_b}{span}"
        span = f" ({1 / hi:.2f}x to {1 / lo:.2f}x, {how})" if lo is not None else f" ({how})"
        return f"{name_b} {verb} {1 / f:.2f}x {adjective} {name_a}{span}"

    exact = by == "instructions" and np.ptp(av) == 0 and np.ptp(bv) == 0
    if exact:
        if factor == 1:
            return out | {"faster": None, "lo": 1.0, "hi": 1.0, "decided": True, "more_reps": None,
                          "method": "exact counts",
                          "says": f"a tie: {name_a} and {name_b} (by instructions, exact: {_count(av[0])} each)"}
        return out | {"faster": name_a if factor > 1 else name_b, "lo": factor, "hi": factor, "decided": True,
                      "more_reps": None, "method": "exact counts", "says": faster(factor, how="by instructions, exact")}
    if reps < MIN_REPS:
        method = _too_few(reps)
        return out | {"faster": None, "lo": None, "hi": None, "decided": False,
                      "more_reps": _more_for_an_interval(reps), "method": method,
                      "says": f"undecided ({method}): by the medians alone, {faster(factor, how='medians')}"}
    paired = paired and av.size == bv.size
    rng = np.random.default_rng(seed)
    picks_a = _draw_picks(av.size, rng)
    picks_b = picks_a if paired else _draw_picks(bv.size, rng)
    logs = np.log(_medians(bv, picks_b)) - np.log(_medians(av, picks_a))
    tail = (1 - level) / 2
    lo, hi = (float(np.exp(v)) for v in np.quantile(logs, [tail, 1 - tail]))
    decided = lo > 1 or hi < 1
    how = f"{level:.0%} confidence by {by}, bootstrap over {reps} repetitions, {'paired' if paired else 'unpaired'}"
    more = None if decided else more_repetitions(reps, math.log(hi / lo) / 2, abs(math.log(factor)))
    method = f"bootstrap over repetitions ({'paired, interleaved' if paired else 'unpaired, separate jobs'})"
    out |= {"lo": lo, "hi": hi, "decided": decided, "more_reps": more, "method": method}
    if decided:
        return out | {"faster": name_a if factor > 1 else name_b, "says": faster(factor, lo, hi, how)}
    return out | {"faster": None,
                  "says": f"{_undecided_text(more)}: {name_b} takes {lo:.2f}x to {hi:.2f}x {name_a}'s "
                          f"{'instructions' if by == 'instructions' else 'time'} ({how})"}


def label(decision: dict) -> str:
    """A best_of decision as a table cell holds it: the best alone when decided, "64 = 128 (tie)" for a
    tie of exact counts, "undecided: 64, 32, 128" (the best by median first) when the data cannot tell
    them apart."""
    names = [str(k) for k in decision["candidates"]]
    if decision.get("tie"):
        return " = ".join(names) + " (tie)"
    if decision["decided"]:
        return names[0]
    return "undecided: " + ", ".join(names)


DATA_KEYS = ("best", "candidates", "decided", "tie", "point", "lo", "hi", "faster", "factor", "level", "by",
             "method", "reps", "more_reps", "says")


def as_data(decision: dict) -> dict:
    """The decision's parts programs read (JSON: numbers stay numbers, keys as strings are kept as given)."""
    def plain(v):
        return v.item() if isinstance(v, np.generic) else [plain(x) for x in v] if isinstance(v, list) else v

    return {k: plain(decision[k]) for k in DATA_KEYS if k in decision}


def as_choice(decision: dict, source: str) -> dict:
    """A decision as a table or report carries it beside its rows: what is decided (`decision`), of what
    (`source`), its cell `label` (a best_of's; None for another kind) and its data (as_data)."""
    return {"source": source, "decision": decision.get("decision"),
            "label": label(decision) if "candidates" in decision else None, **as_data(decision)}


def _crossing_index(wins: np.ndarray, for_good: bool) -> np.ndarray:
    """Per draw (row), the index of the crossing: the first x where it wins (for_good: from which it
    wins at every larger x too); len(x) where it never does. wins: (draws, xs) booleans."""
    n = wins.shape[1]
    if for_good:
        # the crossing is one past the last x where it does not win
        losing = ~wins
        last_loss = np.where(losing.any(axis=1), n - 1 - np.argmax(losing[:, ::-1], axis=1), -1)
        return last_loss + 1
    return np.where(wins.any(axis=1), np.argmax(wins, axis=1), n)


def crossing(xs: Sequence[int], a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], margin: float = 0.0,
             for_good: bool = True, by: str = "time", level: float = LEVEL, seed: int = 0) -> dict:
    """From which x on a grid `a` beats `b` (a higher: a rate) by `margin` or more (a fraction: 0.01
    is 1 %), with its interval. a[i], b[i]: the repetitions at xs[i], paired (timed interleaved, the
    same repetitions in the same order); each x is resampled on its own. `reps` is the fewest any
    point has.

    Returns {point, lo, hi, decided, more_reps, method, reps, level, by, says}: point is the crossing by
    the medians (None: it never wins up to the largest x); the crossing lies in (lo, hi] at `level`, lo
    the grid point below the earliest plausible crossing (None: below the smallest x), hi the latest
    plausible crossing (None: beyond the largest x measured). Decided when the interval is one step of
    the grid; otherwise undecided, with about how many more repetitions would pin it."""
    xs = [int(x) for x in xs]
    av = [np.asarray(s, float) for s in a]
    bv = [np.asarray(s, float) for s in b]
    point_wins = np.array([[np.median(p) >= np.median(q) * (1 + margin) for p, q in zip(av, bv)]])
    point_i = int(_crossing_index(point_wins, for_good)[0])
    reps = min(min(p.size for p in av), min(q.size for q in bv))
    n = len(xs)

    def at(i: int) -> int | None:
        return xs[i] if 0 <= i < n else None

    out = {"point": at(point_i), "level": level, "by": by, "reps": reps}
    exact = by == "instructions" and all(np.ptp(v) == 0 for v in (*av, *bv))
    if exact or reps < MIN_REPS:
        # one value per point (exact counts, or a seed's medians): the grid alone bounds the crossing
        method = "exact counts: the grid's resolution" if exact else f"{_too_few(reps)}: the grid's resolution only"
        return out | {"lo": at(point_i - 1), "hi": at(point_i), "decided": exact,
                      "more_reps": None if exact else _more_for_an_interval(reps),
                      "method": method, "says": _crossing_says(at(point_i - 1), at(point_i), xs, method, None)}
    rng = np.random.default_rng(seed)
    ratios = np.empty((DRAWS, n))
    for i, (p, q) in enumerate(zip(av, bv)):
        picks = _draw_picks(p.size, rng)
        # paired where both have the same repetitions; a side with another count (a record without its
        # repetitions, its median standing for them) is resampled on its own
        other = picks if q.size == p.size else _draw_picks(q.size, rng)
        ratios[:, i] = np.log(_medians(p, picks)) - np.log(_medians(q, other)) - math.log1p(margin)
    index = _crossing_index(ratios >= 0, for_good)
    tail = (1 - level) / 2
    lo_i, hi_i = (int(v) for v in np.quantile(index, [tail, 1 - tail], method="inverted_cdf"))
    lo, hi = at(lo_i - 1), at(hi_i)
    # decided: the crossing is pinned to one step of the grid, or beyond it in every plausible draw
    decided = lo_i == hi_i
    more = None
    if not decided:
        # the x whose sign is least resolved decides how many repetitions the interval still needs
        half = (np.quantile(ratios, 1 - tail, axis=0) - np.quantile(ratios, tail, axis=0)) / 2
        distance = np.abs(np.log([np.median(p) / np.median(q) for p, q in zip(av, bv)]) - math.log1p(margin))
        needs = [more_repetitions(reps, half[i], distance[i]) for i in range(max(lo_i - 1, 0), min(hi_i + 1, n))]
        more = None if any(v is None for v in needs) else max(needs, default=None)
    method = "bootstrap over repetitions (paired, interleaved)"
    out |= {"lo": lo, "hi": hi, "decided": decided, "more_reps": None if decided else more, "method": method}
    how = f"{level:.0%} confidence by {by}, bootstrap over {reps} repetitions"
    return out | {"says": _crossing_says(lo, hi, xs, how, None if decided else _undecided_text(more))}


def _crossing_says(lo: int | None, hi: int | None, xs: Sequence[int], how: str, undecided: str | None) -> str:
    """The interval (lo, hi] in words; None ends are the grid's edges (at most xs[0], beyond xs[-1])."""
    if hi is None and lo == xs[-1]:
        span = f"beyond {xs[-1]} (the largest measured)"
    elif hi is None:
        low = f"above {lo}" if lo is not None else f"anywhere from {xs[0]}"
        span = f"{low}, possibly beyond {xs[-1]} (the largest measured)"
    else:
        span = f"between {lo} and {hi}" if lo is not None else f"at most {hi}"
    return (f"{undecided}: " if undecided else "") + f"{span} ({how})"
