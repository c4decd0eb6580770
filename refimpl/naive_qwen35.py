"""The Qwen3.5-style hybrid decoder of refimpl.qwen35 written out a second time, in float64: the
independent reference the hybrid experiment's naive oracle judges refimpl.qwen35 against.

It shares no code with refimpl.qwen35, refimpl.gemma or refimpl.gdn: the causal convolution as its
sum over the kernel's taps, the GDN recurrence from refimpl.naive_gdn (loops, its own head map),
attention one position at a time over the positions it may see (no mask), the partial RoPE from its
angle formula, the norms (the (1 + w) offset of the decoder's norms, the plain weight of the GDN
output norm) written here. A bug in refimpl's building blocks therefore shows as a difference.

Plain numpy on a weights dict with Hugging Face names; `cfg` is read for its fields only (a
refimpl.qwen35.HybridConfig, or anything with the same attributes).
"""

from __future__ import annotations

import numpy as np

from refimpl.naive_gdn import naive_gdn


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The decoder's RMSNorm over the last axis, with the (1 + w) weight offset."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(||x||^2 + eps) over the last axis (the FLA library's form, as transformers uses it)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_delta_layer(w: dict, cfg, i: int, h: np.ndarray) -> np.ndarray:
    """GDN layer i on rows h [T, hidden] from a zero state: the output rows [T, hidden]."""
    p = f"model.layers.{i}.linear_attn."
    t_len, d, taps = h.shape[0], cfg.linear_head_dim, cfg.conv_kernel
    mixed = h @ np.asarray(w[p + "in_proj_qkv.weight"], np.float64).T          # [T, q | k | v channels]
    kernel = np.asarray(w[p + "conv1d.weight"], np.float64)[:, 0, :]           # [channels, taps]
    conv = np.zeros_like(mixed)
    for t in range(t_len):  # tap j of the kernel reads input row t - (taps - 1) + j; rows before 0 are zero
        for j in range(taps):
            source = t - (taps - 1) + j
            if source >= 0:
                conv[t] += kernel[:, j] * mixed[source]
    qkv = silu(conv)
    key_dim = cfg.linear_k_heads * d
    q = l2norm(qkv[:, :key_dim].reshape(t_len, cfg.linear_k_heads, d))
    k = l2norm(qkv[:, key_dim:2 * key_dim].reshape(t_len, cfg.linear_k_heads, d))
    v = qkv[:, 2 * key_dim:].reshape(t_len, cfg.linear_v_heads, d)
    beta = sigmoid(h @ np.asarray(w[p + "in_proj_b.weight"], np.float64).T)
    pre = h @ np.asarray(w[p + "in_proj_a.weight"], np.float64).T + np.asarray(w[p + "dt_bias"], np.float64)
    g = -np.exp(np.asarray(w[p + "A_log"], np.float64)) * np.logaddexp(0.0, pre)  # -A * softplus(pre)
    state = np.zeros((1, cfg.linear_v_heads, d, d))
    # Hugging Face repeats each key head over consecutive value heads: the interleaved map
    out = naive_gdn(q[None], k[None], v[None], g[None], beta[None], state, head_map="interleaved")[0][0]
    z = (h @ np.asarray(w[p + "in_proj_z.weight"], np.float64).T).reshape(t_len, cfg.linear_v_heads, d)
    normed = out / np.sqrt(np.mean(out * out, axis=-1, keepdims=True) + cfg.rms_eps)
    gated = normed * np.asarray(w[p + "norm.weight"], np.float64) * silu(z)
    return gated.reshape(t_len, -1) @ np.asarray(w[p + "out_proj.weight"], np.float64).T


def rotate_partial(x: np.ndarray, rotary: int, theta: float) -> np.ndarray:
    """x [T, heads, head_dim], row t at position t: the first `rotary` dims turned rotate-half style
    (the pair (a, a + rotary/2) by the angle t * theta^(-2a/rotary)), the rest as they are."""
    half = rotary // 2
    angle = np.arange(x.shape[0], dtype=np.float64)[:, None] * theta ** (-2.0 * np.arange(half) / rotary)[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    first, second, rest = x[..., :half], x[..., half:rotary], x[..., rotary:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin, rest], axis=-1)


def gated_attention_layer(w: dict, cfg, i: int, h: np.ndarray) -> np.ndarray:
    """Full attention layer i on rows h [T, hidden], causal, with its sigmoid output gate."""
    p = f"model.layers.{i}.self_attn."
    t_len, hd = h.shape[0], cfg.head_dim
    rotary = int(hd * cfg.rotary_fraction)
    q_and_gate = (h @ np.asarray(w[p + "q_proj.weight"], np.float64).T).reshape(t_len, cfg.heads, 2 * hd)
    q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:]                     # per head: d query, then d gate
    q = rotate_partial(rms_norm(q, np.asarray(w[p + "q_norm.weight"], np.float64), cfg.rms_eps), rotary, cfg.rope_theta)
    k = (h @ np.asarray(w[p + "k_proj.weight"], np.float64).T).reshape(t_len, cfg.kv_heads, hd)
    k = rotate_partial(rms_norm(k, np.asarray(w[p + "k_norm.weight"], np.float64), cfg.rms_eps), rotary, cfg.rope_theta)
    v = (h @ np.asarray(w[p + "v_proj.weight"], np.float64).T).reshape(t_len, cfg.kv_heads, hd)
    kv_of_head = np.arange(cfg.heads) // (cfg.heads // cfg.kv_heads)
    attended = np.empty((t_len, cfg.heads, hd))
    for t in range(t_len):  # position t sees positions 0..t
        scores = np.einsum("hd,shd->hs", q[t], k[:t + 1][:, kv_of_head]) / np.sqrt(hd)
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        attended[t] = np.einsum("hs,shd->hd", weights / weights.sum(axis=1, keepdims=True), v[:t + 1][:, kv_of_head])
    return (attended * sigmoid(gate)).reshape(t_len, -1) @ np.asarray(w[p + "o_proj.weight"], np.float64).T


def logits(w: dict, cfg, tokens) -> np.ndarray:
    """Float64 logits [vocab] at the last position of `tokens`, run from an empty state."""
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    x = np.asarray(w["model.embed_tokens.weight"][tokens], np.float64)
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        h = rms_norm(x, np.asarray(w[p + "input_layernorm.weight"], np.float64), cfg.rms_eps)
        x = x + (gated_delta_layer(w, cfg, i, h) if kind == "linear" else gated_attention_layer(w, cfg, i, h))
        h = rms_norm(x, np.asarray(w[p + "post_attention_layernorm.weight"], np.float64), cfg.rms_eps)
        m = silu(h @ np.asarray(w[p + "mlp.gate_proj.weight"], np.float64).T) \
            * (h @ np.asarray(w[p + "mlp.up_proj.weight"], np.float64).T)
        x = x + m @ np.asarray(w[p + "mlp.down_proj.weight"], np.float64).T
    last = rms_norm(x[-1], np.asarray(w["model.norm.weight"], np.float64), cfg.rms_eps)
    head = w["model.embed_tokens.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    return np.asarray(head, np.float64) @ last
