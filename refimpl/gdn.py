"""Gated DeltaNet (GDN): the serial recurrence and its chunkwise (WY / UT) form.

Semantics and memory layout follow llama.cpp's GGML_OP_GATED_DELTA_NET, so that a record made from
`test-backend-ops` on a phone and one made here speak of the same computation.

Layout (numpy shapes are ggml's `ne` reversed, so the bytes are the same):

    q, k   [n_seqs, T, H_k, d]        ggml [d, H_k, T, n_seqs]
    v      [n_seqs, T, H_v, d]        ggml [d, H_v, T, n_seqs]
    g      [n_seqs, T, H_v]           log-decay, scalar gate per head (GDN)
           [n_seqs, T, H_v, d]        log-decay per key row (KDA)
    beta   [n_seqs, T, H_v]
    state  [n_seqs, H_v, d, d]        stored transposed: state[s, h, j, i] = S[i, j],
                                      i over keys (d_k), j over values (d_v)

Per token and value head h (its key head is `key_heads(H_k, H_v, head_map)[h]`):

    S     <- diag(exp(g)) S                    decay (g broadcast over i for a scalar gate)
    delta <- beta * (v - S^T k)                on the value axis
    S     <- S + k delta^T                     rank-1 update
    o     <- scale * S^T q                     from the updated state, scale = 1/sqrt(d)

q and k are L2-normalised by the caller (outside the op), as in llama.cpp. Functions compute in the
dtype of their inputs: float32 in float32, float64 in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

HEAD_MAPS = ("tiled", "interleaved")


def key_heads(h_k: int, h_v: int, head_map: str = "tiled") -> np.ndarray:
    """Index of the key head each value head reads, for grouped value heads (H_v = r * H_k).

    tiled:       h % H_k    (llama.cpp: value heads cycle over the key heads)
    interleaved: h // r     (Hugging Face: each key head serves r consecutive value heads)
    """
    if h_v % h_k:
        raise ValueError(f"value heads ({h_v}) must be a multiple of key heads ({h_k})")
    h = np.arange(h_v)
    if head_map == "tiled":
        return h % h_k
    if head_map == "interleaved":
        return h // (h_v // h_k)
    raise ValueError(f"head_map {head_map!r} is not one of {HEAD_MAPS}")


def l2_normalize(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """ggml_l2_norm over the last axis: x / max(||x||, eps)."""
    norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
    return x / np.maximum(norm, x.dtype.type(eps))


@dataclass
class GDNInputs:
    """One GATED_DELTA_NET call. `kda` is read off the gate's shape, as llama.cpp does."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray
    beta: np.ndarray
    state: np.ndarray

    @property
    def kda(self) -> bool:
        return self.g.ndim == 4

    @property
    def shape(self) -> dict:
        n_seqs, t, h_k, d = self.q.shape
        return {"n_seqs": n_seqs, "tokens": t, "h_k": h_k, "h_v": self.v.shape[2], "d": d, "kda": self.kda}

    def arrays(self) -> tuple:
        return self.q, self.k, self.v, self.g, self.beta, self.state


def _gather_key_heads(x: np.ndarray, h_v: int, head_map: str) -> np.ndarray:
    """[n_seqs, T, H_k, d] -> [n_seqs, T, H_v, d], the key head each value head reads."""
    return x[:, :, key_heads(x.shape[2], h_v, head_map), :]


def _decay_factor(g_t: np.ndarray) -> np.ndarray:
    """exp(g) shaped to multiply a transposed state [n_seqs, H_v, d_v, d_k] (decay over rows i)."""
    if g_t.ndim == 2:  # scalar gate per head
        return np.exp(g_t)[:, :, None, None]
    return np.exp(g_t)[:, :, None, :]  # KDA: one factor per key index i


def gdn_serial(q, k, v, g, beta, state=None, head_map: str = "tiled"):
    """The recurrence, one token at a time. Returns (out [n_seqs, T, H_v, d], final state)."""
    n_seqs, t_len, _, d = q.shape
    h_v = v.shape[2]
    dtype = q.dtype
    scale = dtype.type(1.0 / np.sqrt(d))
    qh, kh = _gather_key_heads(q, h_v, head_map), _gather_key_heads(k, h_v, head_map)
    m = np.zeros((n_seqs, h_v, d, d), dtype) if state is None else state.astype(dtype, copy=True)
    out = np.empty((n_seqs, t_len, h_v, d), dtype)
    for t in range(t_len):
        m *= _decay_factor(g[:, t])
        kt, qt = kh[:, t], qh[:, t]                                   # [n_seqs, H_v, d]
        s_k = np.einsum("shji,shi->shj", m, kt)                       # S^T k
        delta = (v[:, t] - s_k) * beta[:, t][..., None]
        m += delta[..., :, None] * kt[..., None, :]                   # S += k delta^T
        out[:, t] = scale * np.einsum("shji,shi->shj", m, qt)         # S^T q
    return out, m


def _fp16_acc32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b with fp16 inputs and float32 accumulation: a product of two fp16 numbers is exact in
    float32 (11 + 11 significant bits), so only the inputs' rounding and the f32 sum remain."""
    f16 = np.float16
    return a.astype(f16).astype(np.float32) @ b.astype(f16).astype(np.float32)


def _fp16_acc16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b with fp16 inputs and an fp16 accumulator rounded after every multiply-add."""
    a16, b16 = a.astype(np.float16), b.astype(np.float16)
    acc = np.zeros(a.shape[:-1] + b.shape[-1:], np.float16)
    for c in range(a.shape[-1]):
        acc = (acc.astype(np.float32) + a16[..., :, c:c + 1].astype(np.float32) * b16[..., c:c + 1, :]).astype(np.float16)
    return acc.astype(np.float32)


# The chunkwise form's matrix products, as a matrix unit computes them (an NPU's HMX takes fp16
# tiles). The forward substitution and the state stay float32, as on a vector unit.
PRECISIONS = {"f32": np.matmul, "fp16-acc32": _fp16_acc32, "fp16-acc16": _fp16_acc16}


def _chunk_step(s, q, k, v, g, beta, scale, matmul=np.matmul):
    """One chunk of L tokens for every (sequence, head) at once, with the state S = [.., d_k, d_v].

    The WY / UT form: within the chunk the delta rule's L rank-1 updates are replaced by a unit lower
    triangular solve (forward substitution) and L x d matrix products. Decays are taken as
    differences of cumulative log-gates inside the chunk, each exponentiated only where it is <= 0,
    so no exp(-G) is ever formed (log-gates of -20 per token would overflow float32).

    q, k, v: [.., L, d]; g: [.., L] or [.., L, d_k]; beta: [.., L]. Returns (out [.., L, d_v], S').
    """
    L = q.shape[-2]
    dtype = q.dtype
    kda = g.ndim == q.ndim
    G = np.cumsum(g, axis=-2 if kda else -1)                          # cumulative log-decay
    lower = np.tril(np.ones((L, L), bool))                            # i >= j
    strict = np.tril(np.ones((L, L), bool), -1)                       # i > j

    if kda:
        # Pairwise decay per key index: D[i, j, c] = exp(G_i[c] - G_j[c]) for i >= j.
        diff = G[..., :, None, :] - G[..., None, :, :]
        decay_ij = np.exp(np.where(lower[..., None], diff, -np.inf))
        kk = np.einsum("...ic,...ijc,...jc->...ij", k, decay_ij, k)
        qk = np.einsum("...ic,...ijc,...jc->...ij", q, decay_ij, k)
        decay_to_start = np.exp(G)                                    # [.., L, d_k]
        decay_to_end = np.exp(G[..., -1:, :] - G)                     # [.., L, d_k]
        q_in = q * decay_to_start
        k_in = k * decay_to_start
        k_out = k * decay_to_end
        state_decay = np.exp(G[..., -1, :])[..., :, None]             # [.., d_k, 1]
    else:
        diff = G[..., :, None] - G[..., None, :]
        decay_ij = np.exp(np.where(lower, diff, -np.inf))
        kk = matmul(k, np.swapaxes(k, -1, -2)) * decay_ij
        qk = matmul(q, np.swapaxes(k, -1, -2)) * decay_ij
        q_in = q * np.exp(G)[..., None]
        k_in = k * np.exp(G)[..., None]
        k_out = k * np.exp(G[..., -1:] - G)[..., None]
        state_decay = np.exp(G[..., -1])[..., None, None]

    b = beta[..., None]
    # T = (I + strictly_lower(beta_i k_i . k_j decay_ij))^-1, by forward substitution row by row.
    a = np.where(strict, b * kk, 0).astype(dtype)
    t_inv = np.zeros_like(a)
    eye = np.eye(L, dtype=dtype)
    for i in range(L):
        t_inv[..., i, :] = eye[i] - np.einsum("...j,...jc->...c", a[..., i, :i], t_inv[..., :i, :])
    u = matmul(t_inv, b * v)                                          # [.., L, d_v]
    w = matmul(t_inv, b * k_in)                                       # [.., L, d_k]
    v_new = u - matmul(w, s)                                          # the deltas given the state
    out = matmul(q_in, s) + matmul(np.where(lower, qk, 0).astype(dtype), v_new)
    s_next = state_decay * s + matmul(np.swapaxes(k_out, -1, -2), v_new)
    return scale * out, s_next


def gdn_chunkwise(q, k, v, g, beta, state=None, chunk: int = 64, head_map: str = "tiled", precision: str = "f32"):
    """Chunkwise form: ceil(T / chunk) steps; the last chunk may be shorter. Same returns as serial.
    `precision`: how the matrix products round (PRECISIONS; the KDA gate's k-k and q-k products stay f32)."""
    if chunk <= 0:
        raise ValueError(f"chunk must be a positive integer, got {chunk}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {tuple(PRECISIONS)}")
    n_seqs, t_len, _, d = q.shape
    h_v = v.shape[2]
    dtype = q.dtype
    scale = dtype.type(1.0 / np.sqrt(d))
    # Heads-first [n_seqs, H_v, T, d] so that each chunk is a batch of L x d matrices.
    qh = np.moveaxis(_gather_key_heads(q, h_v, head_map), 1, 2)
    kh = np.moveaxis(_gather_key_heads(k, h_v, head_map), 1, 2)
    vh = np.moveaxis(v, 1, 2)
    gh = np.moveaxis(g, 1, 2)
    bh = np.moveaxis(beta, 1, 2)
    s = np.zeros((n_seqs, h_v, d, d), dtype) if state is None else np.swapaxes(state, -1, -2).astype(dtype)
    out = np.empty((n_seqs, h_v, t_len, d), dtype)
    for c0 in range(0, t_len, chunk):
        c1 = min(c0 + chunk, t_len)
        out[:, :, c0:c1], s = _chunk_step(
            s, qh[:, :, c0:c1], kh[:, :, c0:c1], vh[:, :, c0:c1], gh[:, :, c0:c1], bh[:, :, c0:c1], scale,
            PRECISIONS[precision],
        )
    return np.ascontiguousarray(np.moveaxis(out, 2, 1)), np.ascontiguousarray(np.swapaxes(s, -1, -2))


def gdn_flops(n_seqs: int, tokens: int, h_v: int, d: int, kda: bool = False) -> int:
    """The FLOP count benchmark records state: the serial recurrence's work, the same for both forms.

    Per token and head: decay d^2 (d^2 more exp-free multiplies for KDA are the same count), S^T k
    2d^2, rank-1 update 2d^2, S^T q 2d^2, plus O(d) terms: 7 d^2 + 4 d. Both forms do the same useful
    work; the chunkwise form's extra triangular work is not counted, so GFLOP/s compare directly.
    """
    return n_seqs * tokens * h_v * (7 * d * d + 4 * d)


def gdn_chunkwise_flops(n_seqs: int, tokens: int, h_v: int, d: int, chunk: int, kda: bool = False) -> int:
    """The work the chunkwise (WY / UT) form really does, per chunk of L tokens and head, counting a
    multiply-add as 2 and only the triangles it needs (as _chunk_step computes them):

      k k^T (strict lower) and q k^T (lower, diagonal included)  2 L(L+1)/2 d        (KDA: x2, decay)
      forward substitution for (I + A)^-1                        2 sum_i i^2 ~ 2 L^3 / 3
      u = T (beta v), w = T (beta k)                             2 x 2 L(L+1)/2 d
      q S, w S, k^T v_new (the state products)                   3 x 2 L d^2
      the masked q k^T times v_new                               2 L(L+1)/2 d
      the state decay                                            d^2

    plus O(L d) elementwise terms. At L = 64, d = 128 this is about 1.2x gdn_flops' serial count:
    the price of turning rank-1 updates into matrix products."""
    total = 0
    for c0 in range(0, tokens, chunk):
        L = min(chunk, tokens - c0)
        tri = L * (L + 1) // 2
        pair = 2 * tri * d * (2 if kda else 1)
        total += 2 * pair + 2 * sum(i * i for i in range(L)) + 2 * 2 * tri * d + 3 * 2 * L * d * d \
            + 2 * tri * d + d * d + 8 * L * d
    return n_seqs * h_v * total


# --- inputs ----------------------------------------------------------------------------------------

GATE_DRAWS = {
    # test-backend-ops: g ~ U(-20, -1e-4). Decay per token is exp(g) ~ 5e-5 on average, so the state
    # forgets almost everything between tokens; faithful to the harness, weak at catching state bugs.
    "tbo": (-20.0, -1e-4),
    # Realistic trained gates (exp(g) in about 0.9 .. 1): the state carries across chunks, so bugs at
    # chunk boundaries and in the inter-chunk term are visible.
    "mild": (-0.1, -1e-4),
}


def draw_inputs(
    n_seqs: int,
    tokens: int,
    h_k: int,
    d: int,
    v_repeat: int = 1,
    kda: bool = False,
    gate: str = "tbo",
    seed: int = 0,
    dtype=np.float32,
) -> GDNInputs:
    """Random inputs drawn as llama.cpp's test-backend-ops draws them for GATED_DELTA_NET.

    test_gated_delta_net::initialize_tensors: g ~ U(-20, -1e-4), beta ~ U(0, 1), v ~ U(-0.3, 5),
    q, k and the initial state ~ U(-1, 1); its graph L2-normalises q and k (eps 1e-6) before the op.
    `gate="mild"` swaps the gate range for one where the state survives (see GATE_DRAWS).
    """
    if gate not in GATE_DRAWS:
        raise ValueError(f"gate draw {gate!r} is not one of {sorted(GATE_DRAWS)}")
    rng = np.random.default_rng(seed)
    h_v = h_k * v_repeat
    lo, hi = GATE_DRAWS[gate]
    u = lambda shape, a=-1.0, b=1.0: rng.uniform(a, b, shape).astype(dtype)  # noqa: E731
    q = l2_normalize(u((n_seqs, tokens, h_k, d)))
    k = l2_normalize(u((n_seqs, tokens, h_k, d)))
    v = u((n_seqs, tokens, h_v, d), -0.3, 5.0)
    g = u((n_seqs, tokens, h_v, d) if kda else (n_seqs, tokens, h_v), lo, hi)
    beta = u((n_seqs, tokens, h_v), 0.0, 1.0)
    state = u((n_seqs, h_v, d, d))
    return GDNInputs(q, k, v, g, beta, state)


def snapshots(fn: Callable, x: GDNInputs, K: int) -> np.ndarray:
    """llama.cpp's K snapshot slots: slot s holds the state after token T-1-s (slot 0 = final).
    Obtained by running `fn` on the prefixes, which works for any form."""
    t_len = x.q.shape[1]
    states = []
    for s in range(min(K, t_len)):
        n = t_len - s
        part = GDNInputs(x.q[:, :n], x.k[:, :n], x.v[:, :n], x.g[:, :n], x.beta[:, :n], x.state)
        states.append(fn(part)[1])
    return np.stack(states)


def run_forms(fn: Callable, x: GDNInputs, K: int) -> dict[str, np.ndarray]:
    """What every GDN comparison judges: `fn(x)`'s output and final state, and with K > 1 llama.cpp's K
    state snapshots."""
    out, state = fn(x)
    result = {"out": out, "state": state}
    if K > 1:
        result["snapshots"] = snapshots(fn, x, K)
    return result
