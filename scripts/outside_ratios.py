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

The reference: the faster, per shape, of numpy's OpenBLAS running its own kernel for this CPU and
oneMKL's cblas_sgemm (sequential layer, through ctypes from the `mkl` wheel's libmkl_rt, or the
system's) where it is installed; both are variants of the same shuffled repetitions, and the one with
the lower median CPU time is what every "vs sgemm" ratio divides by (the JSON's `reference` says which,
both medians, and why oneMKL is absent where it is). The variables that force another kernel
(OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE: set for every process on the project's machines;
MKL_ENABLE_INSTRUCTIONS, MKL_CBWR, ...) are read when the libraries load, so the script re-executes
itself without them (and without TB_ISA) before numpy loads. `--isa avx2` forces the kernels onto AVX2
(TB_ISA=avx2) and the references onto their AVX2 kernels (OPENBLAS_CORETYPE=Haswell,
MKL_ENABLE_INSTRUCTIONS=AVX2): like for like.

The model engine's decode step (kernels/tb_model.h, engine_bench's `decode_vs_stream`): the engine is
made here through its C ABI (ctypes structures mirroring tb_model.h; the weights stored in f32, f16 or
int8 by numpy here), P positions prefilled, then each repetition evicts the caches (256 MiB written and
read), times one decode step by this thread's CPU clock and drops its row; beside it, in the same
shuffled repetition, two streaming reads of 256 MiB over huge pages (numpy's integer sum, and this
script's own C loop summing float32 into four independent vector accumulators: on the AMD EPYC numpy's
sum read 34-36 GB/s where a loop with independent accumulators reads 40-41); the floor is the faster of
the two in each repetition, the best rate. The ratio: the step's time over the time to read the weights
once (every matrix in its stored dtype, the scales too) at that bandwidth. The step's logits are checked
against refimpl.gemma in float64 on the weights as stored.

    python scripts/outside_ratios.py [--fused 1|0] [--reps 7] [--keys 512,2048,8192] [--head-dim 256] [--chunk 64]
        [--gdn-tokens 512,4096] [--gdn-heads 16] [--gdn-head-size 128] [--gdn-chunk 0] [--gemm 512]
        [--decode f32,f16,int8] [--decode-past 512] [--isa avx2] [--mkl 1|0] [--json OUT]

Defaults: native_bench's (experiments/experiment/native_bench.yaml) and engine_bench's model
(experiments/experiment/engine_bench.yaml), one thread; the sgemm at --gemm's size. `--decode ''`
leaves the engine out; `--kernels 0` leaves the kernels out.
"""

from __future__ import annotations

import os
import sys

FORCING = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "MKL_DEBUG_CPU_TYPE",
           "MKL_THREADING_LAYER", "MKL_NUM_THREADS", "MKL_VERBOSE")
AVX2 = "--isa" in sys.argv and sys.argv[sys.argv.index("--isa") + 1:][:1] == ["avx2"] or "--isa=avx2" in sys.argv
# what the references must see: nothing forced, or (--isa avx2) their AVX2 kernels; the kernels: TB_ISA
WANTED = {"OPENBLAS_CORETYPE": "Haswell", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "TB_ISA": "avx2"} if AVX2 else {}
if any(os.environ.get(v) != WANTED.get(v) for v in (*FORCING, "TB_ISA")):  # before numpy loads OpenBLAS
    os.execve(sys.executable, [sys.executable, *sys.argv],
              {k: v for k, v in os.environ.items() if k not in FORCING and k != "TB_ISA"} | WANTED)

import argparse  # noqa: E402
import ctypes  # noqa: E402
import ctypes.util  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

try:  # numpy 2; numpy 1 had it under its old name
    from numpy._core import multiarray  # noqa: E402
except ImportError:
    from numpy.core import multiarray  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from refimpl import gdn, gemma  # noqa: E402

SOURCES = ("gdn.c", "attention.c", "sliding_cache.c", "tb_parallel.c", "gemm.c", "gemm_avx2.c", "gemm_avx512.c",
           "model.c", "model_cache.c", "model_prefill.c")
MIN_SAMPLE_S = 0.02  # each timed sample lasts at least this much CPU time (calls repeated)
# engine_bench's model (experiments/experiment/engine_bench.yaml: shape, group, seed)
DECODE_MODEL = gemma.GemmaConfig(vocab=4096, hidden=512, layers=6, heads=8, kv_heads=2, head_dim=64, mlp=2048,
                                 window=512)
DECODE_GROUP, DECODE_SEED = 32, 0
STREAM_BYTES = 256 << 20  # the streaming read, and what evicts the caches before each decode step
# The script's own streaming read: float32 sums in four independent 32-byte vectors (GCC's vector
# extension; no dependence of one add on the last beyond its own lane), so the memory bounds it.
STREAM_C = """
#include <stddef.h>
typedef float v8 __attribute__((vector_size(32)));
float outside_stream(const float *x, size_t n) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (size_t i = 0; i + 32 <= n; i += 32) {
        a0 += *(const v8 *)(x + i); a1 += *(const v8 *)(x + i + 8);
        a2 += *(const v8 *)(x + i + 16); a3 += *(const v8 *)(x + i + 24);
    }
    v8 t = a0 + a1 + a2 + a3;
    float s = 0;
    for (int k = 0; k < 8; k++) s += t[k];
    return s;
}
"""


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


def load_mkl() -> tuple[ctypes.CDLL | None, str]:
    """oneMKL's libmkl_rt (the mkl wheel's, else the system's) on its sequential threading layer, and
    where it came from; (None, why) where there is none."""
    path = None
    try:
        dist = importlib.metadata.distribution("mkl")
        path = next((os.path.realpath(dist.locate_file(f)) for f in dist.files or ()
                     if f.name.startswith("libmkl_rt.so")), None)
    except importlib.metadata.PackageNotFoundError:
        pass
    path = path or ctypes.util.find_library("mkl_rt")
    if not path:
        return None, "oneMKL is not installed (pip install mkl)"
    mkl = ctypes.CDLL(path)
    mkl.MKL_Set_Threading_Layer(1)  # MKL_THREADING_SEQUENTIAL, before any other call
    f32 = ctypes.POINTER(ctypes.c_float)
    mkl.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, f32, ctypes.c_int, f32, ctypes.c_int,
                                                     ctypes.c_float, f32, ctypes.c_int]
    mkl.cblas_sgemm.restype = None
    return mkl, path


def mkl_identity(mkl: ctypes.CDLL) -> dict:
    """oneMKL's version string and the CPU-dispatch library it loaded (once it ran a product)."""
    text = ctypes.create_string_buffer(512)
    mkl.mkl_get_version_string(text, len(text))
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    loaded = sorted({line.rsplit("/", 1)[-1].split(".so")[0] for line in maps.splitlines() if "/libmkl_" in line})
    return {"version": text.value.decode(errors="replace").strip(), "libraries": loaded}


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sum((got - want) ** 2) / max(np.sum(want ** 2), 1e-300))


def variants(lib: ctypes.CDLL, args, rng, mkl: ctypes.CDLL | None = None) -> tuple[dict, dict]:
    """name -> (call, flops, check); check() returns the NMSE of the last call's output. The references:
    "sgemm openblas" (numpy) and, where oneMKL is loaded, "sgemm mkl"."""
    calls, flops, checks = {}, {}, {}
    n = args.gemm
    m = rng.standard_normal((n, n)).astype(np.float32)
    c_np, c_mkl, c_tb = np.empty_like(m), np.empty_like(m), np.empty_like(m)
    want = m.astype(np.float64) @ m.astype(np.float64)
    calls["sgemm openblas"] = lambda: np.matmul(m, m, out=c_np)
    checks["sgemm openblas"] = lambda: nmse(c_np, want)
    if mkl is not None:
        calls["sgemm mkl"] = lambda pm=fp(m), pc=fp(c_mkl): mkl.cblas_sgemm(101, 111, 111, n, n, n, 1.0, pm, n, pm, n,
                                                                       0.0, pc, n)  # row-major, no transposes
        checks["sgemm mkl"] = lambda: nmse(c_mkl, want)
    b = GemmB(fp(m), n, 1, None, None)
    lib.tb_gemm.restype = None
    pm, pb, pc = fp(m), ctypes.byref(b), fp(c_tb)
    calls["gemm"] = lambda: lib.tb_gemm(n, n, n, pm, n, pb, pc, n, 0, 0)
    checks["gemm"] = lambda: nmse(c_tb, want)
    flops |= dict.fromkeys(calls, 2.0 * n ** 3)

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


# --- the model engine, through tb_model.h's ABI ---------------------------------------------------------

MAX_LAYERS = 256  # TB_MAX_LAYERS
DTYPES = {"f32": 0, "f16": 1, "int8": 2}  # TB_F32, TB_F16, TB_INT8


class ModelConfig(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "mlp",
                                            "window")] + [
        ("layer_type", ctypes.c_int * MAX_LAYERS), ("rope_local", ctypes.c_double), ("rope_global", ctypes.c_double),
        ("rope_global_scaling", ctypes.c_double), ("attn_scale", ctypes.c_float), ("rms_eps", ctypes.c_float),
        ("softcap", ctypes.c_float)]


class Matrix(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("rows", ctypes.c_int), ("cols", ctypes.c_int), ("group", ctypes.c_int),
                ("data", ctypes.c_void_p), ("scales", ctypes.c_void_p)]


PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
NORMS = ("q_norm", "k_norm", "input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm")


class LayerWeights(ctypes.Structure):
    _fields_ = [(n, Matrix) for n in PROJECTIONS] + [(n, ctypes.c_void_p) for n in NORMS]


class Model(ctypes.Structure):
    _fields_ = [("cfg", ModelConfig), ("embed", Matrix), ("final_norm", ctypes.c_void_p),
                ("layer", LayerWeights * MAX_LAYERS)]


class EngineOptions(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in ("cache_dtype", "cache_group", "sliding", "sink", "capacity", "max_rows",
                                            "threads")]


HF_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj", "q_norm": "self_attn.q_norm",
            "k_norm": "self_attn.k_norm", "input_norm": "input_layernorm",
            "post_attn_norm": "post_attention_layernorm", "pre_ff_norm": "pre_feedforward_layernorm",
            "post_ff_norm": "post_feedforward_layernorm"}


def stored(a: np.ndarray, dtype: str, group: int) -> tuple[list[np.ndarray], np.ndarray]:
    """A [rows, cols] matrix as the engine stores it (its arrays: data, then int8's scales) and the
    float64 values it stands for. int8: one scale per `group` consecutive elements of a row, max|x| / 127."""
    if dtype == "f32":
        return [np.ascontiguousarray(a, np.float32)], a.astype(np.float64)
    if dtype == "f16":
        h = np.ascontiguousarray(a, np.float16)
        return [h], h.astype(np.float64)
    rows, cols = a.shape
    g = a.astype(np.float64).reshape(rows, cols // group, group)
    scale = (np.abs(g).max(-1) / 127).astype(np.float32)
    q = np.clip(np.rint(g / np.where(scale == 0, 1, scale)[:, :, None]), -127, 127).astype(np.int8)
    return [q.reshape(rows, cols), scale], (q.astype(np.float64) * scale[:, :, None]).reshape(rows, cols)


def aligned(a: np.ndarray, to: int = 64) -> np.ndarray:
    """A copy of `a` starting on a cache line (numpy's large arrays start 16 bytes past a page): a
    row that straddles lines costs the step up to 10% (f32)."""
    buf = np.empty(a.nbytes + to, np.uint8)
    off = (-buf.ctypes.data) % to
    out = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


class Engine:
    """One engine over one stored copy of the weights, P positions prefilled."""

    def __init__(self, lib: ctypes.CDLL, cfg: gemma.GemmaConfig, w: dict, dtype: str, tokens: np.ndarray):
        self.lib, self.keep, self.ref = lib, [], {}
        self.weight_bytes = 0
        m = Model()
        c = m.cfg
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "mlp", "window"):
            setattr(c, name, getattr(cfg, name))
        for i, t in enumerate(cfg.layer_types):
            c.layer_type[i] = 1 if t == "global" else 0  # TB_GLOBAL, TB_LOCAL
        c.rope_local, c.rope_global, c.rope_global_scaling = cfg.rope_local, cfg.rope_global, cfg.rope_scaling_global
        c.attn_scale, c.rms_eps, c.softcap = cfg.scale, cfg.rms_eps, cfg.final_logit_softcap or 0.0
        m.embed = self.matrix("model.embed_tokens.weight", w, dtype)
        m.final_norm = self.vector("model.norm.weight", w)
        for i in range(cfg.layers):
            layer = m.layer[i]
            for name in PROJECTIONS:
                setattr(layer, name, self.matrix(f"model.layers.{i}.{HF_NAMES[name]}.weight", w, dtype))
            for name in NORMS:
                setattr(layer, name, self.vector(f"model.layers.{i}.{HF_NAMES[name]}.weight", w))
        self.model = m
        past = len(tokens) - 1
        # a float32 cache of every row, room for the decode step's
        options = EngineOptions(0, DECODE_GROUP, 0, 0, past + 1, past, 1)
        self.engine = ctypes.c_void_p()
        check(lib.tb_engine_create(ctypes.byref(m), ctypes.byref(options), ctypes.byref(self.engine)), "engine")
        self.tokens = np.ascontiguousarray(tokens, np.int32)
        self.logits = np.empty(cfg.vocab, np.float32)
        self.past = past
        check(lib.tb_model_prefill_with_past(self.engine, self.tokens.ctypes.data, past, past, 0, past, past - 1,
                                             self.logits.ctypes.data), "prefill")

    def matrix(self, name: str, w: dict, dtype: str) -> Matrix:
        arrays, self.ref[name] = stored(w[name], dtype, DECODE_GROUP)
        arrays = [aligned(a) for a in arrays]
        self.keep += arrays
        self.weight_bytes += sum(a.nbytes for a in arrays)
        rows, cols = w[name].shape
        return Matrix(DTYPES[dtype], rows, cols, DECODE_GROUP, arrays[0].ctypes.data,
                      arrays[1].ctypes.data if len(arrays) > 1 else None)

    def vector(self, name: str, w: dict) -> int:
        a = np.ascontiguousarray(w[name], np.float32)
        self.keep.append(a)
        self.ref[name] = a.astype(np.float64)
        return a.ctypes.data

    def decode(self):
        """One decode step at position P, its row then dropped (the cache as before)."""
        check(self.lib.tb_model_decode_with_past(self.engine, int(self.tokens[self.past]), self.past,
                                                 self.logits.ctypes.data), "decode step")
        check(self.lib.tb_engine_drop(self.engine, 1), "drop")

    def close(self):
        self.lib.tb_engine_free(self.engine)


def declare_engine_abi(lib: ctypes.CDLL):
    """tb_model.h's calls the decode needs, with their argument types."""
    lib.tb_engine_create.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(EngineOptions),
                                     ctypes.POINTER(ctypes.c_void_p)]
    lib.tb_model_prefill_with_past.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                               ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.tb_model_decode_with_past.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p]
    lib.tb_engine_drop.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.tb_engine_free.argtypes = [ctypes.c_void_p]


def check(rc: int, what: str):
    if rc != 0:
        raise RuntimeError(f"{what}: the engine returned {rc}")


def stream_reader(out_dir: Path):
    """The script's own streaming read (STREAM_C), compiled here: outside_stream(float *, n)."""
    source, out = out_dir / "outside_stream.c", out_dir / "outside_stream.so"
    source.write_text(STREAM_C)
    vector = ["-mavx2"] if "avx2" in cpu_flags() else []  # 32-byte vectors in one register where the CPU has them
    subprocess.run(["cc", "-O3", *vector, "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
    reader = ctypes.CDLL(str(out))
    reader.outside_stream.restype = ctypes.c_float
    reader.outside_stream.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return reader


def decode_variants(lib: ctypes.CDLL, args, reader):
    """name -> call, bytes, check for each weights dtype's decode step, and the two streaming reads
    ("stream numpy", "stream c": their bytes); the engines (to free); and what makes the caches cold
    before each."""
    cfg = DECODE_MODEL
    declare_engine_abi(lib)
    w = gemma.init_weights(cfg, DECODE_SEED)
    tokens = np.random.default_rng(DECODE_SEED).integers(0, cfg.vocab, args.decode_past + 1)
    calls, nbytes, checks, engines = {}, {}, {}, []
    # Pages: numpy asks for transparent huge pages for its large arrays (where the kernel's setting is
    # madvise, only those get them); the engine program's weights are plain malloc. The streaming read
    # gets them: it is the machine's best rate (numpy's sum over 4 KiB pages reads ~1.5x slower here,
    # the program's own loop does not), and a floor is the best rate. The weights and the eviction do
    # not: they are paged as the program's are.
    multiarray._set_madvise_hugepage(True)
    stream = np.arange(STREAM_BYTES // 8, dtype=np.uint64)
    multiarray._set_madvise_hugepage(False)
    evict = np.zeros(STREAM_BYTES // 8, np.uint64)
    for dtype in args.decode:
        e = Engine(lib, cfg, w, dtype, tokens)
        engines.append(e)

        name = f"decode {dtype}"
        calls[name], nbytes[name] = e.decode, float(e.weight_bytes)
        # the float64 reference on the weights as stored: the logits at position P of the whole prompt
        want = gemma.prefill_at(e.ref, cfg, tokens, args.decode_past)[0]
        checks[name] = lambda e=e, want=want: nmse(e.logits.astype(np.float64), want)
    calls["stream numpy"], nbytes["stream numpy"] = lambda: int(stream.sum()), float(stream.nbytes)
    floats = stream.view(np.float32)
    calls["stream c"] = lambda: reader.outside_stream(floats.ctypes.data, floats.size)
    nbytes["stream c"] = float(stream.nbytes)

    def cold():  # the caches written and read over, untimed: what other work leaves behind
        evict.fill(np.uint64(time.monotonic_ns() & 0xff))
        int(evict.sum())
    return calls, nbytes, checks, engines, cold


def stream_seconds(samples: dict) -> list[float]:
    """Per repetition, the faster of the streaming reads: the floor is the best rate."""
    return [min(pair) for pair in zip(*(samples[name] for name in samples if name.startswith("stream ")))]


def decode_ratios(samples: dict, nbytes: dict) -> dict[str, dict]:
    """Per repetition: the step's time over the time its weights take to stream once at the
    repetition's bandwidth (the faster read's); median, min, max."""
    result = {}
    stream, stream_bytes = stream_seconds(samples), nbytes["stream c"]
    for name in samples:
        if not name.startswith("decode "):
            continue
        per_rep = [t / (nbytes[name] / (stream_bytes / u)) for t, u in zip(samples[name], stream)]
        result[f"{name} vs stream"] = {"median": float(np.median(per_rep)), "min": float(min(per_rep)),
                                       "max": float(max(per_rep)), "reps": len(per_rep)}
    return result


def measure(calls: dict, reps: int, seed: int, once: tuple[str, ...] = (), before=None) -> dict[str, list[float]]:
    """CPU seconds per call of each variant, one sample per repetition, every variant once per
    repetition in an order shuffled by [seed, rep]. A variant in `once` is timed one call a sample (a
    cold decode step: repeated, it would find its weights cached); `before`, if given, runs untimed
    before each sample."""
    repeat = {}
    for name, call in calls.items():
        call()  # warm-up
        t0 = time.thread_time()
        call()
        repeat[name] = 1 if name in once else max(1, int(np.ceil(MIN_SAMPLE_S / max(time.thread_time() - t0, 1e-6))))
    samples = {name: [] for name in calls}
    names = list(calls)
    for rep in range(reps):
        for i in np.random.default_rng([seed, rep]).permutation(len(names)):
            name = names[i]
            if before:
                before()
            t0 = time.thread_time()
            for _ in range(repeat[name]):
                calls[name]()
            samples[name].append((time.thread_time() - t0) / repeat[name])
    return samples


def faster_reference(samples: dict) -> str:
    """The reference variant: of "sgemm openblas" and "sgemm mkl" (where it ran), the lower median time."""
    return min((name for name in samples if name.startswith("sgemm ")), key=lambda name: np.median(samples[name]))


def ratios(samples: dict, flops: dict, keys: list[int]) -> dict[str, dict]:
    """Per repetition rate(top) / rate(bottom); median, min, max over the repetitions. "sgemm" is the
    faster library's variant (faster_reference)."""
    reference = faster_reference(samples)
    pairs = [(f"attention keys={keys[-1]}", f"attention keys={keys[0]}")] if len(keys) > 1 else []
    pairs += [(name, "sgemm") for name in samples if not name.startswith("sgemm ")]
    pairs += [(name, "sgemm") for name in samples if name.startswith("sgemm ") and name != reference]
    result = {}
    for top, bottom in pairs:
        under = reference if bottom == "sgemm" else bottom
        per_rep = [(flops[top] / t) / (flops[under] / u) for t, u in zip(samples[top], samples[under])]
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
    parser.add_argument("--kernels", type=int, choices=(0, 1), default=1, help="0: the engine's decode step only")
    parser.add_argument("--decode", type=lambda s: [x for x in s.split(",") if x], default=list(DTYPES),
                        help="weights dtypes of the decode steps (f32,f16,int8); empty: none")
    parser.add_argument("--decode-past", type=int, default=512, help="positions held when the step runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--isa", choices=("native", "avx2"), default="native",
                        help="avx2: the kernels and both references on their AVX2 kernels")
    parser.add_argument("--mkl", type=int, choices=(0, 1), default=1, help="0: OpenBLAS alone as the reference")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.keys = sorted(args.keys)
    bad = [d for d in args.decode if d not in DTYPES]
    if bad:
        parser.error(f"--decode {bad[0]!r} is not one of {', '.join(DTYPES)}")
    from threadpoolctl import threadpool_info, threadpool_limits

    with tempfile.TemporaryDirectory() as tmp, threadpool_limits(1, "blas"):
        lib = build(bool(args.fused), Path(tmp))
        lib.tb_gemm_isa.restype = ctypes.c_char_p
        mkl, mkl_from = load_mkl() if args.mkl else (None, "--mkl 0")
        worst, gflops, found, reference = {}, {}, {}, {}
        if args.kernels:
            calls, flops, checks = variants(lib, args, np.random.default_rng([args.seed, 35]), mkl)
            samples = measure(calls, args.reps, args.seed)
            worst |= {name: check() for name, check in checks.items()}
            gflops = {n: flops[n] / float(np.median(s)) / 1e9 for n, s in samples.items()}
            found |= ratios(samples, flops, args.keys)
            chosen = faster_reference(samples)
            reference = {"library": chosen.split()[1], "by": "median CPU seconds per call, this thread",
                         "median_s": {n.split()[1]: float(np.median(s)) for n, s in samples.items()
                                      if n.startswith("sgemm ")}}
        reference["mkl"] = mkl_identity(mkl) | {"from": mkl_from} if mkl is not None else mkl_from
        if args.decode:
            calls, nbytes, checks, engines, cold = decode_variants(lib, args, stream_reader(Path(tmp)))
            samples = measure(calls, args.reps, args.seed, once=tuple(calls), before=cold)
            worst |= {name: check() for name, check in checks.items()}
            found |= decode_ratios(samples, nbytes)
            gflops["stream GB/s"] = float(np.median([nbytes["stream c"] / u / 1e9 for u in stream_seconds(samples)]))
            gflops |= {f"{name} GB/s": float(np.median([nbytes[name] / u / 1e9 for u in samples[name]]))
                       for name in samples if name.startswith("stream ")}
            for e in engines:
                e.close()
        blas = next((m for m in threadpool_info() if m.get("internal_api") == "openblas"), {})
        report = {"fused": bool(args.fused), "gemm_isa": lib.tb_gemm_isa().decode(),
                  "sgemm_kernel": blas.get("architecture"), "openblas": blas.get("version"), "reference": reference,
                  "environment": {k: v for k, v in os.environ.items() if k.startswith(("OPENBLAS_", "MKL_", "TB_"))},
                  "clock": "this thread's CPU time, 1 thread", "load": os.getloadavg()[0],
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "nmse": worst, "gflops_cpu": gflops, "ratios": found}
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
