"""Planted bugs in the native kernels: each is a realistic one-line slip compiled into its own
library, and the oracle that guards the kernel must catch it (while the real kernel passes the
same checks in tests/test_native.py)."""

import pytest
import numpy as np

from tests.native_support import GDN_CASES, mutant_library, mutant_program, reference64
from refimpl import gemma
from tests.test_native import ATTENTION_CASES, attention_inputs
from testbed.backends.native import library as native
from testbed.cli import main
from testbed.experiments import native_bench
from testbed.oracles.numerical import check_nmse
from testbed.oracles.tail import check_padded_rollback, grid
from testbed.results import ResultsStore


def gdn_failures(lib, chunk=16):
    failed = []
    for case in GDN_CASES:
        x = case.inputs(seed=3)
        out, state = native.gdn_chunkwise(*x.arrays(), chunk=chunk, lib=lib)
        if not check_nmse(reference64(x, "tiled"), {"out": out, "state": state}).passed:
            failed.append(case)
    return failed


@pytest.mark.quick
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


def attention_failures(lib, cases):
    failed = []
    for case in cases:
        q, k, v, mask, scale = attention_inputs(*case, head_bias=True)
        want = gemma.attention(*(a.astype(np.float64) for a in (q, k, v, mask)), scale)
        if not check_nmse({"out": want}, {"out": native.attention(q, k, v, mask, scale, lib=lib)}).passed:
            failed.append(case)
    return failed


@pytest.mark.quick
def test_mask_rows_of_the_wrong_head_are_caught():
    # Each KV head's block of query rows reads the mask from row 0 instead of from its own rows.
    lib = mutant_library("attention.c", "a->mask + (size_t)(r0 + r) * a->l", "a->mask + (size_t)r * a->l")
    failed = attention_failures(lib, ATTENTION_CASES)
    assert failed and all(case[1] > 1 for case in failed)  # only visible with several KV heads


def test_cache_stride_of_the_filled_length_is_caught():
    # K of KV head h taken at h * L (the attended length) instead of h * kv_rows (the cache's rows).
    lib = mutant_library("attention.c", "const float *k = a->k + (size_t)kvh * a->kv_rows * a->hd",
                         "const float *k = a->k + (size_t)kvh * a->l * a->hd")
    q, k, v, mask, scale = attention_inputs(8, 2, 32, 50, 1, 1, "global")
    good = native.attention(q, k, v, mask, scale)
    roomy_k, roomy_v = (np.concatenate([x, np.zeros((2, 30, 32), np.float32)], axis=1) for x in (k, v))
    assert check_nmse({"out": good}, {"out": native.attention(q, roomy_k, roomy_v, mask, scale, length=51)}).passed
    bad = native.attention(q, roomy_k, roomy_v, mask, scale, length=51, lib=lib)
    assert not check_nmse({"out": good}, {"out": bad}).passed


def test_rollback_that_reinserts_over_the_sinks_is_caught():
    # The saved rows go back at slot 0 instead of right after the sink rows.
    lib = mutant_library("sliding_cache.c", "memcpy(rows + (size_t)c->sink * rb, saved",
                         "memcpy(rows, saved")
    verdicts = [(c, check_padded_rollback(c, native.sliding_cache_ops(lib))) for c in grid()]
    caught = [c for c, v in verdicts if not v.passed]
    assert caught and all(c.sink > 0 for c in caught)


def test_native_bench_catches_mask_rows_read_without_their_head_stride(results_dir, monkeypatch):
    """The blocked path reading each query row's mask as row r % C of one [C, L] mask, as a kernel
    written for a mask broadcast over heads does: every head gets head 0's mask. A causal mask is the
    same for every head and hides it; native_bench's mask differs per head (head_biased_mask)."""
    def mutant(target, fused=False):
        assert not fused
        return mutant_program(target, "attention.c", "const float *m = mask + (size_t)r * l + j0;",
                              "const float *m = mask + (size_t)(r % a->c) * l + j0;", "tb_attention_bench").parent

    monkeypatch.setattr(native_bench, "build_programs", mutant)
    run = ["run", "native_bench", "attention.past=40", "attention.chunk=8", "attention.head_dim=32",
           "cache.window=32", "cache.real=5", "bench.reps=1", "bench.warmup=0", "bench.cold_mb=1", "ratios.reps=0"]
    with monkeypatch.context() as same_for_every_head:
        same_for_every_head.setattr(native_bench, "head_biased_mask", lambda mask, queries, keys: mask)
        assert main(run) == 0, "with a causal mask alone the wrong stride goes unseen"
    assert main(run) == 1
    rows = ResultsStore(results_dir).records("native_bench")
    failed = [r for r in rows if r["run_id"] == rows[-1]["run_id"] and r["kind"] == "oracle" and r["verdict"] != "pass"]
    assert [r["params"]["form"] for r in failed] == ["chunk"]  # decode steps take the unblocked path
