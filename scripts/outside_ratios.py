#!/usr/bin/env python3
"""The kernels' ratios recomputed from outside testbed's harness: a plain numpy + ctypes loop.

What testbed prints about its kernels (kernels/README.md's performance table, native_bench's ratio
records) must reproduce here within 15%. Nothing of testbed's measurement code runs: this script
compiles kernels/*.c itself with cc (the device programs' host flags: -O3 -ffp-contract=off, AVX2 /
F16C, AVX-512 where the CPU has it, -mfma and TB_FUSED=1 for the fused build, TB_FUSED=0 without),
loads the library with ctypes and times each kernel and numpy's sgemm by this thread's CPU clock, one
thread, every variant once per repetition in a shuffled order; each ratio is the median over the
repetitions of the ratio within one. refimpl (plain numpy functions) gives the inputs, the float64
outputs every kernel is checked against, and GDN chunkwise's FLOP count (the work it really does).

The reference: numpy's OpenBLAS running its own kernel for this CPU. The variables that force
another (OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE: set for every process on the project's machines) are
read when the library loads, so the script re-executes itself without them before numpy loads.

    python scripts/outside_ratios.py [--fused 1|0] [--reps 7] [--keys 512,2048,8192] [--head-dim 256] [--chunk 64]
        [--gdn-tokens 512,4096] [--gdn-heads 16] [--gdn-head-size 128] [--gdn-chunk 0] [--gemm 512] [--json OUT]

Defaults: native_bench's (experiments/experiment/native_bench.yaml), one thread; the sgemm at --gemm's size.
"""

from __future__ import annotations

import os
import sys

FORCING = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
if any(v in os.environ for v in FORCING):  # before numpy loads OpenBLAS
    os.execve(sys.executable, [sys.executable, *sys.argv],
              {k: v for k, v in os.environ.items() if k not in FORCING})

import argparse  # noqa: E402
import ctypes  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from refimpl import gdn  # noqa: E402

SOURCES = ("gdn.c", "attention.c", "sliding_cache.c", "tb_parallel.c", "gemm.c", "gemm_avx2.c", "gemm_avx512.c")
MIN_SAMPLE_S = 0.02  # each timed sample lasts at least this much CPU time (calls repeated)


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build(fused: bool, out_dir: Path) -> ctypes.CDLL:
    flags = cpu_flags()
    vector = []
    if {"avx2", "f16c"} <= flags:
        vector = ["-mavx2", "-mf16c"] + (["-mfma"] if fused and "fma" in flags else []) + \
                 (["-mavx512f"] if "avx512f" in flags else [])
    out = out_dir / f"outside_{int(fused)}.so"
    kernels = ROOT / "kernels"
    subprocess.run(["cc", "-std=c11", "-O3", "-ffp-contract=off", "-fno-math-errno", *vector,
                    f"-DTB_FUSED={int(fused)}", '-DTB_SOURCE_HASH="outside"', f"-I{kernels}", "-shared", "-fPIC", "-pthread", "-o", str(out),
                    *(str(kernels / s) for s in SOURCES), "-lm"], check=True)
    return ctypes.CDLL(str(out))


class GemmB(ctypes.Structure):
    _fields_ = [("p", ctypes.POINTER(ctypes.c_float)), ("rs", ctypes.c_ssize_t), ("cs", ctypes.c_ssize_t),
                ("rows", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class GdnShape(ctypes.Structure):
    _fields_ = [("n_seqs", ctypes.c_int), ("tokens", ctypes.c_int), ("h_k", ctypes.c_int), ("h_v", ctypes.c_int),
                ("d", ctypes.c_int), ("kda", ctypes.c_int), ("head_map", ctypes.c_int),
                ("q_stride", ctypes.c_ssize_t * 3), ("k_stride", ctypes.c_ssize_t * 3),
                ("v_stride", ctypes.c_ssize_t * 3)]


def fp(a: np.ndarray):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sum((got - want) ** 2) / max(np.sum(want ** 2), 1e-300))


def variants(lib: ctypes.CDLL, args, rng) -> tuple[dict, dict]:
    """name -> (call, flops, check); check() returns the NMSE of the last call's output."""
    calls, flops, checks = {}, {}, {}
    n = args.gemm
    m = rng.standard_normal((n, n)).astype(np.float32)
    c_np, c_tb = np.empty_like(m), np.empty_like(m)
    want = m.astype(np.float64) @ m.astype(np.float64)
    calls["sgemm"] = lambda: np.matmul(m, m, out=c_np)
    checks["sgemm"] = lambda: nmse(c_np, want)
    b = GemmB(fp(m), n, 1, None, None)
    lib.tb_gemm.restype = None
    pm, pb, pc = fp(m), ctypes.byref(b), fp(c_tb)
    calls["gemm"] = lambda: lib.tb_gemm(n, n, n, pm, n, pb, pc, n, 0, 0)
    checks["gemm"] = lambda: nmse(c_tb, want)
    flops["sgemm"] = flops["gemm"] = 2.0 * n ** 3

    # attention: by default Gemma 3 270M's (4 query heads, 1 KV head, head size 256), a chunk of 64 rows at the end
    heads, kv_heads, hd, c = 4, 1, args.head_dim, args.chunk
    lib.tb_attention.argtypes = [ctypes.c_int] * 6 + [ctypes.POINTER(ctypes.c_float)] * 4 + [
        ctypes.c_float, ctypes.POINTER(ctypes.c_float), ctypes.c_int]
    for keys in args.keys:
        q = rng.standard_normal((heads, c, hd)).astype(np.float32)
        k = rng.standard_normal((kv_heads, keys, hd)).astype(np.float32)
        v = rng.standard_normal((kv_heads, keys, hd)).astype(np.float32)
        rows = np.arange(keys - c, keys)[:, None]
        causal = np.where(np.arange(keys)[None, :] <= rows, 0.0, -1e30).astype(np.float32)
        mask = np.ascontiguousarray(np.broadcast_to(causal, (heads, c, keys)))
        out = np.empty((heads, c, hd), np.float32)
        scale = 1 / np.sqrt(hd)
        s = np.einsum("hcd,kd->hck", q.astype(np.float64), k[0].astype(np.float64)) * scale + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = np.einsum("hck,kd->hcd", p / p.sum(-1, keepdims=True), v[0].astype(np.float64))
        name = f"attention keys={keys}"

        def call(ptrs=(fp(q), fp(k), fp(v), fp(mask)), po=fp(out), keys=keys):  # pointers made once: no
            lib.tb_attention(heads, kv_heads, c, keys, keys, hd, *ptrs, scale, po, 1)  # ctypes cost in the time
        calls[name], flops[name] = call, 4.0 * heads * c * keys * hd
        checks[name] = lambda out=out, ref=ref: nmse(out, ref)

    h, d = args.gdn_heads, args.gdn_head_size
    chunk = args.gdn_chunk or lib.tb_gdn_auto_chunk(d)
    for tokens in args.gdn_tokens:
        for kda in (False, True):
            x = gdn.draw_inputs(1, tokens, h, d, kda=kda, seed=args.seed)
            q, k, v, g, beta, state = (np.ascontiguousarray(a, np.float32) for a in x.arrays())
            ref_out, ref_state = gdn.gdn_serial(*(a.astype(np.float64) for a in x.arrays()))
            out, state_out = np.empty_like(v), np.empty_like(state)
            strides = [(ctypes.c_ssize_t * 3)(*(s // 4 for s in a.strides[:3])) for a in (q, k, v)]
            shape = GdnShape(1, tokens, h, h, d, int(kda), 0, *strides)
            name = f"gdn chunkwise T={tokens}{' kda' if kda else ''}"

            def call(ptrs=(ctypes.byref(shape), *(fp(a) for a in (q, k, v, g, beta, state, out, state_out)))):
                lib.tb_gdn_chunkwise(*ptrs, chunk, 1)
            calls[name] = call
            flops[name] = float(gdn.gdn_chunkwise_flops(1, tokens, h, d, chunk, kda))
            checks[name] = lambda out=out, ref=ref_out, so=state_out, rs=ref_state: max(nmse(out, ref), nmse(so, rs))
    return calls, flops, checks


def measure(calls: dict, reps: int, seed: int) -> dict[str, list[float]]:
    """CPU seconds per call of each variant, one sample per repetition, every variant once per
    repetition in an order shuffled by [seed, rep]."""
    repeat = {}
    for name, call in calls.items():
        call()  # warm-up
        t0 = time.thread_time()
        call()
        repeat[name] = max(1, int(np.ceil(MIN_SAMPLE_S / max(time.thread_time() - t0, 1e-6))))
    samples = {name: [] for name in calls}
    names = list(calls)
    for rep in range(reps):
        for i in np.random.default_rng([seed, rep]).permutation(len(names)):
            name = names[i]
            t0 = time.thread_time()
            for _ in range(repeat[name]):
                calls[name]()
            samples[name].append((time.thread_time() - t0) / repeat[name])
    return samples


def ratios(samples: dict, flops: dict, keys: list[int]) -> dict[str, dict]:
    """Per repetition rate(top) / rate(bottom); median, min, max over the repetitions."""
    pairs = [(f"attention keys={keys[-1]}", f"attention keys={keys[0]}")] if len(keys) > 1 else []
    pairs += [(name, "sgemm") for name in samples if name != "sgemm"]
    result = {}
    for top, bottom in pairs:
        per_rep = [(flops[top] / t) / (flops[bottom] / u) for t, u in zip(samples[top], samples[bottom])]
        result[f"{top} vs {bottom}"] = {"median": float(np.median(per_rep)), "min": float(min(per_rep)),
                                        "max": float(max(per_rep)), "reps": len(per_rep)}
    return result


def main(argv=None) -> int:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fused", type=int, choices=(0, 1), default=1)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--keys", type=ints, default=[512, 2048, 8192])
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=64, help="attention's query rows")
    parser.add_argument("--gdn-chunk", type=int, default=0, help="0: the kernel's own choice (tb_gdn_auto_chunk)")
    parser.add_argument("--gdn-tokens", type=ints, default=[512, 4096])
    parser.add_argument("--gdn-heads", type=int, default=16)
    parser.add_argument("--gdn-head-size", type=int, default=128)
    parser.add_argument("--gemm", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.keys = sorted(args.keys)
    from threadpoolctl import threadpool_info, threadpool_limits

    with tempfile.TemporaryDirectory() as tmp, threadpool_limits(1, "blas"):
        lib = build(bool(args.fused), Path(tmp))
        lib.tb_gemm_isa.restype = ctypes.c_char_p
        calls, flops, checks = variants(lib, args, np.random.default_rng([args.seed, 35]))
        samples = measure(calls, args.reps, args.seed)
        worst = {name: check() for name, check in checks.items()}
        blas = next((m for m in threadpool_info() if m.get("user_api") == "blas"), {})
        report = {"fused": bool(args.fused), "gemm_isa": lib.tb_gemm_isa().decode(),
                  "sgemm_kernel": blas.get("architecture"), "openblas": blas.get("version"),
                  "environment": {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")},
                  "clock": "this thread's CPU time, 1 thread", "load": os.getloadavg()[0],
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "nmse": worst, "gflops_cpu": {n: flops[n] / float(np.median(s)) / 1e9 for n, s in samples.items()},
                  "ratios": ratios(samples, flops, args.keys)}
    bad = {name: e for name, e in worst.items() if not e <= 1e-6}
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    if bad:
        print(f"outside_ratios: outputs off the float64 reference (NMSE > 1e-6): {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
