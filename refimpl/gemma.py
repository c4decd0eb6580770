"""A Gemma 3 style decoder and its four graphs: the ground truth for chunk prefill with past (seed 000).

The model (per layer i, type "local" or "global"):

    x      = embed[tokens] * sqrt(hidden)
    h      = rmsnorm(x) ; q, k, v = h Wq, h Wk, h Wv      heads-first [heads, C, head_dim]
    q, k   = rope(rmsnorm_head(q)), rope(rmsnorm_head(k)) RoPE base 10,000 local / 1,000,000 global,
                                                          global positions optionally scaled linearly
    K, V   = past K, V extended by the chunk's k, v        cached AFTER k-norm and RoPE
    x     += rmsnorm(softmax(q K^T * scale + mask) V Wo)  grouped KV heads (head h reads h // group)
    x     += rmsnorm(down(gelu_tanh(gate(h)) * up(h)))    h = rmsnorm(x)
    logits = rmsnorm(x) embed^T                           tied; optional tanh soft-capping

RMSNorm weights are Gemma's offsets: y = x / rms(x) * (1 + w). scale = query_pre_attn_scalar ** -0.5.

Because K/V rows are stored after RoPE, a cache row never changes once written, and a graph needs no
position of its own: the caller passes per-position cos/sin tables and an additive mask per layer type.
The mask carries everything positional: causality, padding, the local layers' sliding window. So one
compiled chunk graph serves any past length and any cache layout (a sliding-window cache passes the
positions its rows hold).

The four graphs return (logits of one selected row [vocab], K list, V list) over layers, K/V per layer
[kv_heads, rows, head_dim]; redecode returns logits only. `redecode` is the oracle's reference: it
builds its positions, tables and masks by its own direct index comparisons, not through the host-side
builders (`chunk_inputs`, `attention_mask`) the other graphs share with every backend, so a bug in a
builder shows as a difference. Plain functions on numpy arrays, no I/O; float32 throughout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

LAYER_TYPES = ("local", "global")
MASKED = -1e30  # additive mask value; finite so a float32 sum never makes inf - inf
DTYPE = np.float32


@dataclass(frozen=True)
class GemmaConfig:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    window: int = 512
    layer_types: tuple[str, ...] | None = None  # default: layer i is global iff i % 6 == 5
    rope_local: float = 10_000.0
    rope_global: float = 1_000_000.0
    rope_scaling_global: float = 1.0  # linear RoPE scaling of the global layers (Gemma 3 4B and up: 8)
    query_pre_attn_scalar: float | None = None  # default: head_dim
    rms_eps: float = 1e-6
    final_logit_softcap: float | None = None
    tie_embeddings: bool = True

    def __post_init__(self):
        types = self.layer_types
        if types is None:
            types = tuple("global" if i % 6 == 5 else "local" for i in range(self.layers))
        types = tuple(types)
        if len(types) != self.layers:
            raise ValueError(f"layer_types has {len(types)} entries for {self.layers} layers")
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer type {bad[0]!r} is not one of {LAYER_TYPES}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if not self.rope_scaling_global > 0:
            raise ValueError(f"rope_scaling_global ({self.rope_scaling_global}) must be positive")
        object.__setattr__(self, "layer_types", types)
        if self.query_pre_attn_scalar is None:
            object.__setattr__(self, "query_pre_attn_scalar", float(self.head_dim))

    @property
    def types_in_use(self) -> tuple[str, ...]:
        """The layer types in order of first use (the contract's order for tables and masks)."""
        return tuple(dict.fromkeys(self.layer_types))

    def rope_base(self, layer_type: str) -> float:
        return self.rope_local if layer_type == "local" else self.rope_global

    def rope_scaling(self, layer_type: str) -> float:
        """Linear RoPE scaling factor: Gemma 3 scales only its global layers' positions."""
        return 1.0 if layer_type == "local" else self.rope_scaling_global

    @property
    def scale(self) -> float:
        return self.query_pre_attn_scalar ** -0.5


def tiny_config(**overrides) -> GemmaConfig:
    """The default synthetic model: six layers (five local, one global), grouped KV heads, window 512.
    Every graph runs in well under a second on one core at 800 positions."""
    return GemmaConfig(**{**dict(vocab=256, hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16, mlp=128),
                          **overrides})


def functiongemma_config(**overrides) -> GemmaConfig:
    """FunctionGemma (Gemma 3 270M): the shape of the seed's device runs."""
    return GemmaConfig(**{**dict(vocab=262_144, hidden=640, layers=18, heads=4, kv_heads=1, head_dim=256,
                               mlp=2048, query_pre_attn_scalar=256.0), **overrides})


# --- weights ----------------------------------------------------------------------------------------


def weight_shapes(cfg: GemmaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor by its Gemma 3 Hugging Face name, with its shape ([out, in] for projections)."""
    shapes = {"model.embed_tokens.weight": (cfg.vocab, cfg.hidden)}
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, cfg.hidden),
            p + "self_attn.k_proj.weight": (kv, cfg.hidden),
            p + "self_attn.v_proj.weight": (kv, cfg.hidden),
            p + "self_attn.o_proj.weight": (cfg.hidden, q),
            p + "self_attn.q_norm.weight": (cfg.head_dim,),
            p + "self_attn.k_norm.weight": (cfg.head_dim,),
            p + "input_layernorm.weight": (cfg.hidden,),
            p + "post_attention_layernorm.weight": (cfg.hidden,),
            p + "pre_feedforward_layernorm.weight": (cfg.hidden,),
            p + "post_feedforward_layernorm.weight": (cfg.hidden,),
            p + "mlp.gate_proj.weight": (cfg.mlp, cfg.hidden),
            p + "mlp.up_proj.weight": (cfg.mlp, cfg.hidden),
            p + "mlp.down_proj.weight": (cfg.hidden, cfg.mlp),
        })
    shapes["model.norm.weight"] = (cfg.hidden,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab, cfg.hidden)
    return shapes


def init_weights(cfg: GemmaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded synthetic weights: projections N(0, 1/fan_in) so activations stay O(1), the embedding
    N(0, 1/hidden) so sqrt(hidden) scaling gives unit-RMS inputs, norm offsets N(0, 0.1^2)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(cfg).items():
        if len(shape) == 1:
            std = 0.1
        elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            std = cfg.hidden ** -0.5
        else:
            std = shape[1] ** -0.5
        weights[name] = rng.standard_normal(shape, dtype=DTYPE) * DTYPE(std)
    return weights


# --- building blocks ----------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Gemma's RMSNorm over the last axis, with the (1 + w) weight offset."""
    x = x.astype(DTYPE)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + DTYPE(eps)) * (1 + w)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(DTYPE(math.sqrt(2 / math.pi)) * (x + DTYPE(0.044715) * x**3)))


def rope_tables(positions: np.ndarray, head_dim: int, base: float,
                scaling: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [len(positions), head_dim] for the rotate-half RoPE convention (frequencies
    repeated over both halves). Angles in float64, then float32, so large positions stay exact.
    Linear scaling divides every frequency by `scaling` (Hugging Face's "linear" rope_type, llama.cpp's
    freq_scale = 1/factor); dividing by 1.0 is exact, so unscaled tables are unchanged."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / scaling
    angles = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(DTYPE), np.sin(angles).astype(DTYPE)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [heads, C, head_dim] rotated by per-row tables [C, head_dim]."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    """One attention layer against a cache: q [heads, C, d], k/v [kv_heads, K, d], additive mask
    [1, heads, C, K] -> [heads, C, d]. Query head h reads KV head h // (heads / kv_heads) (Hugging
    Face's repeat_kv order). Softmax with the row maximum subtracted."""
    heads, c, d = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    scores = np.einsum("ngcd,nkd->ngck", q.reshape(kv_heads, group, c, d), k) * DTYPE(scale)
    scores = scores.reshape(heads, c, -1) + mask[0]
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    out = np.einsum("ngck,nkd->ngcd", probs.reshape(kv_heads, group, c, -1), v)
    return out.reshape(heads, c, d).astype(DTYPE)


AttentionFn = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float], np.ndarray]


def embed(w: dict, cfg: GemmaConfig, tokens: np.ndarray) -> np.ndarray:
    return w["model.embed_tokens.weight"][np.asarray(tokens)] * DTYPE(math.sqrt(cfg.hidden))


def lm_head(w: dict, cfg: GemmaConfig, row: np.ndarray) -> np.ndarray:
    """Logits [vocab] of one hidden row: final norm, (tied) output projection, optional soft cap."""
    head = w["model.embed_tokens.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    logits = head @ rms_norm(row, w["model.norm.weight"], cfg.rms_eps)
    if cfg.final_logit_softcap:
        cap = DTYPE(cfg.final_logit_softcap)
        logits = cap * np.tanh(logits / cap)
    return logits.astype(DTYPE)


def decoder_layer(w: dict, cfg: GemmaConfig, i: int, x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                  past_k: np.ndarray, past_v: np.ndarray, mask: np.ndarray,
                  attention: AttentionFn = attention) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layer i on rows x [C, hidden] against its cache; returns new x and K/V extended by the C rows."""
    p = f"model.layers.{i}."
    c = x.shape[0]
    h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_eps)

    def heads_first(name: str, n: int) -> np.ndarray:
        return (h @ w[p + name].T).reshape(c, n, cfg.head_dim).transpose(1, 0, 2)

    q = apply_rope(rms_norm(heads_first("self_attn.q_proj.weight", cfg.heads),
                            w[p + "self_attn.q_norm.weight"], cfg.rms_eps), cos, sin)
    k = apply_rope(rms_norm(heads_first("self_attn.k_proj.weight", cfg.kv_heads),
                            w[p + "self_attn.k_norm.weight"], cfg.rms_eps), cos, sin)
    v = heads_first("self_attn.v_proj.weight", cfg.kv_heads)
    k_all = np.concatenate([past_k, k], axis=1).astype(DTYPE)
    v_all = np.concatenate([past_v, v], axis=1).astype(DTYPE)

    o = attention(q, k_all, v_all, mask, cfg.scale).transpose(1, 0, 2).reshape(c, -1)
    x = x + rms_norm(o @ w[p + "self_attn.o_proj.weight"].T, w[p + "post_attention_layernorm.weight"], cfg.rms_eps)
    h = rms_norm(x, w[p + "pre_feedforward_layernorm.weight"], cfg.rms_eps)
    m = (gelu_tanh(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = x + rms_norm(m, w[p + "post_feedforward_layernorm.weight"], cfg.rms_eps)
    return x.astype(DTYPE), k_all, v_all


# --- host-side builders (shared by every backend) ----------------------------------------------------


def attention_mask(query_positions, key_positions, window: int, heads: int, layer_type: str) -> np.ndarray:
    """Additive mask [1, heads, Q, K], 0 = attend, -1e30 = masked.

    Keys are the past followed by the queries' own rows, so query row i's own key column is K - Q + i.
    A key position of -1 is an empty or pad slot: never attended by a real row. A real query at
    position a attends keys at positions in [0, a] (causal), and for a local layer only those in
    [a - window + 1, a]. A query position of -1 is a pad row: it attends only its own column, so no row
    is fully masked (a fully masked row is NaN once -1e30 rounds to -inf in float16)."""
    qp = np.asarray(query_positions, np.int64)
    kp = np.asarray(key_positions, np.int64)
    if kp.size < qp.size:
        raise ValueError(f"{kp.size} keys cannot hold the {qp.size} queries' own rows")
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"layer type {layer_type!r} is not one of {LAYER_TYPES}")
    allowed = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None])
    if layer_type == "local":
        allowed &= kp[None, :] >= qp[:, None] - window + 1
    pad = np.flatnonzero(qp < 0)
    allowed[pad, :] = False
    allowed[pad, kp.size - qp.size + pad] = True
    mask = np.where(allowed, DTYPE(0), DTYPE(MASKED)).astype(DTYPE)
    return np.ascontiguousarray(np.broadcast_to(mask, (1, heads, *mask.shape)))


def chunk_masks(cfg: GemmaConfig, past_positions, chunk_positions) -> dict[str, np.ndarray]:
    """One mask per layer type in use, keys = past rows then the chunk's rows."""
    keys = np.concatenate([np.asarray(past_positions, np.int64), np.asarray(chunk_positions, np.int64)])
    return {t: attention_mask(chunk_positions, keys, cfg.window, cfg.heads, t) for t in cfg.types_in_use}


@dataclass
class ChunkInputs:
    """Everything one prefill_with_past call takes besides weights and cache; the same bytes go to
    every backend."""

    tokens: np.ndarray                # [C] int32, zero-padded after the n real tokens
    positions: np.ndarray             # [C] int64 absolute position of each row, -1 for pad rows
    tables: dict[str, tuple[np.ndarray, np.ndarray]]  # layer type -> (cos, sin) [C, head_dim]
    masks: dict[str, np.ndarray]      # layer type -> [1, heads, C, P + C]
    select: np.ndarray                # [C] float32 one-hot
    n: int                            # real tokens
    table_positions: np.ndarray       # [C] positions the tables were built for (pads continue the chunk)


def chunk_inputs(cfg: GemmaConfig, tokens, past_len: int, chunk: int, past_positions=None,
                 select_row: int | None = None, start: int | None = None) -> ChunkInputs:
    """Inputs for one chunk of n <= chunk real tokens against a past of past_len rows.

    past_positions: the position each past row holds (-1 empty); default 0..past_len-1. The chunk
    starts at `start`, default one after the newest past position. Pad rows get table rows for the
    positions that continue the chunk and mask position -1 (they attend only themselves, so their
    K/V rows are those of their token alone at that position). select_row defaults to the last real
    row."""
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    n = tokens.size
    if not 1 <= n <= chunk:
        raise ValueError(f"a chunk of {chunk} rows cannot hold {n} tokens")
    past = np.arange(past_len, dtype=np.int64) if past_positions is None else np.asarray(past_positions, np.int64)
    if past.size != past_len:
        raise ValueError(f"past_positions has {past.size} entries for a past of {past_len} rows")
    if start is None:
        start = int(past.max()) + 1 if past.size and past.max() >= 0 else 0
    row = n - 1 if select_row is None else int(select_row)
    if not 0 <= row < chunk:
        raise ValueError(f"select_row {row} is outside the chunk of {chunk} rows")
    padded = np.zeros(chunk, np.int32)
    padded[:n] = tokens
    table_positions = start + np.arange(chunk, dtype=np.int64)
    positions = np.where(np.arange(chunk) < n, table_positions, -1)
    select = np.zeros(chunk, DTYPE)
    select[row] = 1
    tables = {t: rope_tables(table_positions, cfg.head_dim, cfg.rope_base(t), cfg.rope_scaling(t))
              for t in cfg.types_in_use}
    return ChunkInputs(padded, positions, tables, chunk_masks(cfg, past, positions), select, n, table_positions)


def empty_cache(cfg: GemmaConfig) -> tuple[list[np.ndarray], list[np.ndarray]]:
    empty = np.zeros((cfg.kv_heads, 0, cfg.head_dim), DTYPE)
    return [empty] * cfg.layers, [empty] * cfg.layers


# --- the four graphs ---------------------------------------------------------------------------------


def prefill_with_past(w: dict, cfg: GemmaConfig, tokens_C, tables, past_k, past_v, masks, select_onehot,
                      attention: AttentionFn = attention):
    """A chunk of C rows against a past of P rows: (logits [vocab] of the selected row, K list, V list
    each [kv_heads, P + C, head_dim]). Position-agnostic: positions live in `tables` and `masks`."""
    x = embed(w, cfg, tokens_C)
    ks, vs = [], []
    for i, t in enumerate(cfg.layer_types):
        cos, sin = tables[t]
        x, k, v = decoder_layer(w, cfg, i, x, cos, sin, past_k[i], past_v[i], masks[t], attention)
        ks.append(k)
        vs.append(v)
    row = np.asarray(select_onehot, DTYPE) @ x
    return lm_head(w, cfg, row), ks, vs


def decode_with_past(w: dict, cfg: GemmaConfig, token: int, position: int, past_k, past_v,
                     past_positions=None, attention: AttentionFn = attention):
    """One token at `position` against the cache (rows at past_positions, default 0..P-1)."""
    inp = chunk_inputs(cfg, [token], past_k[0].shape[1], 1, past_positions, start=position)
    return prefill_with_past(w, cfg, inp.tokens, inp.tables, past_k, past_v, inp.masks, inp.select, attention)


def prefill_at(w: dict, cfg: GemmaConfig, tokens, select, attention: AttentionFn = attention):
    """Positions 0..N-1 in one call: the selected row's logits and K/V [kv_heads, N, head_dim].
    `select` is a row index or a one-hot [N] vector."""
    tokens = np.asarray(tokens).reshape(-1)
    onehot = np.asarray(select, DTYPE)
    if onehot.ndim == 0:
        onehot = np.eye(tokens.size, dtype=DTYPE)[int(select)]
    inp = chunk_inputs(cfg, tokens, 0, tokens.size)
    past_k, past_v = empty_cache(cfg)
    return prefill_with_past(w, cfg, inp.tokens, inp.tables, past_k, past_v, inp.masks, onehot, attention)


def redecode(w: dict, cfg: GemmaConfig, tokens, position: int, attention: AttentionFn = attention) -> np.ndarray:
    """The reference: logits at `position` from the whole sequence run from scratch. Rows after
    `position` cannot influence it (causality), so they are not computed. Tables and masks are built
    here by direct index comparison, independently of the host-side builders."""
    return lm_head(w, cfg, _redecode_rows(w, cfg, tokens, position, attention)[position])


def redecode_at(w: dict, cfg: GemmaConfig, tokens, positions, attention: AttentionFn = attention) -> np.ndarray:
    """redecode's logits at several positions [len(positions), vocab], from one run of the sequence up to
    the last of them (each row as redecode computes it, but for the rounding of a matmul over more rows)."""
    positions = [int(p) for p in positions]
    rows = _redecode_rows(w, cfg, tokens, max(positions), attention)
    return np.stack([lm_head(w, cfg, rows[p]) for p in positions])


def _redecode_rows(w: dict, cfg: GemmaConfig, tokens, position: int, attention: AttentionFn) -> np.ndarray:
    """The final layer's output rows 0..position of the sequence run from scratch."""
    tokens = np.asarray(tokens).reshape(-1)[: position + 1]
    pos = np.arange(tokens.size)
    query, key = pos[:, None], pos[None, :]
    visible = {"global": key <= query, "local": (key <= query) & (query - key < cfg.window)}
    x = embed(w, cfg, tokens)
    past_k, past_v = empty_cache(cfg)
    for i, t in enumerate(cfg.layer_types):
        base, scaling = (cfg.rope_local, 1.0) if t == "local" else (cfg.rope_global, cfg.rope_scaling_global)
        cos, sin = rope_tables(pos, cfg.head_dim, base, scaling)
        mask = np.broadcast_to(np.where(visible[t], 0.0, MASKED).astype(DTYPE), (1, cfg.heads, *visible[t].shape))
        x, _, _ = decoder_layer(w, cfg, i, x, cos, sin, past_k[i], past_v[i], mask, attention)
    return x


def graph_flops(cfg: GemmaConfig, rows: int, past: int, logit_rows: int = 1) -> int:
    """Multiply-add FLOPs (2 per MAC) of one call on `rows` rows against `past` cached rows: the
    projections, attention scores and weighted sum over the past + rows keys, the MLP, and the LM
    head on `logit_rows` rows. Norms, RoPE and softmax are O(rows * width) and left out."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    per_layer = 2 * rows * cfg.hidden * (2 * q + 2 * kv) + 2 * rows * 3 * cfg.hidden * cfg.mlp
    per_layer += 2 * 2 * cfg.heads * rows * (past + rows) * cfg.head_dim
    return cfg.layers * per_layer + 2 * logit_rows * cfg.hidden * cfg.vocab
