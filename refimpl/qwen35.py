"""A Qwen3.5-style hybrid decoder and its graphs: the ground truth for seed 002 at the model level.

The architecture is transformers' `Qwen3_5ForCausalLM` (text only). Layers are of two types, by
default three Gated DeltaNet ("linear") layers for each gated full-attention ("full") layer:

    x       = embed[tokens]
    h       = rmsnorm(x)                                      (1 + w) weights, as Gemma
    linear: qkv = h Wqkv ; qkv = silu(causal_conv(qkv))        depthwise, kernel K (4), over time
            q, k, v = split(qkv) ; q, k = l2norm(q), l2norm(k) q, k [H_k, d]; v [H_v, d]
            g    = -exp(A_log) * softplus(h Wa + dt_bias)      log-decay per value head
            beta = sigmoid(h Wb)
            o    = GDN(q, k, v, g, beta, S)                   value head h reads key head h // (H_v/H_k)
            o    = (rmsnorm(o) * w * silu(h Wz)) Wout          per value head, plain weight w
    full:   q | gate = h Wq (per head: d query then d gate) ; k = h Wk ; v = h Wv
            q, k = rope_partial(rmsnorm_head(q)), rope_partial(rmsnorm_head(k))  first 1/4 of d
            o    = (softmax(q K^T / sqrt(d) + mask) V * sigmoid(gate)) Wo
    x      += o
    x      += down(silu(gate(h)) * up(h))                     h = rmsnorm(x)
    logits  = rmsnorm(x) lm_head^T

The past a chunk continues from (HybridState) is, per layer: for a full layer its K/V rows (after
k-norm and RoPE, so a row never changes once written); for a linear layer the conv state (the last
K - 1 rows of the convolution's input: what the next rows' kernel reads) and the recurrent state S
(refimpl.gdn's transposed layout [H_v, d_v, d_k]). A prefill_with_past call may carry pad rows
after its n real rows. Pads leave the past untouched: a pad row has beta = 0 and g = 0, which on the
recurrent state is the identity (decay exp(0) = 1, delta * 0 = 0); the conv state is taken at the
last real row; pad rows attend only themselves and their K/V rows are not kept. So, unlike a sliding
KV cache, nothing has to be snapshotted and rolled back; and because the call selects which row's
logits it returns, the last real row's logits come out of the padded call itself.

`redecode` is the oracles' reference: every position from scratch, from a zero state, with its own
causal mask and RoPE positions built by direct comparison, not through the chunk graph's builders.

The GDN op is a parameter (GDNFn: refimpl.gdn's signature): the serial recurrence, the chunkwise
form, the native kernels, or a reduced-precision chunkwise form. Float32 throughout, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import numpy as np

from refimpl import gdn
from refimpl.gemma import MASKED, apply_rope, attention_mask, rms_norm, rope_tables
from refimpl.tail_prefill import batched_attention

LAYER_TYPES = ("linear", "full")
HF_LAYER_TYPES = {"linear_attention": "linear", "full_attention": "full"}
# Hugging Face repeats each key head over consecutive value heads (repeat_interleave).
HEAD_MAP = "interleaved"
DTYPE = np.float32

# (q, k, v, g, beta, state, head_map=...) -> (out, state), in refimpl.gdn's layout
GDNFn = Callable[..., tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class HybridConfig:
    vocab: int
    hidden: int
    layers: int
    mlp: int
    heads: int               # full attention
    kv_heads: int
    head_dim: int
    linear_k_heads: int      # GDN: H_k key (and query) heads, H_v value heads, head size d
    linear_v_heads: int
    linear_head_dim: int
    conv_kernel: int = 4
    layer_types: tuple[str, ...] | None = None  # default: layer i is full iff (i + 1) % 4 == 0
    rope_theta: float = 10_000.0
    rotary_fraction: float = 0.25               # RoPE rotates the first head_dim * fraction dims
    rms_eps: float = 1e-6
    tie_embeddings: bool = False

    def __post_init__(self):
        types = self.layer_types
        if types is None:
            types = tuple("full" if (i + 1) % 4 == 0 else "linear" for i in range(self.layers))
        types = tuple(types)
        if len(types) != self.layers:
            raise ValueError(f"layer_types has {len(types)} entries for {self.layers} layers")
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer type {bad[0]!r} is not one of {LAYER_TYPES}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.linear_v_heads % self.linear_k_heads:
            raise ValueError(f"linear_v_heads ({self.linear_v_heads}) must be a multiple of "
                             f"linear_k_heads ({self.linear_k_heads})")
        if not 0 < self.rotary_fraction <= 1:
            raise ValueError(f"rotary_fraction ({self.rotary_fraction}) must be in (0, 1]")
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(f"head_dim * rotary_fraction = {self.head_dim * self.rotary_fraction:g} must be a "
                             f"positive even number of dims")
        if self.conv_kernel < 1:
            raise ValueError(f"conv_kernel must be >= 1, got {self.conv_kernel}")
        object.__setattr__(self, "layer_types", types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_fraction)

    @property
    def key_dim(self) -> int:
        return self.linear_k_heads * self.linear_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_v_heads * self.linear_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


def tiny_config(**overrides) -> HybridConfig:
    """Four layers (three GDN, one full), grouped heads on both sides: each graph runs in
    milliseconds, and the head maps differ (H_v = 2 H_k)."""
    return HybridConfig(**{**dict(vocab=256, hidden=64, layers=4, mlp=128, heads=4, kv_heads=2, head_dim=32,
                                  linear_k_heads=2, linear_v_heads=4, linear_head_dim=16), **overrides})


def dense_config(cfg: HybridConfig) -> HybridConfig:
    """The same width and depth with every layer full attention: the dense model of the crossover."""
    return replace(cfg, layer_types=("full",) * cfg.layers)


def layer_params(cfg: HybridConfig, kind: str) -> int:
    """Weights of one layer of `kind` (linear | full), norms included."""
    mlp = 3 * cfg.hidden * cfg.mlp + 2 * cfg.hidden
    if kind == "linear":
        return mlp + cfg.hidden * (cfg.conv_dim + 2 * cfg.value_dim + 2 * cfg.linear_v_heads) \
            + cfg.conv_dim * cfg.conv_kernel + 2 * cfg.linear_v_heads + cfg.linear_head_dim
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return mlp + cfg.hidden * (3 * q + 2 * kv) + 2 * cfg.head_dim


def body_params(cfg: HybridConfig) -> int:
    """Weights of the decoder layers (embedding and LM head apart: the same for every model of the crossover)."""
    return sum(layer_params(cfg, t) for t in cfg.layer_types)


def dense_similar_config(cfg: HybridConfig) -> HybridConfig:
    """The comparison seed 002 makes: a dense model of similar size and speed class. Every layer full
    attention at the hybrid's width, with as many layers as bring its decoder weights closest to the
    hybrid's (a GDN layer holds about twice a full layer's attention weights, so the dense model is
    deeper): per token it reads and multiplies as many weights as the hybrid, and only its attention
    grows with the context."""
    per_layer = layer_params(cfg, "full")
    layers = max(1, round(body_params(cfg) / per_layer))
    return replace(cfg, layers=layers, layer_types=("full",) * layers)


def median_log_decay(w: dict, cfg: HybridConfig) -> float:
    """The median over GDN layers and value heads of g = -exp(A_log) softplus(dt_bias), the per-token
    log-decay at zero input (the gates' regime: near 0 the state carries, far below it forgets)."""
    g = [-np.exp(w[f"model.layers.{i}.linear_attn.A_log"].astype(np.float64))
         * np.logaddexp(0.0, w[f"model.layers.{i}.linear_attn.dt_bias"].astype(np.float64))
         for i, t in enumerate(cfg.layer_types) if t == "linear"]
    return float(np.median(np.concatenate(g))) if g else float("nan")


# --- weights ----------------------------------------------------------------------------------------


def weight_shapes(cfg: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor by its Hugging Face name ([out, in] for projections)."""
    shapes = {"model.embed_tokens.weight": (cfg.vocab, cfg.hidden)}
    for i, t in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        if t == "linear":
            a = p + "linear_attn."
            shapes.update({
                a + "in_proj_qkv.weight": (cfg.conv_dim, cfg.hidden),
                a + "in_proj_z.weight": (cfg.value_dim, cfg.hidden),
                a + "in_proj_b.weight": (cfg.linear_v_heads, cfg.hidden),
                a + "in_proj_a.weight": (cfg.linear_v_heads, cfg.hidden),
                a + "conv1d.weight": (cfg.conv_dim, 1, cfg.conv_kernel),
                a + "dt_bias": (cfg.linear_v_heads,),
                a + "A_log": (cfg.linear_v_heads,),
                a + "norm.weight": (cfg.linear_head_dim,),
                a + "out_proj.weight": (cfg.hidden, cfg.value_dim),
            })
        else:
            a = p + "self_attn."
            q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
            shapes.update({
                a + "q_proj.weight": (2 * q, cfg.hidden),  # query and output gate
                a + "k_proj.weight": (kv, cfg.hidden),
                a + "v_proj.weight": (kv, cfg.hidden),
                a + "o_proj.weight": (cfg.hidden, q),
                a + "q_norm.weight": (cfg.head_dim,),
                a + "k_norm.weight": (cfg.head_dim,),
            })
        shapes.update({
            p + "input_layernorm.weight": (cfg.hidden,),
            p + "post_attention_layernorm.weight": (cfg.hidden,),
            p + "mlp.gate_proj.weight": (cfg.mlp, cfg.hidden),
            p + "mlp.up_proj.weight": (cfg.mlp, cfg.hidden),
            p + "mlp.down_proj.weight": (cfg.hidden, cfg.mlp),
        })
    shapes["model.norm.weight"] = (cfg.hidden,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab, cfg.hidden)
    return shapes


DT_RANGE = (1e-3, 1e-1)  # Mamba2's dt_min, dt_max


def init_weights(cfg: HybridConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded synthetic weights with trained-like ranges: projections N(0, 1/fan_in) so activations
    stay O(1); norm weights near their identity. The gates as Mamba2 and the FLA library initialise
    them, the regime a trained model keeps: A = exp(A_log) in [1, 16], dt = softplus(dt_bias)
    log-uniform in [1e-3, 1e-1], and a small input-dependent part (in_proj_a at a tenth of the other
    projections' scale), so g = -A softplus(h Wa + dt_bias) has a median near -0.09 per token (decay
    exp(g) ~ 0.92, from 0.2 to 0.999): the state carries over tens of tokens, as in released
    checkpoints. (dt_bias ~ N(0, 1) with a full-scale in_proj_a gave a median near -11: a state that
    forgets almost everything every token, whose products underflow to denormals.)"""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("A_log"):
            w = np.log(rng.uniform(1.0, 16.0, shape))
        elif name.endswith("dt_bias"):
            dt = np.exp(rng.uniform(np.log(DT_RANGE[0]), np.log(DT_RANGE[1]), shape))
            w = dt + np.log(-np.expm1(-dt))  # softplus^-1(dt)
        elif name.endswith("in_proj_a.weight"):
            w = 0.1 * rng.standard_normal(shape) / math.sqrt(shape[1])
        elif name.endswith("linear_attn.norm.weight"):  # plain weight: identity is 1
            w = 1 + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:                            # (1 + w) offsets: identity is 0
            w = 0.1 * rng.standard_normal(shape)
        elif name.endswith("conv1d.weight"):
            w = rng.standard_normal(shape) / math.sqrt(cfg.conv_kernel)
        else:
            w = rng.standard_normal(shape) / math.sqrt(shape[1])
        weights[name] = w.astype(DTYPE)
    return weights


# --- building blocks ----------------------------------------------------------------------------------


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)) without overflow; torch's threshold (x > 20: x) gives the same float32 value."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(||x||^2 + eps) over the last axis: the FLA library's form, which transformers uses
    (refimpl.gdn.l2_normalize is ggml's x / max(||x||, eps); they differ by ~eps / ||x||^2)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + DTYPE(eps))


def gated_rms_norm(x: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The GDN output norm: RMSNorm over each value head with a plain weight, times silu(z)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + DTYPE(eps)) * w * silu(z)


def causal_conv(rows: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Depthwise causal convolution: rows [K - 1 + C, channels] (the conv state, then C input rows),
    weight [channels, K] -> [C, channels], out[t] = sum_j weight[:, j] * rows[t + j]."""
    kernel = weight.shape[1]
    c = rows.shape[0] - (kernel - 1)
    return sum(rows[j:j + c] * weight[:, j] for j in range(kernel)).astype(DTYPE)


def conv_state_after(rows: np.ndarray, n: int, kernel: int) -> np.ndarray:
    """The conv state after n real rows: of rows [K - 1 + C, channels] (the old state, then the
    call's rows), the last K - 1 up to the last real row, which the next call's kernel reads. Pad rows
    after them are never part of it."""
    return rows[n:n + kernel - 1]


def rope_partial(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """RoPE on the first cos.shape[-1] dims of x [heads, C, head_dim]; the rest pass unrotated."""
    r = cos.shape[-1]
    return np.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)


@dataclass
class HybridState:
    """The past after `length` tokens. Per layer a dict: {"k", "v"} [kv_heads, length, head_dim] for a
    full layer; {"conv" [K - 1, conv_dim], "recurrent" [H_v, d, d]} for a linear layer."""

    length: int
    layers: list[dict[str, np.ndarray]]

    def arrays(self) -> dict[str, np.ndarray]:
        """Every carried array by name ("3.k", "0.conv", ...): what the state oracle compares."""
        return {f"{i}.{name}": a for i, layer in enumerate(self.layers) for name, a in layer.items()}


def empty_state(cfg: HybridConfig) -> HybridState:
    layers = []
    for t in cfg.layer_types:
        if t == "full":
            empty = np.zeros((cfg.kv_heads, 0, cfg.head_dim), DTYPE)
            layers.append({"k": empty, "v": empty})
        else:
            d = cfg.linear_head_dim
            layers.append({"conv": np.zeros((cfg.conv_kernel - 1, cfg.conv_dim), DTYPE),
                           "recurrent": np.zeros((cfg.linear_v_heads, d, d), DTYPE)})
    return HybridState(0, layers)


def linear_attention(w: dict, cfg: HybridConfig, i: int, h: np.ndarray, past: dict, n: int,
                     gdn_fn: GDNFn) -> tuple[np.ndarray, dict]:
    """GDN layer i on rows h [C, hidden] of which the first n are real; returns (output rows, the
    layer's state after the n real rows)."""
    p = f"model.layers.{i}.linear_attn."
    c, d = h.shape[0], cfg.linear_head_dim
    rows = np.concatenate([past["conv"], h @ w[p + "in_proj_qkv.weight"].T])    # [K - 1 + C, conv_dim]
    qkv = silu(causal_conv(rows, w[p + "conv1d.weight"][:, 0, :]))
    q = l2norm(qkv[:, :cfg.key_dim].reshape(1, c, cfg.linear_k_heads, d))
    k = l2norm(qkv[:, cfg.key_dim:2 * cfg.key_dim].reshape(1, c, cfg.linear_k_heads, d))
    v = qkv[:, 2 * cfg.key_dim:].reshape(1, c, cfg.linear_v_heads, d)
    real = (np.arange(c) < n).astype(DTYPE)[:, None]                             # pads: beta = g = 0
    beta = sigmoid(h @ w[p + "in_proj_b.weight"].T) * real
    g = -np.exp(w[p + "A_log"]) * softplus(h @ w[p + "in_proj_a.weight"].T + w[p + "dt_bias"]) * real
    out, recurrent = gdn_fn(q, k, v, g[None].astype(DTYPE), beta[None].astype(DTYPE), past["recurrent"][None],
                            head_map=HEAD_MAP)
    z = (h @ w[p + "in_proj_z.weight"].T).reshape(c, cfg.linear_v_heads, d)
    o = gated_rms_norm(out[0], z, w[p + "norm.weight"], cfg.rms_eps).reshape(c, cfg.value_dim)
    state = {"conv": conv_state_after(rows, n, cfg.conv_kernel), "recurrent": recurrent[0]}
    return (o @ w[p + "out_proj.weight"].T).astype(DTYPE), state


def full_attention(w: dict, cfg: HybridConfig, i: int, h: np.ndarray, past: dict, n: int,
                   cos: np.ndarray, sin: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, dict]:
    """Gated attention layer i on rows h [C, hidden] against its K/V; keeps the n real rows' K/V."""
    p = f"model.layers.{i}.self_attn."
    c, hd = h.shape[0], cfg.head_dim
    q_gate = (h @ w[p + "q_proj.weight"].T).reshape(c, cfg.heads, 2 * hd)
    q, gate = q_gate[..., :hd], q_gate[..., hd:].reshape(c, cfg.heads * hd)
    q = rope_partial(rms_norm(q, w[p + "q_norm.weight"], cfg.rms_eps).transpose(1, 0, 2), cos, sin)
    k = (h @ w[p + "k_proj.weight"].T).reshape(c, cfg.kv_heads, hd)
    k = rope_partial(rms_norm(k, w[p + "k_norm.weight"], cfg.rms_eps).transpose(1, 0, 2), cos, sin)
    v = (h @ w[p + "v_proj.weight"].T).reshape(c, cfg.kv_heads, hd).transpose(1, 0, 2)
    k_all = np.concatenate([past["k"], k], axis=1).astype(DTYPE)
    v_all = np.concatenate([past["v"], v], axis=1).astype(DTYPE)
    o = batched_attention(q, k_all, v_all, mask, hd ** -0.5).transpose(1, 0, 2).reshape(c, -1)
    past_len = past["k"].shape[1]
    keep = past_len + n
    return ((o * sigmoid(gate)) @ w[p + "o_proj.weight"].T).astype(DTYPE), {"k": k_all[:, :keep], "v": v_all[:, :keep]}


def decoder_layers(w: dict, cfg: HybridConfig, x: np.ndarray, past: HybridState, n: int, cos, sin, mask,
                   gdn_fn: GDNFn) -> tuple[np.ndarray, list[dict]]:
    """Every layer on rows x [C, hidden]: the final hidden rows and the per-layer states."""
    states = []
    for i, t in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_eps)
        if t == "linear":
            o, state = linear_attention(w, cfg, i, h, past.layers[i], n, gdn_fn)
        else:
            o, state = full_attention(w, cfg, i, h, past.layers[i], n, cos, sin, mask)
        x = x + o
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_eps)
        m = silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        m = m @ w[p + "mlp.down_proj.weight"].T
        x = (x + m).astype(DTYPE)
        states.append(state)
    return x, states


def lm_head(w: dict, cfg: HybridConfig, rows: np.ndarray) -> np.ndarray:
    head = w["model.embed_tokens.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    return (rms_norm(rows, w["model.norm.weight"], cfg.rms_eps) @ head.T).astype(DTYPE)


# --- the graphs ---------------------------------------------------------------------------------------


def prefill_with_past(w: dict, cfg: HybridConfig, tokens, past: HybridState, gdn_fn: GDNFn,
                      n: int | None = None, select_row: int | None = None) -> tuple[np.ndarray, HybridState]:
    """A chunk of C = len(tokens) rows after `past`, the first n real (default all), the rest pads:
    (logits [vocab] of select_row, default the last real row; the state after the n real rows)."""
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    c = tokens.size
    n = c if n is None else int(n)
    if not 1 <= n <= c:
        raise ValueError(f"a chunk of {c} rows cannot hold n={n} real tokens; accepted: 1..{c}")
    row = n - 1 if select_row is None else int(select_row)
    if not 0 <= row < n:
        raise ValueError(f"select_row {row} is not a real row; accepted: 0..{n - 1}")
    table_positions = past.length + np.arange(c)
    positions = np.where(np.arange(c) < n, table_positions, -1)
    keys = np.concatenate([np.arange(past.length), positions])
    mask = attention_mask(positions, keys, 0, cfg.heads, "global")
    cos, sin = rope_tables(table_positions, cfg.rotary_dim, cfg.rope_theta)
    x = w["model.embed_tokens.weight"][tokens]
    x, states = decoder_layers(w, cfg, x, past, n, cos, sin, mask, gdn_fn)
    return lm_head(w, cfg, x[row]), HybridState(past.length + n, states)


def decode_with_past(w: dict, cfg: HybridConfig, token: int, past: HybridState,
                     gdn_fn: GDNFn) -> tuple[np.ndarray, HybridState]:
    """One token after `past`: the step graph, the chunk graph's computation on one row."""
    return prefill_with_past(w, cfg, [token], past, gdn_fn)


def redecode(w: dict, cfg: HybridConfig, tokens, gdn_fn: GDNFn = gdn.gdn_serial) -> tuple[np.ndarray, HybridState]:
    """The reference: every position of `tokens` from scratch (zero conv and recurrent states, an
    empty cache). Returns (logits [T, vocab] at every position, the state after the last token). The
    causal mask and RoPE positions are built here by direct comparison."""
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    pos = np.arange(tokens.size)
    causal = np.where(pos[None, :] <= pos[:, None], 0.0, MASKED).astype(DTYPE)
    mask = np.broadcast_to(causal, (1, cfg.heads, tokens.size, tokens.size))
    cos, sin = rope_tables(pos, cfg.rotary_dim, cfg.rope_theta)
    x = w["model.embed_tokens.weight"][tokens]
    x, states = decoder_layers(w, cfg, x, empty_state(cfg), tokens.size, cos, sin, mask, gdn_fn)
    return lm_head(w, cfg, x), HybridState(tokens.size, states)


# --- prefill in chunks, with an exact, padded or scalar tail ---------------------------------------------

TAIL_MODES = ("exact", "padded", "scalar")


def prefill(w: dict, cfg: HybridConfig, tokens, chunk: int, gdn_fn: GDNFn, tail: str = "exact",
            past: HybridState | None = None) -> tuple[np.ndarray, HybridState]:
    """Prefill `tokens` after `past` (default empty) in chunks of `chunk` rows; the remainder runs as

      exact   one call of exactly its length (a graph per tail length: what an eager runtime does)
      padded  one call of `chunk` rows, the pads leaving the state untouched (fixed-shape graphs)
      scalar  one step call per token

    Returns (logits of the last token, the state after all of them)."""
    if tail not in TAIL_MODES:
        raise ValueError(f"tail {tail!r} is not one of {TAIL_MODES}")
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    state = empty_state(cfg) if past is None else past
    full, rem = divmod(tokens.size, chunk)
    logits = None
    for b in range(full):
        logits, state = prefill_with_past(w, cfg, tokens[b * chunk:(b + 1) * chunk], state, gdn_fn)
    rest = tokens[full * chunk:]
    if rem and tail == "exact":
        logits, state = prefill_with_past(w, cfg, rest, state, gdn_fn)
    elif rem and tail == "padded":
        logits, state = prefill_with_past(w, cfg, np.concatenate([rest, np.zeros(chunk - rem, np.int64)]), state,
                                          gdn_fn, n=rem)
    elif rem:
        for token in rest:
            logits, state = decode_with_past(w, cfg, int(token), state, gdn_fn)
    return logits, state


def graph_flops(cfg: HybridConfig, rows: int, past: int, logit_rows: int = 1) -> int:
    """Multiply-add FLOPs (2 per MAC) of one call on `rows` rows after `past` positions: projections,
    the conv, the GDN recurrence (refimpl.gdn.gdn_flops, the same count for every form), attention
    over past + rows keys, the MLP and the LM head. Norms, gates and RoPE are O(rows * width), left out."""
    total = 2 * logit_rows * cfg.hidden * cfg.vocab
    for t in cfg.layer_types:
        total += 2 * rows * 3 * cfg.hidden * cfg.mlp
        if t == "linear":
            total += 2 * rows * cfg.hidden * (cfg.conv_dim + 2 * cfg.value_dim + 2 * cfg.linear_v_heads)
            total += 2 * rows * cfg.conv_dim * cfg.conv_kernel
            total += gdn.gdn_flops(1, rows, cfg.linear_v_heads, cfg.linear_head_dim)
        else:
            q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
            total += 2 * rows * cfg.hidden * (3 * q + 2 * kv)
            total += 2 * 2 * cfg.heads * rows * (past + rows) * cfg.head_dim
    return total


def prefill_flops(cfg: HybridConfig, tokens: int, chunk: int) -> int:
    """graph_flops summed over the chunks of a prefill of `tokens` from an empty past (exact tail)."""
    return sum(graph_flops(cfg, min(chunk, tokens - start), start) for start in range(0, tokens, chunk))


def gdn_form(form: str, chunk: int = 64) -> GDNFn:
    """refimpl's GDN op by name: serial | chunkwise (with its chunk size)."""
    if form == "serial":
        return gdn.gdn_serial
    if form == "chunkwise":
        return partial(gdn.gdn_chunkwise, chunk=chunk)
    raise ValueError(f"GDN form {form!r} is not one of ('serial', 'chunkwise')")
