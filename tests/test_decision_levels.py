"""A printed decision states the confidence it was computed at (testbed.measure.decisions).

The wording of a decision may change; what may not is that the level it prints is the level its interval
was computed at. Both halves are read from behaviour, never from a sentence: the percentage a decision
prints is its `level`, and the interval follows `level` (a pair separated at 80% needs a larger gap to be
separated at 99%; a crossing's interval at 99% holds the one at 80%, and is wider somewhere; a ratio's and
a median's interval widen with the level). Planted (issue 44): a 90% interval printed as "95%", and an
interval computed at one level whatever is asked; each fails these checks, the real code passes them.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from testbed.measure import decisions
from tests.mutants import mutant

LEVELS = (0.8, 0.9, 0.99)
PERCENT = re.compile(r"(\d+(?:\.\d+)?)\s?%")
FACTORS = np.round(np.arange(1.0, 1.6, 0.002), 4)  # b's median over a's, on a fine grid


def printed_levels(says: str) -> set[float]:
    """Every percentage a decision's sentence prints, as a fraction."""
    return {float(m) / 100 for m in PERCENT.findall(says)}


def pair(factor: float) -> dict:
    """Two variants timed in separate jobs, 25 repetitions each scattered by 10%; b `factor` times slower."""
    rng = np.random.default_rng(4)
    return {"a": list(np.exp(rng.normal(0, 0.1, 25))), "b": list(factor * np.exp(rng.normal(0, 0.1, 25)))}


def best_of_problems(best_of) -> list[str]:
    """What is wrong with `best_of`'s levels: a printed level that is not the one asked, or an interval that
    does not follow the level (the smallest gap it separates must grow with the level)."""
    problems, separates_from = [], {}
    for level in LEVELS:
        for f in FACTORS:
            found = best_of(pair(float(f)), level=level)
            if not found["decided"]:
                continue
            if printed_levels(found["says"]) != {level}:
                problems.append(f"level={level}: prints {sorted(printed_levels(found['says']))} ({found['says']!r})")
            separates_from[level] = float(f)
            break
    gaps = [separates_from.get(level) for level in LEVELS]
    if None in gaps or sorted(set(gaps)) != gaps:
        problems.append(f"the smallest factor separated at levels {LEVELS}: {gaps}; a higher level must need a "
                        "strictly larger one")
    return problems


def crossing_inputs(seed: int):
    """a's rate against b's over 8 tails, a better by 0.5% a step from 1.5% below, 5 noisy repetitions each."""
    rng = np.random.default_rng(seed)
    xs = list(range(1, 9))
    a = [list((0.985 + 0.005 * i) * np.exp(rng.normal(0, 0.02, 5))) for i in range(len(xs))]
    b = [list(np.exp(rng.normal(0, 0.02, 5))) for _ in xs]
    return xs, a, b


def span(found: dict, xs) -> tuple[float, float]:
    lo = xs[0] - 1 if found["lo"] is None else found["lo"]
    hi = xs[-1] + 1 if found["hi"] is None else found["hi"]
    return lo, hi


def crossing_problems(crossing) -> list[str]:
    """What is wrong with `crossing`'s levels: a printed level that is not the one asked, an interval at a
    higher level that does not hold the lower level's, or intervals that never widen with the level."""
    problems, widened = [], False
    for seed in range(12):
        xs, a, b = crossing_inputs(seed)
        found = {level: crossing(xs, a, b, level=level) for level in LEVELS}
        for level, d in found.items():
            if printed_levels(d["says"]) != {level}:
                problems.append(f"level={level}: prints {sorted(printed_levels(d['says']))} ({d['says']!r})")
        spans = [span(found[level], xs) for level in LEVELS]
        for (lo, hi), (lo2, hi2), level in zip(spans, spans[1:], LEVELS[1:]):
            if lo2 > lo or hi2 < hi:
                problems.append(f"seed {seed}: the interval at {level} {(lo2, hi2)} does not hold {(lo, hi)}")
            widened |= (lo2, hi2) != (lo, hi)
    if not widened:
        problems.append(f"the crossing's interval is the same at levels {LEVELS} for every data set")
    return problems


@pytest.mark.quick
def interval_problems(interval, printed: bool = True) -> list[str]:
    """What is wrong with an interval function's levels (decisions.ratio's factor, decisions.median_interval):
    a printed level that is not the one asked, or intervals that do not widen with the level."""
    problems, spans = [], []
    for level in LEVELS:
        lo, hi, says = interval(level)
        if printed and printed_levels(says) != {level}:
            problems.append(f"level={level}: prints {sorted(printed_levels(says))} ({says!r})")
        spans.append((lo, hi))
    if not all(lo2 < lo and hi2 > hi for (lo, hi), (lo2, hi2) in zip(spans, spans[1:])):
        problems.append(f"the intervals at levels {LEVELS}: {spans}; each must hold the one below it, wider")
    return problems


def ratio_interval(ratio):
    def at(level):
        found = ratio(*pair(1.08).values(), "a", "b", level=level)
        return found["lo"], found["hi"], found["says"]
    return at


def median_of(median_interval):
    def at(level):
        return (*median_interval(pair(1.0)["a"], level=level), "")
    return at


def test_best_of_prints_the_level_its_interval_was_computed_at():
    assert best_of_problems(decisions.best_of) == []


def test_a_crossing_prints_the_level_its_interval_was_computed_at():
    assert crossing_problems(decisions.crossing) == []


def test_a_ratio_prints_the_level_its_interval_was_computed_at():
    assert interval_problems(ratio_interval(decisions.ratio)) == []


def test_a_medians_interval_follows_its_level():
    assert interval_problems(median_of(decisions.median_interval), printed=False) == []


def test_the_default_level_is_the_one_printed():
    found = decisions.best_of(pair(1.5))
    assert found["decided"] and printed_levels(found["says"]) == {decisions.LEVEL}
    xs, a, b = crossing_inputs(0)
    assert printed_levels(decisions.crossing(xs, a, b)["says"]) == {decisions.LEVEL}


# the planted faults: the level asked, printed as the default one; the interval at one level whatever is asked
# (best_of's and ratio's sentences and intervals are written alike)
BEST_OF_MUTANTS = {"printed as the default": ('how = f"{level:.0%} confidence', 'how = f"{LEVEL:.0%} confidence'),
                   "computed at 90%": ("tail = (1 - level) / 2", "tail = (1 - 0.9) / 2")}
CROSSING_MUTANTS = {"printed as the default": ('how = f"{level:.0%} confidence', 'how = f"{LEVEL:.0%} confidence'),
                    "computed at 90%": ("tail = (1 - level) / 2", "tail = (1 - 0.9) / 2")}


@pytest.mark.quick
@pytest.mark.parametrize("planted", list(BEST_OF_MUTANTS))
def test_a_level_misprinted_or_ignored_by_best_of_is_caught(planted):
    assert best_of_problems(mutant(decisions, "best_of", *BEST_OF_MUTANTS[planted])) != []


@pytest.mark.parametrize("planted", list(CROSSING_MUTANTS))
def test_a_level_misprinted_or_ignored_by_crossing_is_caught(planted):
    assert crossing_problems(mutant(decisions, "crossing", *CROSSING_MUTANTS[planted])) != []


@pytest.mark.parametrize("planted", list(BEST_OF_MUTANTS))
def test_a_level_misprinted_or_ignored_by_ratio_is_caught(planted):
    assert interval_problems(ratio_interval(mutant(decisions, "ratio", *BEST_OF_MUTANTS[planted]))) != []


def test_a_medians_interval_ignoring_its_level_is_caught():
    planted = mutant(decisions, "median_interval", "tail = (1 - level) / 2", "tail = (1 - 0.9) / 2")
    assert interval_problems(median_of(planted), printed=False) != []
