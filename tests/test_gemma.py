"""The Gemma reference model: masks, RoPE, the four graphs, and a sliding-window cache, on small shapes.

The model itself is checked against the model written out a second time in float64
(refimpl.naive_gemma), which shares no code with refimpl.gemma's attention, RoPE, norms or masks.
"""

from __future__ import annotations

import numpy as np
import pytest

from refimpl import gemma, naive_gemma


def small(**kw) -> gemma.GemmaConfig:
    return gemma.tiny_config(**{"vocab": 50, "layers": 2, "layer_types": ("local", "global"), "window": 4, **kw})


def test_default_layer_pattern_is_every_sixth_global():
    assert [i for i, t in enumerate(gemma.tiny_config(layers=12).layer_types) if t == "global"] == [5, 11]
    fg = gemma.functiongemma_config()
    assert (fg.layers, fg.hidden, fg.heads, fg.kv_heads, fg.head_dim, fg.vocab) == (18, 640, 4, 1, 256, 262144)
    assert fg.layer_types.count("global") == 3 and fg.types_in_use == ("local", "global")


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        gemma.tiny_config(heads=3)
    with pytest.raises(ValueError, match="rope_scaling_global"):
        gemma.tiny_config(rope_scaling_global=0.0)
    with pytest.raises(ValueError, match="'sliding'"):
        gemma.tiny_config(layers=1, layer_types=("sliding",))


def test_weights_have_hugging_face_names_and_are_seeded():
    cfg = small()
    a, b, c = gemma.init_weights(cfg, 1), gemma.init_weights(cfg, 1), gemma.init_weights(cfg, 2)
    assert "model.layers.1.self_attn.k_norm.weight" in a and "model.norm.weight" in a
    assert a["model.layers.0.self_attn.q_proj.weight"].shape == (cfg.heads * cfg.head_dim, cfg.hidden)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def mask_by_definition(qp, kp, window, local):
    """The mask rule written out one element at a time."""
    q, k = len(qp), len(kp)
    out = np.full((q, k), gemma.MASKED, np.float32)
    for i in range(q):
        for j in range(k):
            if qp[i] < 0:
                ok = j == k - q + i
            else:
                ok = 0 <= kp[j] <= qp[i] and (not local or kp[j] >= qp[i] - window + 1)
            if ok:
                out[i, j] = 0
    return out


@pytest.mark.parametrize("layer_type", ["local", "global"])
def test_mask_matches_its_definition(layer_type):
    past = [5, 6, -1, 2, 3, 4, -1]                 # a ring buffer with empty slots
    chunk = [7, 8, 9, -1, -1]                       # three real rows, two pad rows
    keys = past + chunk
    mask = gemma.attention_mask(chunk, keys, 3, 2, layer_type)
    assert mask.shape == (1, 2, 5, 12) and mask.dtype == np.float32
    want = mask_by_definition(chunk, keys, 3, layer_type == "local")
    assert np.array_equal(mask[0, 0], want) and np.array_equal(mask[0, 1], want)
    assert (mask[0, 0] == 0).any(axis=1).all(), "a fully masked row"
    assert [(mask[0, 0, r] == 0).sum() for r in (3, 4)] == [1, 1], "a pad row attends more than itself"


def test_rope_depends_only_on_relative_position():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 1, 16)).astype(np.float32)

    def score(m, n):
        cq, sq = gemma.rope_tables(np.array([m]), 16, 10_000.0)
        ck, sk = gemma.rope_tables(np.array([n]), 16, 10_000.0)
        return float(np.sum(gemma.apply_rope(q, cq, sq) * gemma.apply_rope(k, ck, sk)))

    assert score(7, 3) == pytest.approx(score(907, 903), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)


def test_linear_rope_scaling_divides_positions_and_leaves_unscaled_tables_unchanged():
    positions = np.arange(0, 64, 8)
    scaled = gemma.rope_tables(positions, 16, 10_000.0, 8.0)
    np.testing.assert_allclose(scaled, gemma.rope_tables(positions / 8, 16, 10_000.0), atol=1e-6)
    assert all(np.array_equal(a, b) for a, b in zip(gemma.rope_tables(positions, 16, 10_000.0, 1.0),
                                                    gemma.rope_tables(positions, 16, 10_000.0)))
    cfg = small(rope_scaling_global=8.0)
    inp = gemma.chunk_inputs(cfg, [1, 2, 3], 0, 4)
    assert np.array_equal(inp.tables["global"][0], gemma.rope_tables(np.arange(4), 16, cfg.rope_global, 8.0)[0])
    assert np.array_equal(inp.tables["local"][0], gemma.rope_tables(np.arange(4), 16, cfg.rope_local)[0])


@pytest.mark.parametrize("rope", [{}, {"rope_global": 5_000.0, "rope_scaling_global": 4.0}], ids=["default", "scaled"])
def test_redecode_matches_the_model_written_out(rope):
    cfg = small(heads=4, kv_heads=2, **rope)
    w = gemma.init_weights(cfg, 3)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab, 9)
    for position in (0, 8):  # 8 > window: the local layer drops early keys
        np.testing.assert_allclose(gemma.redecode(w, cfg, tokens, position), naive_gemma.logits(w, cfg, tokens, position),
                                   atol=2e-4)


@pytest.mark.parametrize("rope", [{}, {"rope_scaling_global": 8.0}], ids=["default", "scaled"])
def test_decode_chain_and_chunks_match_redecode_at_every_position(rope):
    cfg = small(**rope)
    w = gemma.init_weights(cfg, 0)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab, 11)
    ks, vs = gemma.empty_cache(cfg)
    for pos, tok in enumerate(tokens):
        logits, ks, vs = gemma.decode_with_past(w, cfg, int(tok), pos, ks, vs)
        np.testing.assert_allclose(logits, gemma.redecode(w, cfg, tokens, pos), atol=1e-5)
    # K/V rows are position-independent once written: the same from decode steps and from prefill_at
    _, pk, pv = gemma.prefill_at(w, cfg, tokens, len(tokens) - 1)
    for a, b in zip(ks + vs, pk + pv):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # a chunk of 4 (3 real rows + 1 pad) against the first 8 positions
    inp = gemma.chunk_inputs(cfg, tokens[8:11], 8, 4)
    logits, ck, _ = gemma.prefill_with_past(w, cfg, inp.tokens, inp.tables, [k[:, :8] for k in pk],
                                            [v[:, :8] for v in pv], inp.masks, inp.select)
    np.testing.assert_allclose(logits, gemma.redecode(w, cfg, tokens, 10), atol=1e-5)
    assert ck[0].shape == (cfg.kv_heads, 12, cfg.head_dim)


def test_prefill_at_select_by_index_or_onehot():
    cfg = small()
    w = gemma.init_weights(cfg, 0)
    tokens = np.arange(6)
    by_index = gemma.prefill_at(w, cfg, tokens, 2)[0]
    by_onehot = gemma.prefill_at(w, cfg, tokens, np.eye(6, dtype=np.float32)[2])[0]
    assert np.array_equal(by_index, by_onehot)
    np.testing.assert_allclose(by_index, gemma.redecode(w, cfg, tokens, 2), atol=1e-5)


def test_sliding_window_cache_passes_the_positions_its_rows_hold():
    """An all-local model needs only the last window-1 rows; a ring buffer holding them out of order
    (plus empty slots) gives the same logits as the full cache, for a decode step and for a chunk."""
    cfg = small(layer_types=("local", "local"), window=5)
    w = gemma.init_weights(cfg, 4)
    tokens = np.random.default_rng(5).integers(0, cfg.vocab, 16)
    _, pk, pv = gemma.prefill_at(w, cfg, tokens[:12], 11)
    order = np.array([10, 8, 11, 9])                       # positions 8..11, rotated like a ring
    ring_pos = np.concatenate([order, [-1, -1]])            # two empty slots
    ring = lambda kv: [np.concatenate([a[:, order], np.zeros_like(a[:, :2])], axis=1) for a in kv]  # noqa: E731
    step = gemma.decode_with_past(w, cfg, int(tokens[12]), 12, ring(pk), ring(pv), past_positions=ring_pos)[0]
    np.testing.assert_allclose(step, gemma.redecode(w, cfg, tokens, 12), atol=1e-5)
    inp = gemma.chunk_inputs(cfg, tokens[12:15], 6, 4, past_positions=ring_pos)
    assert inp.positions.tolist() == [12, 13, 14, -1]
    chunk = gemma.prefill_with_past(w, cfg, inp.tokens, inp.tables, ring(pk), ring(pv), inp.masks, inp.select)[0]
    np.testing.assert_allclose(chunk, gemma.redecode(w, cfg, tokens, 14), atol=1e-5)


def test_every_graph_uses_the_attention_parameter():
    cfg = small()
    w = gemma.init_weights(cfg, 0)
    calls = []

    def counting(q, k, v, mask, scale):
        calls.append(mask.shape)
        return gemma.attention(q, k, v, mask, scale)

    tokens = np.arange(5)
    _, ks, vs = gemma.prefill_at(w, cfg, tokens, 4, attention=counting)
    gemma.decode_with_past(w, cfg, 3, 5, ks, vs, attention=counting)
    gemma.redecode(w, cfg, tokens, 4, attention=counting)
    assert calls == [(1, cfg.heads, 5, 5)] * 2 + [(1, cfg.heads, 1, 6)] * 2 + [(1, cfg.heads, 5, 5)] * 2


def test_final_logit_softcap_bounds_logits():
    cfg = small(final_logit_softcap=0.5)
    logits = gemma.redecode(gemma.init_weights(cfg, 0), cfg, np.arange(4), 3)
    assert np.abs(logits).max() <= 0.5 and np.abs(logits).max() > 0.3


def test_chunk_inputs_refuses_a_chunk_too_small():
    with pytest.raises(ValueError, match="cannot hold 5 tokens"):
        gemma.chunk_inputs(small(), np.arange(5), 0, 4)
