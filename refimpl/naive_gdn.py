"""A second, deliberately naive GDN: explicit loops over sequences, heads and tokens, with the state
S[i, j] (keys x values) as the math writes it, not transposed, and its own head map. It shares no
code with refimpl.gdn, which it checks: in the tests, and in `testbed run gdn` as the naive-float64
oracle (called with float64 inputs, it computes in float64). Its `bug` switch plants the realistic
mistakes the tests show the oracles catch."""

import numpy as np

BUGS = (
    None,
    "gate_wrong_axis",  # KDA decay applied over the value axis j instead of the key axis i
    "decay_after_update",  # S += k delta^T first, then decay
    "output_before_update",  # o from the state before this token's update
    "dropped_beta",  # delta = v - S^T k
)


def naive_gdn(q, k, v, g, beta, state, head_map="tiled", bug=None):
    assert bug in BUGS
    n_seqs, t_len, h_k, d = q.shape
    h_v = v.shape[2]
    r = h_v // h_k
    out = np.zeros((n_seqs, t_len, h_v, d), q.dtype)
    final = np.zeros_like(state)
    for s in range(n_seqs):
        for h in range(h_v):
            hk = h % h_k if head_map == "tiled" else h // r
            S = state[s, h].T.copy()  # stored transposed: state[s, h, j, i] = S[i, j]
            for t in range(t_len):
                kt, qt, vt = k[s, t, hk], q[s, t, hk], v[s, t, h]
                gt = g[s, t, h]
                decay = np.exp(gt)
                if bug == "gate_wrong_axis":
                    decay_mat = np.ones_like(S) * decay[None, :] if np.ndim(gt) else np.full_like(S, decay)
                else:
                    decay_mat = np.ones_like(S) * (decay[:, None] if np.ndim(gt) else decay)
                if bug != "decay_after_update":
                    S = S * decay_mat
                before = S.copy()
                b = 1.0 if bug == "dropped_beta" else beta[s, t, h]
                delta = b * (vt - S.T @ kt)
                S = S + np.outer(kt, delta)
                if bug == "decay_after_update":
                    S = S * decay_mat
                src = before if bug == "output_before_update" else S
                out[s, t, h] = (src.T @ qt) / np.sqrt(d)
            final[s, h] = S.T
    return out, final
