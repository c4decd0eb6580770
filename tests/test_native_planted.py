"""Planted bugs in the native kernels: each is a realistic one-line slip compiled into its own
library, and the oracle that guards the kernel must catch it (while the real kernel passes the
same checks in tests/test_native.py)."""

import numpy as np
import pytest

from tests.native_support import GDN_CASES, mutant_library, reference64
from refimpl import gemma
from tests.test_native import ATTENTION_CASES, attention_inputs
from testbed import native
from testbed.oracles import check_nmse
from testbed.tail_oracles import check_padded_rollback, grid


def gdn_failures(lib, chunk=16):
    failed = []
    for case in GDN_CASES:
        x = case.inputs(seed=3)
        out, state = native.gdn_chunkwise(*x.arrays(), chunk=chunk, lib=lib)
        if not check_nmse(reference64(x, "tiled"), {"out": out, "state": state}).passed:
            failed.append(case)
    return failed


def test_chunk_boundary_off_by_one_is_caught():
    # The state handed to the next chunk decays by the gates only up to the chunk's second-to-last
    # token (the final state is an output too, so a single chunk of two or more tokens shows it).
    lib = mutant_library("gdn.c", "const float last = exp1(w->G[L - 1]);",
                         "const float last = exp1(w->G[L > 1 ? L - 2 : 0]);")
    failed = gdn_failures(lib)
    assert failed and all(c.n_seq_tokens > 1 for c in failed)
    assert any(c.gate == "mild" and c.n_seq_tokens > 16 for c in failed)


def test_missing_gate_term_in_the_intra_chunk_product_is_caught():
    # q_i . k_j used without the decay exp(G_i - G_j) between the two tokens.
    lib = mutant_library("gdn.c", "for (int j = 0; j < i; j++) a[j] *= decay[j], qk[j] *= decay[j];",
                         "for (int j = 0; j < i; j++) a[j] *= decay[j];")
    assert gdn_failures(lib)


def test_wrong_kv_head_for_grouped_queries_is_caught():
    lib = mutant_library("attention.c", "const int kvh = h / (a->heads / a->kv_heads);",
                         "const int kvh = h % a->kv_heads;")
    grouped = [c for c in ATTENTION_CASES if c[1] > 1 and c[0] > c[1]]
    for case in grouped:
        q, k, v, mask, scale = attention_inputs(*case)
        want = gemma.attention(*(a.astype(np.float64) for a in (q, k, v, mask)), scale)
        assert not check_nmse({"out": want}, {"out": native.attention(q, k, v, mask, scale, lib=lib)}).passed


def test_rollback_that_reinserts_over_the_sinks_is_caught():
    # The saved rows go back at slot 0 instead of right after the sink rows.
    lib = mutant_library("sliding_cache.c", "memcpy(rows + (size_t)c->sink * rb, saved",
                         "memcpy(rows, saved")
    verdicts = [(c, check_padded_rollback(c, native.sliding_cache_ops(lib))) for c in grid()]
    caught = [c for c, v in verdicts if not v.passed]
    assert caught and all(c.sink > 0 for c in caught)
