"""Regression detection over a figure's history (testbed.history): no false alarms from a noisy machine,
a real step flagged once per measured quantity.

The noise is simulated, seeded, never timed: a run times REPS repetitions, each drawn from a lognormal
distribution (sigma 0.15) with an occasional repetition taking twice as long (another process took the
core), and its figures are what the experiments compute from them (testbed.results.Figure): the time
in ms, and tokens/s and GFLOP/s from the same repetitions.
"""

from __future__ import annotations

import numpy as np

from testbed import history
from testbed.results import Figure, Record, RunInfo

REPS = 20
SIGMA = 0.15
OUTLIER_RATE, OUTLIER_FACTOR = 0.05, 2.0
TOKENS, FLOPS = 512, 3.1e9
SLOWDOWN = 1.15


def repetitions(rng: np.random.Generator, slower: float = 1.0) -> np.ndarray:
    """One run's timed repetitions (seconds)."""
    t = 0.02 * slower * rng.lognormal(0.0, SIGMA, REPS)
    t[rng.random(REPS) < OUTLIER_RATE] *= OUTLIER_FACTOR
    return t


def nightly_medians(rng: np.random.Generator, runs: int, slow_runs: int = 0) -> list[float]:
    return [float(np.median(repetitions(rng, SLOWDOWN if i >= runs - slow_runs else 1.0))) for i in range(runs)]


def stored_run(night: int, seconds: np.ndarray, cpu_seconds: np.ndarray) -> dict:
    """One run's bench record in its stored form (RunInfo.stamp), as gdn writes it."""
    info = RunInfo("gdn", "host", "native", {"chunk": 64}, {}, run_id=f"run{night:02d}", git_commit=f"c{night:02d}",
                   started=f"2026-01-{night + 1:02d}T02:00:00+00:00")
    t = Figure.of(seconds, "s")
    return info.stamp(Record("gdn", "H=4,hs=64,T=512/chunkwise", "measure", figures={
        "time": t.scaled(1e3, "ms"), "tokens_per_s": t.rate(TOKENS, "tokens/s"),
        "gflops": t.rate(FLOPS / 1e9, "GFLOP/s"),
        "cpu_time": Figure.of(cpu_seconds, "s").scaled(1e3, "ms")}))


def stored_history(seed: int, runs: int, slow_runs: int = 0) -> list[dict]:
    """`runs` nights of one commit; the wall time (not the CPU time) of the last `slow_runs` is slower."""
    rng = np.random.default_rng(seed)
    return [stored_run(i, repetitions(rng, SLOWDOWN if i >= runs - slow_runs else 1.0), repetitions(rng))
            for i in range(runs)]


def flags_each_night(records: list[dict]) -> list[history.Flag]:
    """What a nightly judges after each night, as it goes."""
    return [f for n in range(1, len(records) + 1) for f in history.figure_regressions(records[:n], 30, 5)]


# --- the records: one flag per measured quantity ---------------------------------------------------------


def test_twenty_reruns_of_one_commit_raise_no_flag():
    assert flags_each_night(stored_history(seed=1, runs=20)) == []


def test_a_planted_slowdown_is_flagged_once_naming_its_derived_figures():
    records = stored_history(seed=2, runs=20, slow_runs=4)
    (flag,) = history.figure_regressions(records, 30, 5)
    assert (flag.what, flag.derived) == ("time", ["tokens_per_s", "gflops"])  # cpu_time did not move
    assert flag.since == records[16]["started"] and flag.since_commit == "c16"
    # the change of levels: the median of the slow runs' medians over the median of the ones before
    medians = [r["figures"]["time"]["median"] for r in records]
    assert flag.change == f"{np.median(medians[16:]) / np.median(medians[:16]) - 1:+.1%}"
    assert "tokens_per_s, gflops" in flag.line()


def test_independent_timings_are_separate_quantities_and_rates_join_their_timing():
    groups = dict(history.quantities(stored_history(seed=3, runs=6)))
    assert groups == {"time": ["tokens_per_s", "gflops"], "cpu_time": []}


def test_a_figure_equal_in_every_run_is_not_taken_for_a_derived_one():
    records = stored_history(seed=4, runs=6)
    for r in records:  # a constant, e.g. a fixture's figure: proportional to anything, so proof of nothing
        r["figures"]["fixture_rate"] = {"median": 9.0, "min": 9.0, "max": 9.0, "reps": 1, "unit": "tokens/s"}
    assert ("fixture_rate", []) in history.quantities(records)


def test_emulated_runs_are_not_judged():
    records = stored_history(seed=2, runs=20, slow_runs=4)
    for r in records:
        r["emulated"] = True
    assert history.figure_regressions(records, 30, 5) == []


# --- the detector: a plain function of per-run medians ------------------------------------------------------


def test_a_noisy_night_just_past_the_envelope_is_within_noise():
    rng = np.random.default_rng(5)
    earlier = nightly_medians(rng, 12)
    noise = history.judge_step(earlier + [max(earlier)] * 2, True).noise
    for nights in (1, 2):  # one night, and a second that confirms it: both just past the envelope
        verdict = history.judge_step(earlier + [max(earlier) * 1.01] * nights, True)
        assert not verdict.regressed, verdict.reason
    # the same nights further out, beyond noise and beyond the least change that counts, are flagged
    far = max(earlier) * (1 + 6 * noise)
    assert history.judge_step(earlier + [far] * 2, True).regressed


def test_a_single_slow_night_waits_for_confirmation():
    earlier = nightly_medians(np.random.default_rng(6), 10)
    one = history.judge_step(earlier + [2 * max(earlier)], True)
    assert not one.regressed and one.reason.startswith("not yet")
    assert history.judge_step(earlier + [2 * max(earlier)] * 2, True).regressed


def test_fewer_than_five_earlier_runs_are_not_judged_and_say_so():
    earlier = nightly_medians(np.random.default_rng(7), 6)
    slow = [2 * max(earlier)] * 2
    short = history.judge_step(earlier[:3] + slow, True)
    assert not short.regressed and short.reason == "not judged: 4 earlier runs, 5 needed"
    begun_early = history.judge_step(earlier[:4] + slow, True)  # 5 earlier runs, but the step after 4
    assert not begun_early.regressed and begun_early.reason.startswith("not judged: the latest level began after 4")
    assert history.judge_step(earlier[:5] + slow, True).regressed


def test_rates_regress_downwards_and_improvements_are_not_flagged():
    rng = np.random.default_rng(8)
    earlier = nightly_medians(rng, 12)
    slower = [2 * max(earlier)] * 3
    assert history.judge_step(earlier + slower, lower_is_better=True).regressed
    rates = [1 / m for m in earlier + slower]
    assert history.judge_step(rates, lower_is_better=False).regressed
    improved = history.judge_step(earlier + [0.5 * min(earlier)] * 3, lower_is_better=True)
    assert not improved.regressed and improved.reason.startswith("improved")


def test_a_fixed_slowdown_is_history_not_a_regression():
    rng = np.random.default_rng(9)
    medians = nightly_medians(rng, 8) + [2 * m for m in nightly_medians(rng, 4)] + nightly_medians(rng, 6)
    verdict = history.judge_step(medians, True)
    assert not verdict.regressed, verdict.reason


def test_the_fit_finds_the_step_where_it_was_planted():
    assert history.fit_levels([1.0] * 7 + [2.0] * 3, penalty=0.5) == [0, 7]
    assert history.fit_levels([1.0, 1.1, 0.9, 1.0, 1.05], penalty=0.5) == [0]


def test_false_alarms_and_detections_over_many_seeded_histories():
    """Each history: 20 reruns of one commit, judged after every night as a nightly does. And the same
    noise with the last 4 runs 15% slower, judged once. The counts are the detector's operating point:
    they are printed (pytest -s) and bounded."""
    histories = 200
    alarms = detections = 0
    for seed in range(histories):
        medians = nightly_medians(np.random.default_rng(seed), 20)
        alarms += any(history.judge_step(medians[:n], True).regressed for n in range(6, 21))
        slowed = nightly_medians(np.random.default_rng(10_000 + seed), 20, slow_runs=4)
        detections += history.judge_step(slowed, True).regressed
    print(f"false alarms: {alarms}/{histories} histories of 20 reruns; 15% slowdowns over the last 4 runs found: "
          f"{detections}/{histories}")
    assert alarms <= 0.05 * histories and detections >= 0.75 * histories
