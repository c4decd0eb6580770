"""Sequential A/B judging: how many pairs to measure, and what the pairs say.

On a loaded 2-core host single A/B pair ratios spread from about 0.5 to 4, so a fixed 10 pairs sees
only a change that makes nearly every pair slower. More pairs see smaller changes, but cost time the
same-tree case never needed. So the pairs are taken in looks (a group-sequential design) and the test
stops as soon as the verdict is decided:

  looks     6, 12, 24, 48, ... pairs per call, doubling up to the design's maximum (its last look);
            `fixed(n)` is the one-look design (`testbed ab --reps N`).
  test      at each look, per call, the two-sided Wilcoxon signed-rank test on the log ratios of all
            its pairs so far.
  spending  look k may spend the share n_k / sum(n) of the 5% (Bonferroni over the looks, weighted by
            pairs: the late looks, which see the most, get the most). A call's p is the least of
            p_k / share_k over its looks: whatever look the test stops at, and however the looks'
            tests depend on one another, P(p <= t) <= t under no change, so the p is valid and
            Holm over the calls on these p keeps the chance of any false call at 5% or below.
  decided   a call is decided "slower"/"faster" once its Holm-adjusted p < 0.05 and the whole 95%
            interval of its median ratio (distribution-free, from the sign test) lies beyond
            1 +- min_change: a slower pair or two in a heavy tail moves the median, not the interval;
            "no change" once p >= 0.05 and the interval lies within 1 +- `NO_CHANGE` (5%: no change
            the design is sized to see, DETECT = 10%, with room for a job that measures one smaller;
            stopping for it never adds a false call). A significant change
            whose interval still reaches within min_change stays open. A decided call takes no more
            pairs. Both conditions only narrow what the test alone would call: the 5% still holds.
  floor     a significant change whose whole interval lies within 1 +- min_change is decided "below
            floor": real, and smaller than the smallest change the job can call; no number of pairs
            makes it "slower".
  need      an undecided call's "need about N more pairs", at its observed spread (a normal
            approximation, x pi/3 for the signed-rank test), less the pairs it has: where its median
            lies beyond the floor and its interval reaches inside it, the pairs that would separate
            the median from the floor; where nothing is significant, those at which a DETECT change
            would be seen with 80% power. Where its median lies inside the floor it says so instead:
            "a change below the smallest change this job can call (5%)", never a number of pairs (an
            estimate that comes out at no more pairs than it has is not given either).

`drive` runs a design: it asks the caller for pairs look by look and stops when every call is
decided, the design is exhausted or the caller cannot afford the next look. `testbed ab`
(testbed.lab.ab) and the Monte-Carlo test of the false-alarm rate and the power
(tests/test_sequential.py) both use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from testbed.measure.history import holm

ALPHA = 0.05
MIN_PAIRS = 6     # the fewest pairs whose signed-rank test can reach p < 0.05 (two-sided); the first look
DETECT = 0.10     # the change the adaptive design is sized to see ("need about N more pairs" aims at it)
NO_CHANGE = 0.05  # "no change" is decided once the median's interval lies within +-this: half of DETECT, so
                  # a DETECT change that one job happens to measure smaller is not dismissed
POWER = 0.80      # the chance of seeing DETECT that "need about N more pairs" aims at
MIN_CHANGE = 0.05  # the floor a "slower"/"faster" interval must clear (`testbed ab --min-change`). At 2% the
                   # same tree against itself was called slower in 1 of 20 jobs at load 25-42 (B/A 1.07,
                   # interval 1.021-1.195 at 48 pairs): on a loaded host two runs of one binary drift apart
                   # by more than the signed-rank test's model allows. 5% is half of DETECT, so a +10% change
                   # still clears it once its interval is +-5% wide; that takes more pairs, hence MAX_PAIRS.
MAX_PAIRS = 384    # the last look's pairs per call (`--max-pairs`): with the 5% floor, simulated +10% jobs
                   # (tests/test_sequential.py) are called slower in 96% at 192 and 100% at 384
NEED_CAP = 100_000  # "need about N more pairs" beyond this is no estimate anyone would act on: not given


@dataclass(frozen=True)
class Design:
    """The looks (pairs per call at each) and what share of ALPHA each may spend."""

    name: str
    looks: tuple[int, ...]

    def share(self, k: int) -> float:
        return self.looks[k] / sum(self.looks)

    def describe(self) -> str:
        if len(self.looks) == 1:
            return f"fixed: {self.looks[0]} pairs"
        return f"group-sequential: looks at {', '.join(map(str, self.looks))} pairs, alpha spent in proportion to pairs"


def fixed(pairs: int) -> Design:
    return Design("fixed", (pairs,))


def group_sequential(max_pairs: int) -> Design:
    """Looks at 6, 12, 24, ... pairs, the last at max_pairs (>= MIN_PAIRS)."""
    if max_pairs < MIN_PAIRS:
        raise ValueError(f"a sequential design needs at least {MIN_PAIRS} pairs, got {max_pairs}")
    looks = [MIN_PAIRS]
    while looks[-1] * 2 < max_pairs:
        looks.append(looks[-1] * 2)
    if looks[-1] != max_pairs:
        looks.append(max_pairs)
    return Design("group-sequential", tuple(looks))


def signed_rank_p(ratios) -> float | None:
    """Two-sided Wilcoxon signed-rank p of log(B/A) around 0; None below MIN_PAIRS pairs."""
    from scipy.stats import wilcoxon

    logs = np.log(np.asarray(ratios, float))
    if len(logs) < MIN_PAIRS:
        return None
    if not np.any(logs):
        return 1.0
    return float(wilcoxon(logs, zero_method="zsplit", alternative="two-sided").pvalue)


def sequential_p(design: Design, ratios) -> float | None:
    """The call's p over the looks its pairs reached: min over looks of p_k / share_k (capped at 1)."""
    ps = [p / design.share(k) for k, n in enumerate(design.looks) if n <= len(ratios)
          if (p := signed_rank_p(ratios[:n])) is not None]
    return min(1.0, min(ps)) if ps else None


def median_interval(ratios) -> tuple[float, float]:
    """The distribution-free 95% interval of the median ratio (order statistics of the sign test)."""
    from scipy.stats import binom

    r = np.sort(np.asarray(ratios, float))
    k = max(int(binom.ppf(ALPHA / 2, len(r), 0.5)) - 1, 0)
    return float(r[k]), float(r[len(r) - 1 - k])


BELOW_FLOOR = "below floor"  # the verdict of a real change smaller than the floor (min_change)


@dataclass(frozen=True)
class Judgement:
    verdict: str            # slower | faster | below floor | no change | too few pairs
    decided: bool           # the adaptive design takes no more pairs for this call
    pairs: int
    p: float | None         # sequential p, uncorrected
    p_adjusted: float | None  # Holm over the calls
    need: int | None        # undecided: about how many more pairs would decide it (None: no honest estimate)
    low: float | None = None   # the 95% interval of the median ratio B/A (None below MIN_PAIRS)
    high: float | None = None
    why: str | None = None  # undecided: why, in words (the median against the floor, its interval)


def floor_words(min_change: float) -> str:
    return f"the smallest change this job can call ({min_change:.0%})"


def judge(design: Design, ratios: list[list[float]], min_change: float) -> list[Judgement]:
    """Every call's verdict from its pairs so far (each call's own looks), Holm over the calls."""
    ps = [sequential_p(design, r) for r in ratios]
    known = iter(holm([p for p in ps if p is not None]))
    adjusted = [None if p is None else next(known) for p in ps]
    out = []
    for r, p, p_adj in zip(ratios, ps, adjusted):
        if p_adj is None:
            out.append(Judgement("too few pairs", False, len(r), p, p_adj, MIN_PAIRS - len(r)))
            continue
        low, high = median_interval(r)
        significant = p_adj < ALPHA
        if significant and low > 1 + min_change:
            verdict, decided = "slower", True
        elif significant and high < 1 / (1 + min_change):
            verdict, decided = "faster", True
        elif significant and min_change > 0 and 1 / (1 + min_change) < low and high < 1 + min_change:
            verdict, decided = BELOW_FLOOR, True  # real, and all of it under the floor
        else:  # a significant change whose interval still reaches across min_change stays open
            verdict, decided = "no change", not significant and 1 / (1 + NO_CHANGE) < low and high < 1 + NO_CHANGE
        need, why = (None, None) if decided else _open(design, r, len(ratios), significant, min_change, low, high)
        out.append(Judgement(verdict, decided, len(r), p, p_adj, need, low, high, why))
    return out


def _open(design: Design, ratios, calls: int, significant: bool, min_change: float, low: float,
          high: float) -> tuple[int | None, str]:
    """An undecided call: about how many more pairs would decide it (None where no honest estimate
    exists), and why it is open, in words."""
    from scipy.stats import norm

    logs = np.log(np.asarray(ratios, float))
    median, floor = float(np.median(logs)), math.log1p(min_change)
    seen = f"B/A {math.exp(median):.3f} (95%: {low:.3f} to {high:.3f}) after {len(ratios)} pairs"
    if significant and abs(median) <= floor:
        return None, f"a change below {floor_words(min_change)}: {seen}"
    if significant:  # beyond the floor by its median, its interval reaching inside: separate it from the floor
        target, why = abs(median) - floor, f"a change near {floor_words(min_change)}: {seen}"
    else:  # nothing significant yet: the pairs at which a DETECT change would be seen
        target, why = math.log1p(DETECT), f"too noisy to call a change or no change: {seen}"
    spread = 1.4826 * float(np.median(np.abs(logs - median))) or float(np.std(logs)) or 1e-3
    level = ALPHA * design.share(len(design.looks) - 1) / calls
    n = (norm.ppf(1 - level / 2) + norm.ppf(POWER)) ** 2 * (spread / max(target, 1e-9)) ** 2 * math.pi / 3
    need = math.ceil(n) - len(ratios)
    # an estimate at no more pairs than it has, or past any job's reach, is no estimate: the words say why
    return (need, why) if 1 <= need <= NEED_CAP else (None, why)


def undecided_words(judged: list[Judgement]) -> str:
    """The open calls in a few words: the most pairs any would need, or, where none has an estimate,
    why the first is open."""
    still = [j for j in judged if not j.decided]
    needs = [j.need for j in still if j.need]
    if needs:
        return f"undecided, need about {max(needs)} more pairs"
    return f"undecided: {still[0].why}" if still and still[0].why else "undecided"


@dataclass(frozen=True)
class Outcome:
    ratios: list[list[float]]
    judgements: list[Judgement]
    looks_taken: int
    stopped: str            # "decided" | "budget spent: ..." | "all looks taken: ..."


def drive(design: Design, calls: int, take: Callable[[list[int], int], list[list[float]]],
          afford: Callable[[int], bool], min_change: float,
          progress: Callable[[str], None] = lambda msg: None) -> Outcome:
    """Run `design` over `calls` calls. take(undecided calls, n) measures n more pairs of each of those
    calls and returns their ratios (in that order); afford(runs) says whether the budget allows
    another look of that many pairs in all. Stops when every call is decided, the budget says no
    or the last look is taken."""
    ratios: list[list[float]] = [[] for _ in range(calls)]
    judged = judge(design, ratios, min_change)
    for k, n in enumerate(design.looks):
        open_calls = [i for i, j in enumerate(judged) if not j.decided]
        more = n - (design.looks[k - 1] if k else 0)
        if k and not afford(more * len(open_calls)):
            return Outcome(ratios, judged, k, f"budget spent: {undecided_words(judged)}")
        for i, new in zip(open_calls, take(open_calls, more)):
            ratios[i] += new
        judged = judge(design, ratios, min_change)
        open_after = sum(not j.decided for j in judged)
        progress(f"look {k + 1}/{len(design.looks)} at {n} pairs: {calls - open_after}/{calls} calls decided")
        if not open_after:
            return Outcome(ratios, judged, k + 1, "decided")
    if len(design.looks) == 1:
        return Outcome(ratios, judged, 1, "fixed design: all pairs taken")
    return Outcome(ratios, judged, len(design.looks), f"all looks taken: {undecided_words(judged)}")
