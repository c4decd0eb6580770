"""The Gemma decoder of refimpl.gemma written out a second time, in float64: the independent reference
that refimpl.gemma is judged against, in the tests and by `testbed run chunk_prefill` and `testbed run
tail` (their naive-float64 oracles).

It shares no code with refimpl.gemma and takes none of its shortcuts: no additive masks (each position
attends the positions the causal and sliding-window rules let it see, listed by index), RoPE from the
angle formula at each position, Gemma's RMSNorm with its (1 + w) weight offset written here, attention
one position at a time. A bug in refimpl.gemma's building blocks therefore shows as a difference
instead of being repeated on both sides of an oracle.

Plain numpy on a weights dict with Hugging Face names; `cfg` is read for its fields only (a
refimpl.gemma.GemmaConfig, or anything with the same attributes).
"""

from __future__ import annotations

import math

import numpy as np

LM_HEAD_BLOCK = 16_384  # vocabulary rows converted to float64 at a time (FunctionGemma's 262k x 640)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Gemma's RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * (1 + w)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def rotate(x: np.ndarray, base: float, scaling: float) -> np.ndarray:
    """Rotate-half RoPE of x [positions, heads, d], row t at position t: the pair (a, a + d/2) turns by
    the angle t * base^(-2a/d) / scaling."""
    n, _, d = x.shape
    half = d // 2
    angle = np.arange(n, dtype=np.float64)[:, None] * (base ** (-2.0 * np.arange(half) / d) / scaling)[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def logits(w: dict, cfg, tokens, position: int) -> np.ndarray:
    """Float64 logits [vocab] at `position` of the prompt `tokens` run from position 0 (later tokens
    cannot influence it, so they are not read)."""
    return logits_at(w, cfg, tokens, [position])[0]


def logits_at(w: dict, cfg, tokens, positions) -> np.ndarray:
    """Float64 logits [len(positions), vocab] at each of `positions`, from one run of the prompt up to the
    last of them (each row is the one `logits` gives alone: a position sees only the positions before it)."""
    positions = [int(p) for p in positions]
    tokens = np.asarray(tokens).reshape(-1)[: max(positions) + 1]
    n, d, eps = tokens.size, cfg.head_dim, cfg.rms_eps
    group = cfg.heads // cfg.kv_heads
    kv_of_head = np.arange(cfg.heads) // group            # Hugging Face's repeat_kv order
    scale = cfg.query_pre_attn_scalar ** -0.5

    def f64(name: str) -> np.ndarray:
        return np.asarray(w[name], np.float64)

    x = np.asarray(w["model.embed_tokens.weight"][tokens], np.float64) * math.sqrt(cfg.hidden)
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        base, scaling = (cfg.rope_local, 1.0) if kind == "local" else (cfg.rope_global, cfg.rope_scaling_global)
        h = rms_norm(x, f64(p + "input_layernorm.weight"), eps)
        q = rms_norm((h @ f64(p + "self_attn.q_proj.weight").T).reshape(n, cfg.heads, d),
                     f64(p + "self_attn.q_norm.weight"), eps)
        k = rms_norm((h @ f64(p + "self_attn.k_proj.weight").T).reshape(n, cfg.kv_heads, d),
                     f64(p + "self_attn.k_norm.weight"), eps)
        v = (h @ f64(p + "self_attn.v_proj.weight").T).reshape(n, cfg.kv_heads, d)
        q, k = rotate(q, base, scaling), rotate(k, base, scaling)
        attended = np.empty((n, cfg.heads, d))
        for t in range(n):
            first = 0 if kind == "global" else max(0, t - cfg.window + 1)   # the keys position t sees
            keys, values = k[first:t + 1][:, kv_of_head], v[first:t + 1][:, kv_of_head]  # [seen, heads, d]
            scores = np.einsum("hd,shd->hs", q[t], keys) * scale
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            attended[t] = np.einsum("hs,shd->hd", weights / weights.sum(axis=1, keepdims=True), values)
        o = attended.reshape(n, -1) @ f64(p + "self_attn.o_proj.weight").T
        x = x + rms_norm(o, f64(p + "post_attention_layernorm.weight"), eps)
        h = rms_norm(x, f64(p + "pre_feedforward_layernorm.weight"), eps)
        m = (gelu_tanh(h @ f64(p + "mlp.gate_proj.weight").T) * (h @ f64(p + "mlp.up_proj.weight").T)) \
            @ f64(p + "mlp.down_proj.weight").T
        x = x + rms_norm(m, f64(p + "post_feedforward_layernorm.weight"), eps)
    last = rms_norm(x[positions], f64("model.norm.weight"), eps)      # [len(positions), hidden]
    head = w["model.embed_tokens.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    out = np.concatenate([last @ np.asarray(head[r:r + LM_HEAD_BLOCK], np.float64).T
                          for r in range(0, head.shape[0], LM_HEAD_BLOCK)], axis=1)
    if cfg.final_logit_softcap:
        out = cfg.final_logit_softcap * np.tanh(out / cfg.final_logit_softcap)
    return out
