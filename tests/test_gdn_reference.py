"""The GDN reference: serial recurrence, chunkwise form, head maps, against a naive second reference."""

import numpy as np
import pytest

from refimpl import gdn as ref
from refimpl.gdn import run_forms
from refimpl.naive_gdn import naive_gdn
from testbed.experiments.gdn import AWKWARD_CASES, TBO_CASES
from testbed.oracles.numerical import check_nmse, nmse


def f64(x):
    return ref.GDNInputs(*(a.astype(np.float64) for a in x.arrays()))


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("head_map", ref.HEAD_MAPS)
def test_serial_matches_naive_loops(kda, head_map):
    x = f64(ref.draw_inputs(2, 9, 2, 8, v_repeat=3, kda=kda, gate="mild", seed=3))
    out, state = ref.gdn_serial(*x.arrays(), head_map=head_map)
    n_out, n_state = naive_gdn(*x.arrays(), head_map=head_map)
    assert nmse(n_out, out) < 1e-26 and nmse(n_state, state) < 1e-26


def test_head_maps_differ_when_value_heads_are_grouped():
    """Both mappings are real choices: with grouped heads they give different outputs."""
    x = ref.draw_inputs(1, 4, 2, 8, v_repeat=2, gate="mild", seed=0)
    tiled, _ = ref.gdn_serial(*x.arrays(), head_map="tiled")
    inter, _ = ref.gdn_serial(*x.arrays(), head_map="interleaved")
    assert nmse(tiled, inter) > 1e-3
    assert list(ref.key_heads(2, 4, "tiled")) == [0, 1, 0, 1]
    assert list(ref.key_heads(2, 4, "interleaved")) == [0, 0, 1, 1]


@pytest.mark.parametrize("case", TBO_CASES + AWKWARD_CASES, ids=lambda c: c.name)
def test_chunkwise_matches_serial_over_the_matrix(case):
    """llama.cpp's 36 cases plus awkward lengths: float32 chunkwise vs float64 serial, NMSE <= 1e-7."""
    x = case.inputs(seed=0)
    reference = run_forms(lambda y: ref.gdn_serial(*y.arrays()), f64(x), case.K)
    candidate = run_forms(lambda y: ref.gdn_chunkwise(*y.arrays(), chunk=64), x, case.K)
    v = check_nmse(reference, candidate)
    assert v.passed, v.detail


@pytest.mark.parametrize("chunk", [1, 15, 16, 63, 64, 65, 300])
@pytest.mark.parametrize("kda", [False, True])
def test_chunk_size_does_not_change_the_result(chunk, kda):
    """In float64 every chunk size, including 1 and sizes larger than T, agrees to rounding."""
    x = f64(ref.draw_inputs(2, 130, 2, 16, v_repeat=2, kda=kda, gate="mild", seed=1))
    out, state = ref.gdn_serial(*x.arrays())
    c_out, c_state = ref.gdn_chunkwise(*x.arrays(), chunk=chunk)
    assert nmse(out, c_out) < 1e-24 and nmse(state, c_state) < 1e-24


def test_float32_stays_float32_and_survives_strong_gates():
    """tbo gates (log-decay down to -20 per token) must not overflow exp() inside a chunk."""
    x = ref.draw_inputs(1, 256, 4, 64, kda=True, gate="tbo", seed=2)
    out, state = ref.gdn_chunkwise(*x.arrays(), chunk=64)
    assert out.dtype == np.float32 and state.dtype == np.float32
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(state))


def test_bad_arguments_are_named():
    x = ref.draw_inputs(1, 4, 2, 8, v_repeat=2, seed=0)
    with pytest.raises(ValueError, match="chunk must be a positive integer, got 0"):
        ref.gdn_chunkwise(*x.arrays(), chunk=0)
    with pytest.raises(ValueError, match="head_map 'rows'"):
        ref.gdn_serial(*x.arrays(), head_map="rows")
    with pytest.raises(ValueError, match="multiple of key heads"):
        ref.key_heads(3, 4)


def test_our_shape_matrix_is_llama_cpps(seed_fixtures):
    """TBO_CASES lists exactly the cases the real test-backend-ops ran, in its order."""
    from testbed.backends.llamacpp import output as llamacpp_output

    report = llamacpp_output.parse_test((seed_fixtures / "test-backend-ops" / "test_mode_b_CPU.stdout").read_text())
    keys = ("head_count", "head_size", "n_seq_tokens", "n_seqs", "v_repeat", "permuted", "kda", "K")
    theirs = [tuple(int(c.param(k)) for k in keys) for c in report.cases]
    ours = [(c.head_count, c.head_size, c.n_seq_tokens, c.n_seqs, c.v_repeat, int(c.permuted), int(c.kda), c.K)
            for c in TBO_CASES]
    assert ours == theirs
