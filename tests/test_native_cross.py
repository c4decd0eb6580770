"""The benchmark-and-dump programs built for arm32 and aarch64, run under qemu-user, against refimpl
and byte for byte against the same programs built for the host.

The builds disable FMA contraction (FUSED=0, -ffp-contract=off) and flush denormals, so the AVX2,
ARMv7 NEON and AArch64 NEON builds compute the same bits: every output is compared byte for byte
with the host build, and by NMSE <= 1e-7 with the float64 reference. Builds are cached by content
hash under .cache/kernels/. Timings from qemu are never used.
"""

import copy
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.native_support import GDN_CASES, reference64
from refimpl import gemma, sliding_cache as sc
from tests.test_native import attention_inputs
from testbed.backends.native import build as kernel_build, programs as native_programs
from testbed.oracles.numerical import check_bitexact, check_nmse
from testbed.oracles.tail import GROUP, HEAD_DIM, KV_HEADS, grid

ARM_TARGETS = ("arm32", "aarch64")
COMPILERS = {"arm32": "arm-linux-gnueabihf-gcc", "aarch64": "aarch64-linux-gnu-gcc", "host": "cc"}
GDN_FORMS = (("serial", 64), ("chunkwise", 16))  # chunk 16: several chunk boundaries in most cases


def _build(target, fused=False):
    missing = native_programs.emulator_missing(target)
    if missing is None and shutil.which(COMPILERS[target]) is None:
        missing = f"{COMPILERS[target]} is not installed"
    if missing:
        pytest.skip(missing)
    return kernel_build.build_programs(target, fused=fused)


class Programs(dict):
    """Each target's programs, built (or skipped, saying why) when a test first asks for them: a run of
    one target's tests builds that target's programs and the host's, never every target's."""

    def __missing__(self, target):
        self[target] = _build(target)
        return self[target]


@pytest.fixture(scope="session")
def programs():
    return Programs()


def run_gdn_matrix(programs_dir, target):
    """{(case, form): {"out", "state"}} for every case and form, two programs at a time."""
    jobs = [(case, form, chunk) for case in GDN_CASES for form, chunk in GDN_FORMS]

    def one(job):
        case, form, chunk = job
        out, state, _ = native_programs.gdn(programs_dir, target, case.inputs(seed=3), form, chunk)
        return (case, form), {"out": out, "state": state}

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(one, jobs))


@pytest.fixture(scope="session")
def host_gdn(programs):
    return run_gdn_matrix(programs["host"], "host")


@pytest.fixture(scope="session")
def references():
    return {case: reference64(case.inputs(seed=3), "tiled") for case in GDN_CASES}


def test_host_programs_match_the_reference(host_gdn, references):
    for (case, form), got in host_gdn.items():
        v = check_nmse(references[case], got)
        assert v.passed, f"{case.name} {form}: {v.detail}"


@pytest.mark.parametrize("target", ARM_TARGETS)
def test_gdn_under_qemu_is_bitexact_with_the_host_build(target, programs, host_gdn, references):
    runs = run_gdn_matrix(programs[target], target)
    for key, got in runs.items():
        case, form = key
        v = check_nmse(references[case], got)
        assert v.passed, f"{target} {case.name} {form}: {v.detail}"
        same = check_bitexact(host_gdn[key], got)
        assert same.passed, f"{target} {case.name} {form}: {same.detail}"


def test_fused_build_is_caught_by_the_bitexact_oracle(programs, host_gdn, references):
    # The planted bug: a build that lets multiply-adds fuse (the default for -O3 on FMA hardware
    # with clang, or FUSED=1 here). Still accurate, no longer the same bits as the other targets.
    fused = _build("host", fused=True)
    case = next(c for c in GDN_CASES if c.gate == "mild" and c.n_seq_tokens > 64)
    out, state, _ = native_programs.gdn(fused, "host", case.inputs(seed=3), "chunkwise", 16)
    assert check_nmse(references[case], {"out": out, "state": state}).passed
    assert not check_bitexact(host_gdn[(case, "chunkwise")], {"out": out, "state": state}).passed


@pytest.mark.parametrize("target", ARM_TARGETS)
def test_fused_arm_builds_are_judged_by_tolerance(target, host_gdn, references):
    """The FMA builds (aarch64 FMLA, arm32 VFPv4's VFMA.F32): GDN and attention within NMSE of float64,
    labelled fused, and no longer the unfused build's bits."""
    fused = _build(target, fused=True)
    assert kernel_build.build_info(fused / "tb_gdn_bench")["multiply_add"] == "fused"
    differs = False
    for case in [c for c in GDN_CASES if c.n_seq_tokens > 64][:3]:
        for form, chunk in GDN_FORMS:
            out, state, _ = native_programs.gdn(fused, target, case.inputs(seed=3), form, chunk)
            got = {"out": out, "state": state}
            v = check_nmse(references[case], got)
            assert v.passed, f"{target} fused {case.name} {form}: {v.detail}"
            differs |= not check_bitexact(host_gdn[(case, form)], got).passed
    assert differs
    q, k, v, mask, scale = attention_inputs(8, 2, 32, 90, 24, 20, "local")
    want = {"out": gemma.attention(*(a.astype(np.float64) for a in (q, k, v, mask)), scale)}
    out, timings = native_programs.attention(fused, target, q, k, v, mask, scale)
    assert check_nmse(want, {"out": out}).passed
    assert timings["gemm_isa"] == "neon-fma" and timings["vector_path"] == "neon-fma", timings


@pytest.mark.parametrize("case", [(4, 1, 64, 150, 1, 1, "global"), (8, 2, 32, 90, 24, 20, "local")], ids=str)
def test_attention_under_qemu(programs, case):
    q, k, v, mask, scale = attention_inputs(*case)
    want = {"out": gemma.attention(*(a.astype(np.float64) for a in (q, k, v, mask)), scale)}
    outs = {t: {"out": native_programs.attention(programs[t], t, q, k, v, mask, scale)[0]}
            for t in ("host", *ARM_TARGETS)}
    for t, got in outs.items():
        assert check_nmse(want, got).passed, t
        assert check_bitexact(outs["host"], got).passed, t


def _cache_case_arrays(case):
    """refimpl caches before and after the exact append, and the appended rows (real, then pads)."""
    rng = np.random.default_rng([7, case.prefix, case.real, case.window, case.sink])
    cache = sc.sliding_cache(KV_HEADS, HEAD_DIM, case.window, case.sink, "float32", GROUP)
    n = case.prefix + case.real + case.pads
    k = rng.standard_normal((KV_HEADS, n, HEAD_DIM)).astype(np.float32)
    positions = np.r_[np.arange(case.prefix + case.real), np.full(case.pads, sc.EMPTY)]
    for start in range(0, case.prefix, 5):
        stop = min(start + 5, case.prefix)
        sc.append(cache, k[:, start:stop], k[:, start:stop], positions[start:stop])
    before = copy.deepcopy(cache)
    real = slice(case.prefix, case.prefix + case.real)
    sc.append(cache, k[:, real], k[:, real], positions[real])
    new = slice(case.prefix, n)
    return before, cache, {"k": k[:, new], "positions": positions[new].astype(np.int64)}


@pytest.mark.parametrize("target", ("host", *ARM_TARGETS))
def test_cache_ops_under_qemu_are_byte_identical(programs, target):
    cases = [c for c in grid(windows=(16,), dtypes=("float32",))]
    for case in cases:
        before, exact, new = _cache_case_arrays(case)
        for name, empty in (("k", 0), ("positions", 0xFF)):
            as_rows = lambda a: (a[None] if name == "positions" else a).view(np.uint8).reshape(  # noqa: E731
                -1 if name != "positions" else 1, a.shape[-1 if name == "positions" else 1],
                8 if name == "positions" else HEAD_DIM * 4)
            cache_rows = as_rows(getattr(before.rows, name))
            new_rows = as_rows(new[name])
            outputs, _ = native_programs.cache_ops(programs[target], target, cache_rows, new_rows, before.length,
                                                   case.sink, case.pads, empty_byte=empty)
            want = {"cache": as_rows(getattr(exact.rows, name))}
            for result in ("exact", "rolled"):
                v = check_bitexact(want, {"cache": outputs[result]})
                assert v.passed, f"{target} {case.name} {name} {result}: {v.detail}"
