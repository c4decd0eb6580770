"""Interleaved timing (testbed.measure.timing.time_interleaved): every repetition visits every variant once,
in an order shuffled per repetition and recorded; and why it matters for the tail sweep: a planted
drift (a cost that rises while the job runs) bends a sweep measured one tail after another, not the
interleaved one."""

import pandas as pd
import pytest

from testbed.measure import breakeven
from testbed.measure.timing import interleaved_order, time_interleaved

KEYS = [(n, mode) for n in (130, 136, 144, 160) for mode in ("padded", "scalar")]


def test_every_repetition_visits_every_variant_once():
    order = interleaved_order(KEYS, reps=6, seed=11)
    assert len(order) == 6
    for rep in order:
        assert sorted(rep) == sorted(KEYS)


def test_the_seed_decides_the_order_and_each_repetition_has_its_own():
    order = interleaved_order(KEYS, reps=6, seed=11)
    assert order == interleaved_order(KEYS, reps=6, seed=11)  # reproducible from the recorded seed
    assert order != interleaved_order(KEYS, reps=6, seed=12)
    assert len({tuple(rep) for rep in order}) > 1             # shuffled per repetition, not once
    assert interleaved_order(KEYS, reps=3, seed=None) == [KEYS] * 3  # no seed: the given order


def test_the_recorded_order_is_the_order_the_variants_ran_in():
    ran = []
    fns = {key: (lambda key=key: ran.append(key)) for key in KEYS}
    timed = time_interleaved(fns, reps=4, warmup=1, seed=5)
    assert ran[:len(KEYS)] == KEYS                                   # the warm-up, in the given order
    assert ran[len(KEYS):] == [key for rep in timed.order for key in rep]
    assert timed.seed == 5
    for key in KEYS:
        assert [rep[i] for rep, i in zip(timed.order, timed.positions(key))] == [key] * 4
        for clock in ("wall", "cpu"):                                 # both clocks, one sample per rep
            fig = timed.figures[key][clock]
            assert fig.reps == 4 and fig.min <= fig.median <= fig.max


# --- a planted drift ---------------------------------------------------------------------------------

TAILS = [2, 4, 6, 8, 10, 12, 16, 20, 24]
REPS = 15
HEAT = 8.0  # the padded chunk (compute-bound) slows from 1x to 1 + HEAT times over the job, as a
            # throttling core would; scalar steps (weight-bound) cost `tail` units throughout
MEAN_HEAT = 1 + HEAT / 2
CHUNK_COST = 9 / MEAN_HEAT  # at the job's mean heat the chunk costs 9 units: padding wins from tail 10


class DriftingTimer:
    """A timer whose padded cost rises with every call timed: the drift, planted in the clock."""

    def __init__(self, total_calls: int):
        self.calls, self.total = 0, total_calls

    def variant(self, tail: int, mode: str):
        def call() -> dict[str, float]:
            heat = 1 + HEAT * self.calls / self.total
            self.calls += 1
            return {"wall": CHUNK_COST * heat if mode == "padded" else float(tail)}
        return call

    def __call__(self, call) -> dict[str, float]:
        return call()


def breakeven_of(figures) -> int | None:
    def rate(t: int, mode: str) -> float:
        return 1 / figures[t, mode]["wall"].median

    rows = [{"prompt_tokens": 128 + t, "tail": t, "padded_ttft_ms": 0.0, "scalar_ttft_ms": 0.0,
             "padded_tps": rate(t, "padded"), "scalar_tps": rate(t, "scalar")} for t in TAILS]
    return breakeven.breakeven_tail(pd.DataFrame(rows))


def expected_breakeven() -> int:
    """The breakeven of the planted costs at the job's mean heat, by the same rule as breakeven_tail."""
    wins = [t for t in TAILS if t / (CHUNK_COST * MEAN_HEAT) - 1 >= breakeven.TIE_PERCENT / 100]
    assert wins == TAILS[TAILS.index(wins[0]):]  # padding wins for good from there
    return wins[0]


def test_a_rising_cost_bends_a_sweep_of_one_job_per_tail():
    timer = DriftingTimer(2 * len(TAILS) * REPS)
    figures = {}
    for t in TAILS:  # the old sweep: a job per tail, the two modes alternating inside it
        calls = {(t, mode): timer.variant(t, mode) for mode in ("padded", "scalar")}
        figures.update(time_interleaved(calls, reps=REPS, warmup=0, timer=timer).figures)
    assert breakeven_of(figures) != expected_breakeven()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_interleaved_sweep_finds_the_breakeven_of_the_mean_load(seed):
    timer = DriftingTimer(2 * len(TAILS) * REPS)
    calls = {(t, mode): timer.variant(t, mode) for t in TAILS for mode in ("padded", "scalar")}
    timed = time_interleaved(calls, reps=REPS, warmup=0, seed=seed, timer=timer)
    assert breakeven_of(timed.figures) == expected_breakeven()


def test_a_sweep_keeps_the_keys_measured_together_in_each_job():
    from testbed import config, experiments

    together = experiments.sweep_together(config.swept_experiments(["experiment=tail"]))
    assert together == ["tail"]
    assert config.expand_sweep(["experiment=tail", "tail=0,4,8", "chunk=64,128"], together) == [
        ["experiment=tail", "tail=[0,4,8]", "chunk=64"], ["experiment=tail", "tail=[0,4,8]", "chunk=128"]]
    assert len(config.expand_sweep(["experiment=tail", "tail=0,4,8", "chunk=64,128"])) == 6  # otherwise a job each
