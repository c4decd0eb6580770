"""Gated DeltaNet in jax: the serial recurrence (lax.scan over tokens) and the chunkwise WY / UT form
(lax.scan over chunks), with refimpl.gdn's layout, semantics and argument order.

Arguments (contract order): q, k [n_seqs, T, H_k, d]; v [n_seqs, T, H_v, d]; g [n_seqs, T, H_v] (or
[.., d] for KDA); beta [n_seqs, T, H_v]; state [n_seqs, H_v, d, d] stored transposed (state[j, i] =
S[i, j]). Results: out [n_seqs, T, H_v, d] and the final state, same layout.
"""

from __future__ import annotations

import numpy as np

from refimpl import gdn as ref
from testbed.backends.iree.artifacts import Contract, Graph, TensorSpec

ARG_NAMES = ("q", "k", "v", "g", "beta", "state")
FORMS = ("serial", "chunkwise")


def _heads_first(q, k, v, g, beta, head_map):
    """Gather each value head's key head and move heads before tokens: [n_seqs, H_v, T, ...]."""
    import jax.numpy as jnp

    h_v = v.shape[2]
    heads = ref.key_heads(q.shape[2], h_v, head_map)
    qh, kh = jnp.moveaxis(q[:, :, heads], 1, 2), jnp.moveaxis(k[:, :, heads], 1, 2)
    return qh, kh, jnp.moveaxis(v, 1, 2), jnp.moveaxis(g, 1, 2), jnp.moveaxis(beta, 1, 2)


def serial(q, k, v, g, beta, state, head_map="tiled"):
    """One token per scan step, on the transposed state m[j, i] = S[i, j] as refimpl keeps it."""
    import jax
    import jax.numpy as jnp

    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d)
    qh, kh, vh, gh, bh = _heads_first(q, k, v, g, beta, head_map)
    kda = g.ndim == 4

    def step(m, xs):
        q_t, k_t, v_t, g_t, b_t = xs                                  # [n_seqs, H_v, ...]
        m = m * (jnp.exp(g_t)[:, :, None, :] if kda else jnp.exp(g_t)[:, :, None, None])
        s_k = jnp.einsum("shji,shi->shj", m, k_t)                     # S^T k
        delta = (v_t - s_k) * b_t[..., None]
        m = m + delta[..., :, None] * k_t[..., None, :]               # S += k delta^T
        return m, scale * jnp.einsum("shji,shi->shj", m, q_t)         # S^T q

    tokens_first = [jnp.moveaxis(x, 2, 0) for x in (qh, kh, vh, gh, bh)]
    final, out = jax.lax.scan(step, state, tokens_first)
    return jnp.moveaxis(out, 0, 1), final                             # out [n_seqs, T, H_v, d]


def _chunk_step(s, q, k, v, g, beta, scale):
    """refimpl.gdn._chunk_step in jax: one chunk of L tokens for all (sequence, head) pairs, S [.., d_k, d_v]."""
    import jax
    import jax.numpy as jnp

    L = q.shape[-2]
    kda = g.ndim == q.ndim
    G = jnp.cumsum(g, axis=-2 if kda else -1)
    lower = np.tril(np.ones((L, L), bool))
    strict = np.tril(np.ones((L, L), bool), -1)
    if kda:
        diff = G[..., :, None, :] - G[..., None, :, :]
        decay_ij = jnp.exp(jnp.where(lower[..., None], diff, -jnp.inf))
        kk = jnp.einsum("...ic,...ijc,...jc->...ij", k, decay_ij, k)
        qk = jnp.einsum("...ic,...ijc,...jc->...ij", q, decay_ij, k)
        q_in, k_in = q * jnp.exp(G), k * jnp.exp(G)
        k_out = k * jnp.exp(G[..., -1:, :] - G)
        state_decay = jnp.exp(G[..., -1, :])[..., :, None]
    else:
        decay_ij = jnp.exp(jnp.where(lower, G[..., :, None] - G[..., None, :], -jnp.inf))
        kk = jnp.einsum("...ic,...jc->...ij", k, k) * decay_ij
        qk = jnp.einsum("...ic,...jc->...ij", q, k) * decay_ij
        q_in, k_in = q * jnp.exp(G)[..., None], k * jnp.exp(G)[..., None]
        k_out = k * jnp.exp(G[..., -1:] - G)[..., None]
        state_decay = jnp.exp(G[..., -1])[..., None, None]
    b = beta[..., None]
    a = jnp.where(strict, b * kk, 0.0)
    eye = jnp.eye(L, dtype=q.dtype)

    # (I + A)^-1 by forward substitution, a row per loop step. Row i of A is zero from column i on,
    # and rows >= i of t_inv are still zero, so the full-row product equals refimpl's a[i, :i] term.
    def row(i, t_inv):
        a_i = jax.lax.dynamic_index_in_dim(a, i, axis=-2, keepdims=False)
        new = eye[i] - jnp.einsum("...j,...jc->...c", a_i, t_inv)
        return jax.lax.dynamic_update_index_in_dim(t_inv, new, i, axis=-2)

    t_inv = jax.lax.fori_loop(0, L, row, jnp.zeros_like(a))
    u = t_inv @ (b * v)
    w = t_inv @ (b * k_in)
    v_new = u - w @ s
    out = q_in @ s + jnp.where(lower, qk, 0.0) @ v_new
    s_next = state_decay * s + jnp.swapaxes(k_out, -1, -2) @ v_new
    return scale * out, s_next


def chunkwise(q, k, v, g, beta, state, chunk=64, head_map="tiled"):
    """Full chunks through one lax.scan body, then the shorter last chunk if T is not a multiple."""
    import jax
    import jax.numpy as jnp

    d = q.shape[-1]
    t_len = q.shape[1]
    scale = 1.0 / np.sqrt(d)
    xs = _heads_first(q, k, v, g, beta, head_map)                     # [n_seqs, H_v, T, ...]
    s = jnp.swapaxes(state, -1, -2)
    n_full = t_len // chunk
    outs = []
    if n_full:
        def split(x):  # [n, H, T, ...] -> [chunks, n, H, chunk, ...]
            x = x[:, :, : n_full * chunk]
            x = x.reshape(x.shape[:2] + (n_full, chunk) + x.shape[3:])
            return jnp.moveaxis(x, 2, 0)

        def body(s, c):
            out, s = _chunk_step(s, *c, scale)
            return s, out

        s, out = jax.lax.scan(body, s, [split(x) for x in xs])
        out = jnp.moveaxis(out, 0, 2)                                 # [n, H, chunks, chunk, d]
        outs.append(out.reshape(out.shape[:2] + (n_full * chunk, d)))
    if t_len % chunk:
        out, s = _chunk_step(s, *(x[:, :, n_full * chunk:] for x in xs), scale)
        outs.append(out)
    out = jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]
    return jnp.moveaxis(out, 2, 1), jnp.swapaxes(s, -1, -2)


def graph(form: str, x: ref.GDNInputs, chunk: int = 64, head_map: str = "tiled") -> Graph:
    """The IREE graph for one form at the shapes of `x` (no weights: everything is an argument)."""
    if form not in FORMS:
        raise ValueError(f"GDN form {form!r} is not one of {FORMS}")
    args = tuple(TensorSpec.like(n, a) for n, a in zip(ARG_NAMES, x.arrays()))
    n_seqs, t_len, _, d = x.q.shape
    h_v = x.v.shape[2]
    results = (TensorSpec("out", (n_seqs, t_len, h_v, d), args[0].dtype),
               TensorSpec("state", (n_seqs, h_v, d, d), args[0].dtype))
    shape = f"n{n_seqs}t{t_len}hk{x.q.shape[2]}hv{h_v}d{d}{'kda' if x.kda else ''}"
    if form == "serial":
        fn = lambda w, *a: serial(*a, head_map=head_map)  # noqa: E731
        name = f"gdn_serial_{head_map}_{shape}"
    else:
        fn = lambda w, *a: chunkwise(*a, chunk=chunk, head_map=head_map)  # noqa: E731
        name = f"gdn_chunkwise{chunk}_{head_map}_{shape}"
    return Graph(name, fn, Contract(f"gdn_{form}", args, results))
