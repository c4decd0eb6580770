"""The token-at-position oracle: the seed's cases pass, multi-chunk utterances pass, and each planted
bug fails it. Bugs sit where a real implementation puts them: in the host-side input builder (masks,
tables, select) or in the chunk graph's results."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from refimpl import gemma
from testbed.backends.refimpl import gemma as refimpl_backend
from testbed.cli import main
from testbed.oracles.tokens import Reference, TokenCase, check_mask_heads, check_token_at_position
from testbed.results import ResultsStore

CFG = gemma.tiny_config()          # window 512, layers 0-4 local, 5 global


@functools.lru_cache(maxsize=1)
def model():
    w = gemma.init_weights(CFG, 0)
    prompt = np.random.default_rng(11).integers(0, CFG.vocab, 900)
    return w, Reference(w, CFG, prompt), refimpl_backend.backend(w, CFG)


def verdicts(case, build=gemma.chunk_inputs, backend=None, **kw):
    w, ref, good = model()
    return {v.oracle: v for v in check_token_at_position(backend or good, ref, case, build=build, **kw)}


def fails(vs) -> bool:
    return any(not v.passed for v in vs.values())


SMALL = TokenCase(past=40, tokens=12, chunk=16)     # one padded call
SEED_64 = TokenCase(past=800, tokens=52, chunk=64)  # position 851, beyond the 512 window


# --- the correct path passes -------------------------------------------------------------------------


@pytest.mark.parametrize("case", [SEED_64, TokenCase(820, 32, 32), TokenCase(800, 52, 32),
                                  TokenCase(30, 45, 16)], ids=lambda c: c.name)
def test_seed_cases_and_multi_chunk_pass(case):
    vs = verdicts(case)
    assert not fails(vs), [v.detail for v in vs.values()]
    token = vs["token"]
    assert token.margin > 0 and token.metrics["token_chunk"] == token.metrics["token_ref"]
    assert vs["logits"].metrics["max_abs_logits_diff"] < 1e-4
    if case.tokens > case.chunk:
        assert token.metrics["calls"] == -(-case.tokens // case.chunk)


def test_pinned_expected_token_is_checked():
    ref_token = verdicts(SMALL)["token"].metrics["token_ref"]
    assert verdicts(SMALL, expected=ref_token)["token"].passed
    wrong = verdicts(SMALL, expected=(ref_token + 1) % CFG.vocab)["token"]
    assert not wrong.passed and "pins" in wrong.detail and wrong.margin < 0


# --- planted bugs ------------------------------------------------------------------------------------


def window_off_by_one(cfg, tokens, past_len, chunk, past_positions=None, **kw):
    """`query - key <= window` instead of `< window`: one key too many on local layers."""
    import dataclasses

    wider = dataclasses.replace(cfg, window=cfg.window + 1)
    return gemma.chunk_inputs(wider, tokens, past_len, chunk, past_positions, **kw)


def test_window_off_by_one_fails_beyond_the_window_only():
    assert fails(verdicts(SEED_64, window_off_by_one))
    assert not fails(verdicts(SMALL, window_off_by_one)), "below the window the bug cannot show"


def causal_band_transposed(cfg, tokens, past_len, chunk, past_positions=None, **kw):
    """The chunk's own C x C block built as key >= query: rows see later rows, not earlier ones."""
    inp = gemma.chunk_inputs(cfg, tokens, past_len, chunk, past_positions, **kw)
    for mask in inp.masks.values():
        mask[..., -chunk:] = np.swapaxes(mask[..., -chunk:], -1, -2).copy()
    return inp


def pad_rows_attend_real_rows(cfg, tokens, past_len, chunk, past_positions=None, **kw):
    """Pad rows given the mask of a real row at the next positions: they read the real keys."""
    inp = gemma.chunk_inputs(cfg, tokens, past_len, chunk, past_positions, **kw)
    unpadded = gemma.chunk_masks(cfg, np.arange(past_len) if past_positions is None else past_positions,
                                 inp.table_positions)
    for t, mask in inp.masks.items():
        mask[:, :, inp.n:] = unpadded[t][:, :, inp.n:]
    return inp


def rope_base_swapped(cfg, tokens, past_len, chunk, past_positions=None, **kw):
    """The local layers' tables built with the global base."""
    inp = gemma.chunk_inputs(cfg, tokens, past_len, chunk, past_positions, **kw)
    inp.tables["local"] = gemma.rope_tables(inp.table_positions, cfg.head_dim, cfg.rope_global)
    return inp


def select_last_row(cfg, tokens, past_len, chunk, past_positions=None, **kw):
    """The one-hot on row C-1 (a pad row when n < C) instead of row n-1."""
    return gemma.chunk_inputs(cfg, tokens, past_len, chunk, past_positions, select_row=chunk - 1)


@pytest.mark.parametrize("bug", [causal_band_transposed, pad_rows_attend_real_rows, rope_base_swapped,
                                 select_last_row], ids=lambda f: f.__name__)
def test_planted_input_bug_fails(bug):
    vs = verdicts(SMALL, bug)
    assert fails(vs), f"{bug.__name__} passed the oracle"


@pytest.mark.quick
def test_pad_rows_bug_is_caught_by_the_cache_check():
    vs = verdicts(SMALL, pad_rows_attend_real_rows)
    assert vs["token"].passed and not vs["cache"].passed
    assert vs["cache"].metrics["max_abs_real_rows_diff"] < 1e-4 < vs["cache"].metrics["max_abs_pad_rows_diff"]


@pytest.mark.quick
def test_kv_not_extended_fails():
    w, ref, good = model()

    def past_only(inp, past_k, past_v):
        logits, _, _ = good.prefill_with_past(inp, past_k, past_v)
        return logits, past_k, past_v

    bugged = refimpl_backend.backend(w, CFG)
    bugged.prefill_with_past = past_only
    vs = verdicts(TokenCase(30, 45, 16), backend=bugged)
    assert fails(vs) and "must be extended" in vs["token"].detail


def test_chunk_attending_past_only_fails():
    """A graph that extends K/V but attends only the past keys (the chunk's own rows dropped)."""
    w, _, _ = model()

    def past_only_attention(q, k, v, mask, scale):
        c = q.shape[1]
        if k.shape[1] == c:  # prefill_at, redecode and pad rows have no past: leave them alone
            return gemma.attention(q, k, v, mask, scale)
        keep = mask.copy()
        keep[..., -c:] = gemma.MASKED
        keep[..., -c:][..., np.arange(c), np.arange(c)] = 0  # still one key per row
        return gemma.attention(q, k, v, keep, scale)

    vs = verdicts(SMALL, backend=refimpl_backend.backend(w, CFG, attention=past_only_attention))
    assert fails(vs)


def test_a_graph_reading_every_heads_mask_from_one_head_is_caught_by_masks_that_differ_per_head():
    """A graph that broadcasts head 0's mask over the heads (a missing head stride): the real masks are
    the same for every head, so only masks that differ per head show it."""
    w, ref, good = model()

    def head_0_mask(q, k, v, mask, scale):
        return gemma.attention(q, k, v, np.broadcast_to(mask[:, :1], mask.shape), scale)

    bugged = refimpl_backend.backend(w, CFG, attention=head_0_mask)
    assert not fails(verdicts(SMALL, backend=bugged)), "with real masks the wrong head stride goes unseen"
    assert check_mask_heads(good, ref, SMALL).passed
    v = check_mask_heads(bugged, ref, SMALL)
    assert not v.passed and v.margin < 0 and "another head's mask" in v.detail


# --- `testbed run chunk_prefill` with refimpl.gemma itself wrong ---------------------------------------


def rms_norm_without_offset(x, w, eps):
    """RMSNorm scaled by w instead of Gemma's (1 + w): the norm weights read as plain scales."""
    x = x.astype(gemma.DTYPE)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + gemma.DTYPE(eps)) * w


def test_cli_run_fails_when_refimpl_norms_lose_the_weight_offset(results_dir, monkeypatch, capsys):
    """Redecode, prefill_at and the chunk graph all run through refimpl.gemma, so they agree with one
    another on the wrong model: only the naive float64 model, with its own norm, can fail them."""
    run = ["run", "chunk_prefill", "mode=oracle"]
    assert main(run) == 0
    monkeypatch.setattr(gemma, "rms_norm", rms_norm_without_offset)
    assert main(run) == 1
    out = capsys.readouterr().out
    records = ResultsStore(results_dir).records("chunk_prefill")
    planted = [r for r in records if r["run_id"] == records[-1]["run_id"]]
    verdicts = {(r["params"]["past"], r["oracle"]): r["verdict"] for r in planted}
    assert {o for (_, o), v in verdicts.items() if v != "pass"} == {"naive"}, verdicts
    assert all(verdicts[p, "naive"] == "fail" for p, _ in verdicts)  # every case
    naive = next(r for r in planted if r["oracle"] == "naive")
    assert naive["metrics"]["max_abs_naive_diff"] > naive["metrics"]["naive_atol"] and naive["margin"] < 0
    assert "naive float64 model" in naive["detail"] and f"FAIL {naive['case']}" in out


def test_cli_native_run_catches_an_attention_kernel_with_a_mask_head_stride_of_0(results_dir, monkeypatch, capsys):
    """Issue 24, item 9: every head's mask rows read from head 0 in the C attention kernel (both its
    paths). The engine builds masks that are the same for every head, so every utterance passes; the
    run's mask_heads verdict runs the same kernel with masks that differ per head."""
    from testbed.backends.native import build as kernel_build
    from tests.native_support import mutant_program

    mutant = mutant_program("host", "attention.c", "const float *m = mask + (size_t)r * l + j0;",
                            "const float *m = mask + (size_t)(r % a->c) * l + j0;",
                            also=(("a->mask + (size_t)(r0 + r) * a->l", "a->mask + (size_t)((r0 + r) % a->c) * a->l"),))
    monkeypatch.setattr(kernel_build, "build_programs", lambda target, **kw: mutant.parent)
    assert main(["run", "chunk_prefill", "backend=native", "mode=oracle"]) == 1
    records = ResultsStore(results_dir).records("chunk_prefill")
    failed = {r["oracle"] for r in records if r["verdict"] != "pass"}
    assert failed == {"mask_heads"}, failed  # the utterances themselves pass: their masks hide it
    (v,) = [r for r in records if r["oracle"] == "mask_heads"]
    assert "with masks that differ per head" in v["detail"] and v["evidence"][0]["ran"] == "tb_attention_bench"
