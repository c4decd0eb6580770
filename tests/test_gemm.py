"""The matrix product every kernel uses (kernels/tb_gemm.h) and its run-time dispatch.

- Bits: in the unfused programs (FUSED=0) tb_gemm must give the bits of the plain reference loop
  (each element one chain over k in ascending order) at every shape, edge and flag, on the host and
  under qemu-user for arm32 and aarch64 (NEON micro-kernels), with each micro-kernel the host can run
  (TB_ISA forces one). Whatever the micro-kernel, the same bits: that is the cross-target promise.
- Dispatch: a library or program built on an AVX-512 machine runs correctly with the AVX-512
  micro-kernel switched off (TB_ISA=avx2, as on an AVX2-only CPU) or with the portable one
  (TB_ISA=scalar, as on an x86-64 without AVX2), and says which ran. (Which library variant a CPU
  loads, and that each holds no instruction above its level: tests/test_native.py.)
- Fused (FUSED=1) programs: judged by tolerance against float64, never by bits.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from refimpl import gemma
from testbed.backends.native import build as kernel_build, programs as native_programs
from tests.test_native import attention_inputs
from tests.test_native_cross import ARM_TARGETS, _build

X86 = os.uname().machine == "x86_64"
# M, N, K: tiles and their edges for 8 x 32, 6 x 16, 8 x 8, 4 x 8 micro-kernels, KC (256) and NC (1024) blocks,
# B read in place (up to 32 rows) or packed (more rows, or rows 4 KiB apart: N = 1024)
SHAPES = [(1, 1, 1), (3, 5, 7), (8, 32, 64), (9, 33, 257), (13, 70, 300), (64, 64, 128), (16, 1030, 40), (5, 17, 600),
          (30, 96, 50), (24, 1024, 20)]
FLAGS = [dict(trans=t, transa=ta, accumulate=a, lower=lo) for t in (False, True) for ta in (False, True)
         for a in (False, True) for lo in (False, True)]


def host_isas() -> list[str]:
    """The micro-kernels this host can run, strongest first ("scalar": the portable one)."""
    flags = kernel_build.cpu_flags() if X86 else set()
    return [isa for isa, need in (("avx512", {"avx512f"}), ("avx2", {"avx2", "fma"})) if need <= flags] + ["scalar"]


def operands(M, N, K, trans, lower, seed, transa=False):
    rng = np.random.default_rng([M, N, K, seed])
    a = rng.standard_normal((M, K)).astype(np.float32)
    if lower:
        a = np.tril(a).astype(np.float32)
    if transa:
        a = np.ascontiguousarray(a.T)
    b = rng.standard_normal((N, K) if trans else (K, N)).astype(np.float32)
    c = rng.standard_normal((M, N)).astype(np.float32)
    return a, b, c


@pytest.fixture(scope="module")
def host_programs():
    return kernel_build.build_programs("host")


@pytest.mark.parametrize("isa", host_isas())
def test_gemm_gives_the_reference_loops_bits_with_every_host_kernel(host_programs, isa):
    for shape in SHAPES:
        for flags in FLAGS:
            a, b, c = operands(*shape, flags["trans"], flags["lower"], 0, flags["transa"])
            loop, _ = native_programs.gemm(host_programs, "host", a, b, c, form="loop", **flags)
            got, timings = native_programs.gemm(host_programs, "host", a, b, c, env={"TB_ISA": isa}, **flags)
            assert timings["gemm_isa"] == {"scalar": "portable"}.get(isa, isa), timings["gemm_isa"]
            assert got.tobytes() == loop.tobytes(), f"{isa} {shape} {flags}"
            want = (c.astype(np.float64) if flags["accumulate"] else 0) + (a.T if flags["transa"] else a).astype(
                np.float64) @ (b.T if flags["trans"] else b).astype(np.float64)
            assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max()) * shape[2]


@pytest.mark.parametrize("target", ARM_TARGETS)
def test_gemm_under_qemu_gives_the_host_bits(target, host_programs):
    programs = _build(target)
    for isa in ("neon", "scalar"):
        for shape in SHAPES[:6]:
            for flags in FLAGS[::3]:
                a, b, c = operands(*shape, flags["trans"], flags["lower"], 1, flags["transa"])
                host, _ = native_programs.gemm(host_programs, "host", a, b, c, form="loop", **flags)
                got, timings = native_programs.gemm(programs, target, a, b, c, env={"TB_ISA": isa}, **flags)
                assert timings["gemm_isa"] == {"scalar": "portable"}.get(isa, isa)
                assert got.tobytes() == host.tobytes(), f"{target} {isa} {shape} {flags}"


@pytest.mark.skipif(not X86, reason="x86-64 dispatch")
@pytest.mark.parametrize("isa", host_isas()[1:])
def test_programs_built_here_give_the_same_bits_with_a_weaker_kernel(host_programs, isa):
    """What an AVX2-only CPU (or one without AVX2) computes from the same unfused programs: the same
    bytes, GDN chunkwise and chunk attention alike."""
    from refimpl import gdn as ref

    x = ref.draw_inputs(1, 150, 2, 64, kda=True, gate="mild", seed=4)
    best = native_programs.gdn(host_programs, "host", x, "chunkwise", 64)
    forced = native_programs.gdn(host_programs, "host", x, "chunkwise", 64, env={"TB_ISA": isa})
    assert forced[2]["gemm_isa"] == {"scalar": "portable"}.get(isa, isa)
    assert best[0].tobytes() == forced[0].tobytes() and best[1].tobytes() == forced[1].tobytes()
    q, k, v, mask, scale = attention_inputs(4, 1, 64, 300, 32, 30, "global")
    one, _ = native_programs.attention(host_programs, "host", q, k, v, mask, scale)
    two, t = native_programs.attention(host_programs, "host", q, k, v, mask, scale, env={"TB_ISA": isa})
    assert t["gemm_isa"] == {"scalar": "portable"}.get(isa, isa) and one.tobytes() == two.tobytes()


LIBRARY_RUN = """
import json, sys
import numpy as np
from refimpl import gdn as ref, gemma
from testbed.backends.native import library as native
from testbed.oracles.numerical import check_nmse
from tests.test_native import attention_inputs
x = ref.draw_inputs(2, 130, 4, 32, v_repeat=2, kda=True, gate="mild", seed=5)
want = dict(zip(("out", "state"), ref.gdn_serial(*(a.astype(np.float64) for a in x.arrays()))))
got = dict(zip(("out", "state"), native.gdn_chunkwise(*x.arrays(), chunk=16)))
q, k, v, mask, scale = attention_inputs(4, 1, 64, 200, 16, 16, "global")
att = check_nmse({"out": gemma.attention(*(a.astype(np.float64) for a in (q, k, v, mask)), scale)},
                 {"out": native.attention(q, k, v, mask, scale)})
print(json.dumps({"info": native.build_info(), "gdn": check_nmse(want, got).passed, "attention": att.passed}))
"""


@pytest.mark.skipif(not X86, reason="x86-64 dispatch")
@pytest.mark.parametrize("isa", host_isas())
def test_the_host_library_runs_and_says_so_with_each_kernel(isa):
    p = subprocess.run([sys.executable, "-c", LIBRARY_RUN], capture_output=True, text=True,
                       env={**os.environ, "TB_ISA": isa}, cwd=kernel_build.ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["gdn"] and result["attention"]
    assert result["info"]["gemm_isa"].split("-")[0] == {"scalar": "portable"}.get(isa, isa)
    assert result["info"]["gemm_isa_forced"] == isa


@pytest.mark.parametrize("shape", [(64, 128, 128), (37, 70, 300)])
def test_fused_programs_are_judged_by_tolerance(shape):
    fused = kernel_build.build_programs("host", fused=True)
    a, b, c = operands(*shape, False, False, 2)
    got, timings = native_programs.gemm(fused, "host", a, b, c)
    assert timings["gemm_isa"].endswith("-fma") or not X86
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("target", ARM_TARGETS)
def test_fused_arm_programs_fuse_and_are_judged_by_tolerance(target):
    """arm32's FUSED=1 build targets VFPv4 (VFMA.F32) as aarch64's has FMLA: both run their fused NEON
    micro-kernel ("neon-fma", A row-major and transposed, every edge) within tolerance of float64."""
    programs = _build(target, fused=True)
    assert kernel_build.build_info(programs / "tb_gemm_bench")["multiply_add"] == "fused"
    for shape in SHAPES[:6] + [(37, 70, 300)]:
        for flags in FLAGS[::3] + [FLAGS[4]]:
            a, b, c = operands(*shape, flags["trans"], flags["lower"], 2, flags["transa"])
            got, timings = native_programs.gemm(programs, target, a, b, c, **flags)
            assert timings["gemm_isa"] == "neon-fma"
            want = (c.astype(np.float64) if flags["accumulate"] else 0) + (a.T if flags["transa"] else a).astype(
                np.float64) @ (b.T if flags["trans"] else b).astype(np.float64)
            assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()) * max(1, shape[2] / 64), \
                f"{target} {shape} {flags}"
