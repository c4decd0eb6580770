"""The native kernels on the host (the library `pip install` builds) against refimpl.

GDN serial and chunkwise over llama.cpp's 36 GATED_DELTA_NET cases and the awkward lengths, both
head maps, several chunk sizes, by NMSE <= 1e-7 against the float64 serial recurrence; attention
against refimpl.gemma.attention; the sliding-cache operations byte-identical over refimpl's grid.
"""

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.native_support import GDN_CASES, reference64
from refimpl import gdn as ref, gemma
from testbed.backends.native import build as kernel_build, library as native
from testbed.oracles.numerical import check_bitexact, check_nmse
from testbed.oracles.tail import check_padded_rollback, grid


def test_library_says_what_it_was_built_from():
    info = native.build_info()
    assert info["kernels_source_hash"] == kernel_build.source_hash()
    assert info["vector_path"] in ("sse2", "avx2-fma", "avx2", "neon-fma", "neon", "scalar")
    assert info["gemm_isa"] in ("avx512-fma", "avx2-fma", "neon-fma", "neon", "portable", "portable-fma")


def test_stale_library_names_the_rebuild(monkeypatch):
    monkeypatch.setattr(kernel_build, "source_hash", lambda *a: "f" * 64)
    native.library.cache_clear()
    try:
        with pytest.raises(native.NativeLibraryError, match=r"stale.*pip install -e \."):
            native.library()
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


def test_missing_library_names_the_rebuild(monkeypatch):
    monkeypatch.setattr(native, "library_path", lambda *a: None)
    native.library.cache_clear()
    try:
        with pytest.raises(native.NativeLibraryError, match=r"not built.*pip install -e \."):
            native.library()
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


# --- one library per x86-64 level (issue 24: a wheel built on an AVX-512 machine died with SIGILL on an
# older host). Each variant holds no instruction above its level, the loader never takes a variant the
# CPU lacks, and every variant computes the reference's numbers. -----------------------------------------

X86 = pytest.mark.skipif(len(kernel_build.library_variants()) == 1, reason="one library variant off x86-64")
# registers no instruction below the level names: AVX-512 is the only user of zmm and k, AVX the only of ymm
ABOVE = {"": re.compile(r"%[yz]mm\d|%k[1-7]\b"), "_avx2": re.compile(r"%zmm\d|%k[1-7]\b"), "_avx512": None}
GEMM_KERNEL = {"": "portable", "_avx2": "avx2-fma", "_avx512": "avx512-fma"}


def variant_path(variant) -> Path:
    path = native.library_path(set(variant.needs))
    assert path is not None and path.name.startswith(kernel_build.LIBRARY_NAME + variant.suffix + "."), path
    return path


@X86
@pytest.mark.parametrize("variant", kernel_build.library_variants(), ids=lambda v: v.suffix or "baseline")
def test_each_library_variant_holds_no_instruction_above_its_level(variant):
    above = ABOVE[variant.suffix]
    if above is None:
        pytest.skip("the top level may use everything")
    disassembly = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(variant_path(variant))],
                                 capture_output=True, text=True, check=True).stdout
    found = [line.strip() for line in disassembly.splitlines() if above.search(line)]
    assert not found, f"{len(found)} instructions above the level, e.g. {found[:3]}"


@X86
def test_the_loader_takes_the_best_variant_the_cpu_has():
    names = {frozenset(f): native.library_path(set(f)).name for f in
             [(), ("avx2",), ("avx2", "fma"), ("avx2", "fma", "f16c"), ("avx2", "fma", "f16c", "avx512f"),
              ("avx512f",)]}
    assert names[frozenset()].startswith("_tb_kernels.") and names[frozenset({"avx2"})] == names[frozenset()]
    assert names[frozenset({"avx512f"})] == names[frozenset()]  # AVX-512 alone: the AVX-512 build needs FMA too
    assert names[frozenset({"avx2", "fma"})] == names[frozenset()]  # and F16C (x86-64-v3)
    assert names[frozenset({"avx2", "fma", "f16c"})].startswith("_tb_kernels_avx2.")
    assert names[frozenset({"avx2", "fma", "f16c", "avx512f"})].startswith("_tb_kernels_avx512.")


@X86
@pytest.mark.parametrize("variant", kernel_build.library_variants(), ids=lambda v: v.suffix or "baseline")
def test_every_variant_the_cpu_runs_matches_the_reference(variant):
    if not variant.needs <= kernel_build.cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(variant.needs - kernel_build.cpu_flags())}")
    lib = native.load_library(variant_path(variant))
    x = GDN_CASES[0].inputs(seed=5)
    out, state = native.gdn_chunkwise(*x.arrays(), chunk=16, lib=lib)
    verdict = check_nmse(reference64(x, "tiled"), {"out": out, "state": state})
    assert verdict.passed, f"{variant.suffix or 'baseline'} ({lib.tb_vector_path().decode()}): {verdict.detail}"
    # its matrix products on the widest micro-kernel of its level (the variant is the dispatch)
    assert lib.tb_gemm_isa().decode() == GEMM_KERNEL[variant.suffix]


@pytest.mark.quick
@pytest.mark.parametrize("head_map", ["tiled", "interleaved"])
@pytest.mark.parametrize("case", GDN_CASES, ids=lambda c: c.name)
def test_gdn_matches_the_reference(case, head_map):
    x = case.inputs(seed=3)
    want = reference64(x, head_map)
    forms = {"serial": native.gdn_serial(*x.arrays(), head_map=head_map)}
    for chunk in (64, 16, 7):
        forms[f"chunkwise/{chunk}"] = native.gdn_chunkwise(*x.arrays(), chunk=chunk, head_map=head_map)
    for form, (out, state) in forms.items():
        v = check_nmse(want, {"out": out, "state": state})
        assert v.passed, f"{form}: {v.detail}"


def test_threads_split_heads_without_changing_a_bit():
    x = ref.draw_inputs(2, 130, 4, 32, v_repeat=2, kda=True, gate="mild", seed=5)
    for fn in (native.gdn_serial, native.gdn_chunkwise):
        one = dict(zip(("out", "state"), fn(*x.arrays(), threads=1)))
        three = dict(zip(("out", "state"), fn(*x.arrays(), threads=3)))
        assert check_bitexact(one, three).passed


def test_gdn_rejects_shapes_that_do_not_agree():
    x = ref.draw_inputs(1, 8, 2, 16, seed=0)
    with pytest.raises(ValueError, match="beta has shape"):
        native.gdn_chunkwise(x.q, x.k, x.v, x.g, x.beta[:, :4], x.state)
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        native.gdn_chunkwise(*x.arrays(), chunk=0)


# --- attention ---------------------------------------------------------------------------------------

ATTENTION_CASES = [
    # heads, kv_heads, head_dim, past, chunk rows C, real rows, layer type
    (4, 1, 256, 800, 1, 1, "global"),      # decode step
    (4, 1, 256, 800, 64, 52, "local"),     # the seed's chunk: 52 real rows padded to 64, window 512
    (8, 2, 64, 37, 32, 32, "global"),      # grouped KV heads, short past
    (2, 2, 24, 0, 5, 5, "global"),         # no past, head_dim not a multiple of 8
]


def attention_inputs(heads, kv_heads, hd, past, c, real, layer_type, seed=0, head_bias=False):
    """Inputs of one attention call, the mask from refimpl.gemma; head_bias adds a different finite
    bias per head and key (as ALiBi would), so that a mix-up of heads changes the result."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((heads, c, hd)).astype(np.float32)
    k = rng.standard_normal((kv_heads, past + c, hd)).astype(np.float32)
    v = rng.standard_normal((kv_heads, past + c, hd)).astype(np.float32)
    chunk_positions = np.r_[np.arange(past, past + real), np.full(c - real, -1)]
    mask = gemma.attention_mask(chunk_positions, np.r_[np.arange(past), chunk_positions], 512, heads, layer_type)
    if head_bias:
        mask = (mask + rng.uniform(-3.0, 0.0, (1, heads, 1, past + c))).astype(np.float32)
    return q, k, v, mask, 1.0 / np.sqrt(hd)


@pytest.mark.parametrize("head_bias", [False, True])
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_attention_matches_the_gemma_reference(case, head_bias):
    q, k, v, mask, scale = attention_inputs(*case, head_bias=head_bias)
    want = gemma.attention(*(a.astype(np.float64) for a in (q, k, v, mask)), scale)
    v_ = check_nmse({"out": want}, {"out": native.attention(q, k, v, mask, scale)})
    assert v_.passed, v_.detail


@pytest.mark.quick
def test_decode_steps_against_a_larger_cache_equal_the_chunk_rows():
    q, k, v, mask, scale = attention_inputs(4, 2, 64, 100, 16, 16, "global", seed=1)
    chunk = native.attention(q, k, v, mask, scale)
    past = 100
    steps = np.concatenate([native.attention(q[:, c:c + 1], k, v, mask[:, :, c:c + 1, :past + c + 1], scale,
                                             length=past + c + 1) for c in range(16)], axis=1)
    assert check_nmse({"out": chunk}, {"out": steps}).passed


# --- sliding cache -----------------------------------------------------------------------------------


@pytest.mark.quick
def test_cache_ops_are_byte_identical_over_the_grid():
    ops = native.sliding_cache_ops()
    failed = [(c.name, v.detail) for c in grid() for v in [check_padded_rollback(c, ops)] if not v.passed]
    assert failed == []


def test_cache_snapshot_refuses_a_padded_append_beyond_the_tail():
    cache = native.SlidingCache(np.zeros((1, 16, 4), np.uint8), count=16, sink=4)
    with pytest.raises(ValueError, match="shape rejected"):
        cache.snapshot(n_real=8, n_pad=5)  # 13 > window - sink = 12
