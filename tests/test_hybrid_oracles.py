"""The hybrid model's oracles (testbed.oracles.hybrid) pass on every GDN form and fail on planted bugs.

Forms: refimpl's serial and chunkwise GDN, and the native kernels (serial, chunkwise) through ctypes.
Planted bugs are the realistic ones of a chunked hybrid runtime: a state not carried between calls,
RoPE positions restarted per call, the conv state taken at a pad row, pads treated as real rows.
"""

from functools import partial

import numpy as np
import pytest

from refimpl import gdn, qwen35
from testbed.backends.native import library as native
from testbed.oracles import hybrid as ho

CHUNK = 32
# (P, n): from empty, mid-chunk past with a padded call, a single token, a full chunk after a long past
CASES = [(0, CHUNK), (45, 20), (77, 1), (130, CHUNK)]
TAIL_PROMPTS = [CHUNK + 1, 2 * CHUNK + 9, 4 * CHUNK + 27]
FORMS = {
    "serial": qwen35.gdn_form("serial"),
    "chunkwise": qwen35.gdn_form("chunkwise", 16),
    "native-serial": native.gdn_serial,
    "native-chunkwise": partial(native.gdn_chunkwise, chunk=16),
}


@pytest.fixture(scope="session")
def model():
    cfg = qwen35.tiny_config()
    return cfg, qwen35.init_weights(cfg), np.random.default_rng(0).integers(0, cfg.vocab, 200)


def verdicts(vs):
    return {v.oracle: v for v in vs}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("past, n", CASES)
def test_chunk_with_past_matches_redecode(model, form, past, n):
    cfg, w, prompt = model
    for v in ho.check_chunk_with_past(w, cfg, prompt, past, n, CHUNK, FORMS[form]):
        assert v.passed, f"{v.oracle}: {v.detail}"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("length", TAIL_PROMPTS)
def test_padded_tail_matches_scalar_tail(model, form, length):
    cfg, w, prompt = model
    for v in ho.check_padded_tail(w, cfg, prompt[:length], CHUNK, FORMS[form]):
        assert v.passed, f"{v.oracle}: {v.detail}"


@pytest.mark.parametrize("form", ["serial", "native-serial", "native-chunkwise"])
def test_pad_rows_are_the_identity_on_the_state_bit_for_bit(form):
    """Where the arithmetic allows: the serial recurrence multiplies by exp(0) = 1 and adds zero
    deltas; the native chunkwise kernel's products over the zero rows add exact zeros. (numpy's
    chunkwise form is not on this list: its BLAS products change blocking with the row count.)"""
    x = gdn.draw_inputs(1, 37, 2, 16, v_repeat=2, gate="mild")
    v = ho.check_pad_identity(x, 27, FORMS[form])
    assert v.passed, v.detail


@pytest.mark.quick
def test_pad_identity_fails_when_pads_keep_their_gate():
    x = gdn.draw_inputs(1, 37, 2, 16, v_repeat=2, gate="mild")

    def gate_leaks(q, k, v, g, beta, state, head_map):
        g = g.copy()
        g[:, 37:] = -0.05  # pads decay the state: g was not masked
        return gdn.gdn_serial(q, k, v, g, beta, state, head_map=head_map)

    assert not ho.check_pad_identity(x, 27, gate_leaks).passed


# --- planted bugs ------------------------------------------------------------------------------------


def failing(vs) -> set[str]:
    return {v.oracle for v in vs if not v.passed}


def wrap_linear_attention(monkeypatch, change_past):
    real = qwen35.linear_attention

    def planted(w, cfg, i, h, past, n, gdn_fn):
        return real(w, cfg, i, h, change_past(past), n, gdn_fn)

    monkeypatch.setattr(qwen35, "linear_attention", planted)


@pytest.mark.quick
@pytest.mark.parametrize("forgotten", ["recurrent", "conv"])
def test_planted_state_not_carried_fails(model, monkeypatch, forgotten):
    cfg, w, prompt = model
    wrap_linear_attention(monkeypatch, lambda past: {**past, forgotten: np.zeros_like(past[forgotten])})
    assert "state" in failing(ho.check_chunk_with_past(w, cfg, prompt, 45, 20, CHUNK, FORMS["serial"]))


def test_planted_rope_positions_restarting_per_call_fail(model, monkeypatch):
    cfg, w, prompt = model
    real = qwen35.rope_tables
    monkeypatch.setattr(qwen35, "rope_tables", lambda pos, dim, base: real(pos - pos[0], dim, base))
    assert "state" in failing(ho.check_chunk_with_past(w, cfg, prompt, 45, 20, CHUNK, FORMS["serial"]))


def test_planted_conv_state_at_the_calls_last_row_fails(model, monkeypatch):
    """The conv state taken as the call's last K - 1 rows, right for full chunks, pads for a padded tail."""
    cfg, w, prompt = model
    real = qwen35.conv_state_after
    monkeypatch.setattr(qwen35, "conv_state_after", lambda rows, n, kernel: real(rows, len(rows) - kernel + 1, kernel))
    assert "tail_state" in failing(ho.check_padded_tail(w, cfg, prompt[:2 * CHUNK + 9], CHUNK, FORMS["serial"]))


def test_planted_pads_as_real_rows_fail(model, monkeypatch):
    """Pads given beta and g as if real (cactus' corrupted LFM2 output had this cause)."""
    cfg, w, prompt = model
    real = qwen35.linear_attention
    monkeypatch.setattr(qwen35, "linear_attention",
                        lambda w_, cfg_, i, h, past, n, gdn_fn: real(w_, cfg_, i, h, past, h.shape[0], gdn_fn))
    assert "tail_state" in failing(ho.check_padded_tail(w, cfg, prompt[:2 * CHUNK + 9], CHUNK, FORMS["serial"]))


def test_token_oracle_fails_on_a_wrong_head_map(model, monkeypatch):
    """The token verdict can fail: with llama.cpp's tiled head map in the chunk calls only, some
    position's argmax moves (the state verdict fails everywhere)."""
    cfg, w, prompt = model
    real = qwen35.prefill_with_past

    def tiled_chunks(*args, **kwargs):
        monkeypatch.setattr(qwen35, "HEAD_MAP", "tiled")
        try:
            return real(*args, **kwargs)
        finally:
            monkeypatch.setattr(qwen35, "HEAD_MAP", "interleaved")

    monkeypatch.setattr(qwen35, "prefill_with_past", tiled_chunks)
    failed = [failing(ho.check_chunk_with_past(w, cfg, prompt, past, n, CHUNK, FORMS["serial"])) for past, n in CASES]
    assert all("state" in f for f in failed)
    assert any("token" in f for f in failed)


def test_bad_case_is_refused_with_the_value(model):
    cfg, w, prompt = model
    with pytest.raises(ValueError, match="n=40 tokens do not fit one chunk of 32"):
        ho.check_chunk_with_past(w, cfg, prompt, 0, 40, CHUNK, FORMS["serial"])
    with pytest.raises(ValueError, match="tail 'rolled' is not one of"):
        qwen35.prefill(w, cfg, prompt[:40], CHUNK, FORMS["serial"], tail="rolled")


# --- the tie rule --------------------------------------------------------------------------------------


def near_tie(gap: float = 3.9e-5, vocab: int = 4096):
    """Reference logits whose best two tokens (17 and 923) are `gap` apart, as on a real Qwen3.5 prompt."""
    ref = np.random.default_rng(5).normal(0, 3, vocab)
    ref[17] = ref.max() + 2.0
    ref[923] = ref[17] - gap
    return ref


def test_a_near_tie_flipped_within_the_logit_tolerance_passes_and_says_tie():
    """A correct candidate 3e-4 from the reference ranks a 3.9e-5 near tie the other way: every token
    verdict accepts it (the Gemma token oracle's rule) and says it was a tie."""
    ref = near_tie()
    cand = (ref + np.random.default_rng(6).uniform(-1e-4, 1e-4, ref.size)).astype(np.float32)
    cand[923], cand[17] = ref[17] + 1.5e-4, ref[17] - 1.5e-4  # flipped, 3e-4 apart
    assert int(np.argmax(cand)) == 923 and np.abs(cand - ref).max() <= 3e-4
    for v in (ho.check_token(ref, cand), ho.check_naive(ref, cand)):
        assert v.passed, v.detail
        assert v.metrics["tie"] and v.metrics["tied_tokens"] == [17, 923] and "tie" in v.detail
    assert ho.check_naive(ref, cand).metrics["nmse"] < 1e-7


def test_a_token_outside_the_tie_fails_every_token_verdict():
    """The rule is no blanket pass: the candidate's argmax 2e-3 below the reference's best (beyond the
    tolerance of 1e-3) fails the token and naive verdicts, though the naive NMSE alone would pass."""
    ref = near_tie()
    cand = ref.astype(np.float32).copy()
    runner_up = 2048
    ref[runner_up] = ref[17] - 2e-3
    cand[runner_up] = ref[17] + 1e-3
    token, naive = ho.check_token(ref, cand), ho.check_naive(ref, cand)
    assert not token.passed and token.margin < 0 and "token 2048, reference 17" in token.detail
    assert not naive.passed and naive.metrics["nmse"] < 1e-7 and "naive float64 model 17" in naive.detail
    # no tie at all: the plain argmax rule, margin the candidate's distance from flipping
    clear = near_tie(gap=0.5)
    v = ho.check_token(clear, clear)
    assert v.passed and not v.metrics["tie"] and v.margin == pytest.approx(0.5)
