"""Oracles and regression detection pinned to values worked out by hand (issue 13, items 7 and 24; issue 14, item 7)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from testbed.measure import history
from testbed.oracles.numerical import check_nmse, nmse
from testbed.oracles.tokens import Reference, TokenCase, check_token_at_position
from tests.test_chunk_prefill_planted import model


# --- NMSE --------------------------------------------------------------------------------------------

def test_nmse_is_a_sum_over_a_sum():
    """sum((ref - out)^2) / sum(ref^2), worked out by hand: 1/30 and 4/12 (a mean in the numerator
    alone would give 1/120 and 4/144)."""
    assert nmse(np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 2.0, 3.0, 5.0])) == pytest.approx(1 / 30, rel=1e-15)
    ref, out = np.ones((3, 4)), np.ones((3, 4))
    out[0, 0] = 3.0
    assert nmse(ref, out) == pytest.approx(4 / 12, rel=1e-15)
    assert nmse(np.zeros(3), np.zeros(3)) == 0.0 and nmse(np.zeros(3), np.ones(3)) == float("inf")


def test_nmse_verdict_threshold_and_margin():
    ref, out = np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 2.0, 3.0, 4.0 + 1e-3])
    v = check_nmse({"y": ref}, {"y": out}, threshold=1e-7)  # NMSE 1e-6 / 30 = 3.33e-8
    assert v.passed and v.metrics["nmse"] == pytest.approx(1e-6 / 30) and v.margin == pytest.approx(np.log10(3.0))
    assert not check_nmse({"y": ref}, {"y": out}, threshold=1e-8).passed


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_in_the_reference_next_to_a_wrong_output_fails(bad):
    ref = np.array([1.0, bad, 2.0, 3.0])
    wrong = np.array([9.0, 1.0, -2.0, 7.0])
    v = check_nmse({"y": ref}, {"y": wrong})
    assert not v.passed and "the reference has 1 NaN/inf values" in v.detail
    assert not check_nmse({"y": wrong}, {"y": ref}).passed  # and on the output's side


@pytest.mark.parametrize("magnitude", [1e200, 1e-200, 1e300])
def test_nmse_of_huge_or_tiny_values_is_computed_scaled(magnitude):
    """Issue 24, item 11: float64 sums of squares of 1e200 overflow (inf / inf = NaN, which max() and
    <= read as a pass, margin 30) and of 1e-200 underflow (0 / 0)."""
    ref, out = np.array([1.0, 2.0]) * magnitude, np.array([1.1, 2.0]) * magnitude
    assert nmse(ref, out) == pytest.approx(0.01 / 5, rel=1e-12)
    v = check_nmse({"y": ref}, {"y": out})
    assert not v.passed and v.margin < 0 and v.metrics["nmse"] == pytest.approx(0.002, rel=1e-12)
    assert check_nmse({"y": ref}, {"y": ref.copy()}).passed
    assert not check_nmse({"y": np.array([1e308, -1e308])}, {"y": np.array([-1e308, 1e308])}).passed


# --- the token verdict at a tie ------------------------------------------------------------------------

CASE = TokenCase(past=40, tokens=12, chunk=16)


class ShiftedReference(Reference):
    """The model's reference, with its second-best logit at the case's position set `gap` below the best."""

    def __init__(self, base: Reference, gap: float):
        super().__init__(base.w, base.cfg, base.prompt)
        self.gap = gap

    def logits(self, position):
        logits = super().logits(position).copy()
        if position == CASE.position:
            a, b = np.argsort(logits)[::-1][:2]
            logits[b] = logits[a] - self.gap
        return logits


def flipping(backend, ref: Reference):
    """A backend within 2e-4 of the shifted reference's logits but ranking its top two the other way:
    what a correct reduced-precision backend does at a near tie."""
    top = ref.logits(CASE.position)
    a, b = np.argsort(top)[::-1][:2]

    def flip(result):
        logits, k, v = result
        if logits.shape == top.shape:
            logits = top.copy()
            logits[b] = top[a] + 2e-4
        return logits, k, v

    return dataclasses.replace(backend, prefill_with_past=lambda *a_: flip(backend.prefill_with_past(*a_)),
                               decode_with_past=lambda *a_: flip(backend.decode_with_past(*a_)))


def test_a_tie_within_tolerance_accepts_either_token():
    w, base, good = model()
    ref = ShiftedReference(base, gap=5e-4)  # closer than logit_atol=1e-3
    token, logits, *_ = check_token_at_position(flipping(good, ref), ref, CASE, logit_atol=1e-3)
    assert logits.passed
    assert token.passed, token.detail
    assert token.metrics["tie"] and len(token.metrics["tied_tokens"]) == 2 and token.margin > 0


def test_a_flip_where_the_reference_is_not_tied_still_fails():
    w, base, good = model()
    ref = ShiftedReference(base, gap=2e-3)  # further apart than the tolerance: no tie
    token = check_token_at_position(flipping(good, ref), ref, CASE, logit_atol=1e-3)[0]
    assert not token.passed and not token.metrics["tie"] and token.margin < 0


# --- NaN in the logits ----------------------------------------------------------------------------------


class NaNReference(Reference):
    """The model's reference with one NaN in its logits (or its naive model's) at the case's position:
    what a checkpoint holding a NaN weight gives."""

    def __init__(self, base: Reference, which: str):
        super().__init__(base.w, base.cfg, base.prompt)
        self.which = which

    def _poisoned(self, logits, which):
        logits = logits.copy()
        if which == self.which:
            logits[3] = np.nan
        return logits

    def logits(self, position):
        return self._poisoned(super().logits(position), "redecode")

    def naive_logits(self, position):
        return self._poisoned(super().naive_logits(position), "naive")


def test_nan_in_the_reference_logits_is_a_failed_verdict_naming_it():
    """Issue 24, item 10: tied_tokens gave [] and margin_for raised ValueError (a traceback, exit 1)."""
    w, base, good = model()
    verdicts = check_token_at_position(good, NaNReference(base, "redecode"), CASE)
    assert [v.oracle for v in verdicts] == ["token", "logits", "cache", "naive"]
    assert all(not v.passed and v.margin is None for v in verdicts)
    assert all("hold 1 NaN and 0 inf of 256 values" in v.detail and "reference" in v.detail for v in verdicts)
    token, logits, cache, naive = check_token_at_position(good, NaNReference(base, "naive"), CASE)
    assert token.passed and logits.passed and cache.passed
    assert not naive.passed and "naive float64 model's logits" in naive.detail and "1 NaN" in naive.detail


def test_nan_in_the_candidates_logits_fails_its_token_verdict_naming_it():
    w, base, good = model()

    def poisoned(result):
        logits, k, v = result
        logits = logits.copy()
        logits[..., 5] = np.nan
        return logits, k, v

    bad = dataclasses.replace(good, prefill_with_past=lambda *a: poisoned(good.prefill_with_past(*a)))
    token, logits, _, naive = check_token_at_position(bad, base, CASE)
    assert not token.passed and token.margin is None and "the chunk path's logits hold 1 NaN" in token.detail
    assert not logits.passed and not naive.passed


def test_cli_run_with_nan_reference_logits_is_a_failed_verdict_not_a_traceback(results_dir, monkeypatch, capsys):
    from refimpl import gemma

    from testbed.cli import main
    from testbed.results import ResultsStore

    real = gemma.redecode

    def nan_redecode(*a, **kw):
        logits = real(*a, **kw).copy()
        logits[0] = np.nan
        return logits

    monkeypatch.setattr(gemma, "redecode", nan_redecode)
    assert main(["run", "chunk_prefill", "mode=oracle", "cases=[{past:40,tokens:12}]", "chunk=16"]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "NaN" in out
    records = ResultsStore(results_dir).records("chunk_prefill")
    assert records and all(r["verdict"] == "fail" for r in records if r["oracle"] != "naive")


# --- regression detection ------------------------------------------------------------------------------

def test_the_level_fit_weighs_a_step_against_its_penalty():
    """Six runs at 1 and two at 2: one level (median 1) deviates by 1 + 1 = 2, two levels by 0. With a
    penalty of 1 per level that is 2 + 1 = 3 against 0 + 2 = 2: two levels. With a penalty of 3: 5 against
    6, one level."""
    medians = [1.0] * 6 + [2.0] * 2
    assert history.fit_levels(medians, penalty=1.0) == [0, 6]
    assert history.fit_levels(medians, penalty=3.0) == [0]


def test_the_noise_of_consecutive_differences():
    """Differences 1, 2, 1: median 1, over the median |x - y| of two standard normal draws (0.9539)."""
    assert history.difference_noise([0.0, 1.0, 3.0, 4.0]) == pytest.approx(1 / 0.9539, rel=1e-12)
