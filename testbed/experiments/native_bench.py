"""Experiment `native_bench`: the native attention and sliding-cache kernels on the device, as ratios.

attention  one chunk of C query rows against P past + C new keys, vs the same C rows as C decode
           calls (C = 1, each against the cache filled up to its own position): speedup. Both run in
           tb_attention_bench on the device, timed by its own clock around the kernel calls only (no
           host call between decode steps), alternating chunk and decode-steps runs per repetition.
           Both outputs are checked against the numpy reference (NMSE), so every timed call
           computed the full result. The mask differs per head (head_biased_mask): a causal mask is
           the same for every head, so a kernel reading every head's mask rows from one head would
           pass with it. Then one decode step (the last row against every key) hot
           (operands in cache after a warm-up call) and cold (the caches evicted before it, as a
           first call after other work finds them), with the bytes it must read and their rate.
ratios     the kernels' targets, measured interleaved in one run (every repetition runs every
           variant once, in an order shuffled per repetition, seeded by `seed`): chunk attention's
           GFLOP/s at the most keys over its GFLOP/s at the fewest (issue 14), and chunk attention,
           GDN chunkwise and KDA (on the work they really do, gdn_chunkwise_flops) and tb_gemm over
           the best library's sgemm on the same threads (issue 45; the targets above): every candidate
           library (numpy's OpenBLAS, oneMKL where installed) is a variant of its own, and per thread
           count the faster by median CPU time is the reference, the record `ratios/sgemm` naming it,
           its kernel, ISA and the decision's confidence (this host only; testbed.measure.blas_reference).
           At threads > 1 each library also runs on one thread in every repetition: when the chosen
           one's CPU time per call on `threads` threads exceeds 1.2x that (OpenBLAS's idle threads
           spin on a busy host and are charged for it), the ratio record says reference_spinning and
           judges no target.
           Each ratio per repetition (the variants of one repetition saw the same machine), by wall
           and by CPU time: on a loaded host a long call is preempted more often than a short one, so
           wall ratios of calls of different lengths are skewed; the CPU ratio is the kernel's.
           Every timed output is checked against the float64 reference (NMSE).
rollback   the padded tail's extra cache work (snapshot before the padded append, rollback after it)
           on one layer's K and V at the model shape, against an unpadded append, in tb_cache_bench
           (each operation timed apart, interleaved in every repetition), vs one decode step of that
           layer's attention (the decode-steps time over C). On a device that counts, each
           operation's exact instructions too (tb_cache_bench marks each one).
counts     on a device that counts (the emulated ones) every run's instructions; on the host with
           counts=true each program of the three parts once more under valgrind, apart from the timed
           runs (testbed.backends.native.device.count_instructions): every kernel the run times is counted.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from refimpl import gdn, gemma
from testbed.backends.native.build import build_info, build_programs, target_for_abi
from testbed.backends.native.device import NativeJob, count_instructions, run_native
from testbed.backends.native.gdn import INPUTS as GDN_INPUTS, auto_chunk
from testbed.config import BoolList, Choice, Int, IntList, as_bools, as_list
from testbed.errors import UsageError
from testbed.measure import blas_reference
from testbed.measure.timing import time_interleaved
from testbed.oracles.numerical import check_nmse, head_biased_mask
from testbed.report import tables
from testbed.results import Figure, Record

PARAMS = {
    "backend": Choice(("native",)),
    "threads": Int(1, 256),
    "counts": Choice((False, True)),
    "attention.heads": Int(1, 256),
    "attention.kv_heads": Int(1, 256),
    "attention.head_dim": Int(1, 1024),
    "attention.past": Int(0, 1 << 20),
    "attention.chunk": Int(1, 4096),
    "cache.window": Int(2, 1 << 20),
    "cache.sink": Int(0, 1 << 20),
    "cache.real": Int(0, 4096),
    "bench.warmup": Int(0, 100),
    "bench.reps": Int(1, 1000),
    "bench.cold_mb": Int(1, 4096),
    "ratios.reps": Int(0, 1000),
    "ratios.key_counts": IntList(1, 1 << 20),
    "ratios.gdn.heads": Int(1, 256),
    "ratios.gdn.head_size": Int(1, 1024),
    "ratios.gdn.tokens": IntList(1, 1 << 20),
    "ratios.gdn.kda": BoolList(),
    "ratios.gdn.chunk": Int(0, 4096),
    "ratios.ggml": Choice(("auto", True, False)),
    "ratios.torch": Choice(("auto", True, False)),
    "ratios.sgemm": Int(1, 8192),
    "ratios.gemm": Int(1, 8192),
    "fused": Choice((False, True)),
}

# Issue 14's target: chunk attention at many keys keeps this share of its rate at few keys. Issue 45's
# (against the best library present, testbed.measure.blas_reference): chunk attention at every key
# count, GDN chunkwise and KDA (on the work they really do) and tb_gemm reach these shares of sgemm's
# rate; tb_gemm forced onto AVX2 (TB_ISA=avx2) this share of the best AVX2 library kernel's. GDN
# chunkwise takes at most these shares of ggml's CPU GATED_DELTA_NET's time (KDA: its own; issue 25)
# and of transformers' torch chunkwise's (by token count).
KEYS_TARGET = 0.8
ATTENTION_TARGET = 0.85
SGEMM_TARGET = 0.75
KDA_SGEMM_TARGET = 0.7
GEMM_TARGET = 0.9
AVX2_GEMM_TARGET = 0.8
GGML_TARGET = 0.25
GGML_KDA_TARGET = 0.3
TORCH_TARGETS = {512: 0.25, 4096: 0.2}
# On a device that counts (the emulated ones: exact instructions), each kernel's instructions per FLOP
# over the FMA ideal of the ISA it ran on: one instruction per multiply-add of a full vector, 1 / (2
# lanes) instructions per FLOP. AArch64 NEON: FMLA on 4 float32 lanes, 1/8; ARMv7-A NEON: VFMA (the
# fused build, VFPv4) or VMLA (the unfused one: a multiply-accumulate rounding twice) on 4 lanes, 1/8;
# Hexagon v67 as built (scalar C, no HVX): one sffma per 2 FLOP, 1/2; x86-64 AVX-512 (valgrind's
# counts): 16 lanes, 1/32. Goals (issue 35): tb_gemm at most 1.5x the ideal, GDN chunkwise and
# attention at most 2x.
FMA_IDEAL = {"aarch64": (1 / 8, "NEON FMLA, 4 float32 lanes: 8 FLOP per instruction"),
             "arm32": (1 / 8, "ARMv7-A NEON VFMA (VFPv4; VMLA unfused), 4 float32 lanes: 8 FLOP per instruction"),
             "hexagon": (1 / 2, "Hexagon v67 scalar sffma (the build has no HVX): 2 FLOP per instruction"),
             "host": (1 / 32, "AVX-512 VFMADD, 16 float32 lanes: 32 FLOP per instruction")}
IDEAL_TARGETS = (("gemm loop", None), ("gemm", 1.5), ("attention", 2.0), ("gdn chunkwise", 2.0))
# At threads > 1: the kernels' CPU time on N threads over one thread's (the same call), at most.
THREADS_TARGET = 1.05
ONE = " (1 thread)"  # the name of a variant's one-thread twin
TORCH_CHUNK = 64  # transformers' torch_chunk_gated_delta_rule at its own default chunk_size
SGEMM_1 = "sgemm 1 thread"  # the reference on one thread, beside it at threads > 1 (the spinning rule)


def validate(cfg: DictConfig) -> None:
    a, c = cfg.attention, cfg.cache
    if a.heads % a.kv_heads:
        raise UsageError(f"attention.heads={a.heads} is not a multiple of attention.kv_heads={a.kv_heads}")
    if c.real > a.chunk:
        raise UsageError(f"cache.real={c.real} exceeds attention.chunk={a.chunk}; accepted: 0..{a.chunk}")
    keys = as_list(cfg.ratios.key_counts)
    if cfg.ratios.reps and (len(keys) < 2 or min(keys) < a.chunk):
        raise UsageError(f"ratios.key_counts={keys} is not accepted; accepted: two or more key counts, each >= "
                         f"attention.chunk={a.chunk} (the chunk's rows are keys too)")
    if c.window <= a.chunk + c.sink:
        raise UsageError(f"attention.chunk={a.chunk} does not fit the cache tail (window {c.window} - sink "
                         f"{c.sink}); padding needs window > chunk + sink")


def attention_flops(heads: int, rows: int, keys: int, head_dim: int) -> int:
    """q k^T and p v over every key column the kernel computes: 2 multiply-adds per (row, key, dim)."""
    return 4 * heads * rows * keys * head_dim


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    a, c, b = cfg.attention, cfg.cache, cfg.bench
    target = target_for_abi(ctx.device.profile.abi)
    ctx.progress(f"native_bench: building the programs for {target}")
    programs = build_programs(target, fused=bool(cfg.fused))
    rng = np.random.default_rng(cfg.seed)
    n_keys = a.past + a.chunk
    q = rng.standard_normal((a.heads, a.chunk, a.head_dim)).astype(np.float32)
    k = rng.standard_normal((a.kv_heads, n_keys, a.head_dim)).astype(np.float32)
    v = rng.standard_normal((a.kv_heads, n_keys, a.head_dim)).astype(np.float32)
    queries, keys = np.arange(a.past, n_keys), np.arange(n_keys)
    mask = head_biased_mask(gemma.attention_mask(queries, keys, c.window, a.heads, "global"), queries, keys)
    reference = gemma.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask,
                                1 / np.sqrt(a.head_dim))

    # the host counts only when asked (valgrind, one more run per program); a counting device, every run
    host_counts = bool(cfg.counts) and not ctx.device.profile.has("counts")

    def attention_job(form: str, warmup: int, reps: int, inputs=None, cold_mb: int = 0) -> NativeJob:
        args = ["{inputs}", ".", f"form={form}", f"threads={cfg.threads}", f"warmup={warmup}", f"reps={reps}",
                f"cold_mb={cold_mb}"]
        return NativeJob(programs / "tb_attention_bench", inputs or {"q": q, "k": k, "v": v, "mask": mask},
                         ["out"], args, measured=reps > 0)

    def attention_run(form: str, warmup: int, reps: int, inputs=None, cold_mb: int = 0):
        return run_native(ctx.device, attention_job(form, warmup, reps, inputs, cold_mb))

    ctx.progress("native_bench attention: chunk vs decode steps, on the device")
    samples: dict[str, list[float]] = {"chunk": [], "decode_steps": []}
    evidence: dict[str, list] = {"chunk": [], "decode_steps": []}
    instructions: dict[str, list[int]] = {"chunk": [], "decode_steps": []}  # where the device counts
    outputs = {}
    for rep in range(b.reps):
        for form in samples:
            result = attention_run(form, b.warmup if rep == 0 else 0, 1)
            samples[form] += result.timings["seconds"]
            if result.counts:
                instructions[form].append(result.counts.per_call)
            evidence[form].append(result.evidence.as_dict())
            outputs[form] = result.outputs["out"]
    if host_counts:
        ctx.progress("native_bench attention: counting instructions under valgrind")
        for form in samples:
            instructions[form].append(count_instructions(ctx.device, attention_job(form, 0, 1)).per_call)
    times = {form: Figure.of(s, "s") for form, s in samples.items()}
    flops = {"chunk": attention_flops(a.heads, a.chunk, n_keys, a.head_dim),
             "decode_steps": sum(attention_flops(a.heads, 1, a.past + i + 1, a.head_dim) for i in range(a.chunk))}
    shape = f"heads={a.heads},kv={a.kv_heads},hd={a.head_dim},P={a.past},C={a.chunk}"
    params = {"kernel": "attention", "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
              "past": a.past, "chunk": a.chunk, "threads": cfg.threads}
    # what a call through the program costs beyond the kernel, per run (warm-up calls excluded)
    outside = {form: Figure.of([e["detail"]["command_seconds"] - e["device_seconds"] for e in evidence[form][1:]
                                or evidence[form]], "s") for form in samples}
    for form, t in times.items():
        verdict = check_nmse({"out": reference}, {"out": outputs[form]})
        yield Record("native_bench", f"attention/{shape}/{form}", "oracle", "nmse", verdict.verdict, verdict.margin,
                     verdict.metrics, params=params | {"form": form}, detail=verdict.detail,
                     evidence=evidence[form][-1:])
        yield Record(
            "native_bench", f"attention/{shape}/{form}", "measure",
            figures={"time": t.scaled(1e3, "ms"), "tokens_per_s": t.rate(a.chunk, "tokens/s"),
                     "gflops": t.rate(flops[form] / 1e9, "GFLOP/s"),
                     "outside_kernel": outside[form].scaled(1e3, "ms"),
                     **({"instructions": Figure.of(instructions[form], "instructions")} if instructions[form] else {})},
            metrics={"speedup_vs_decode": times["decode_steps"].median / t.median},
            work={"flops": flops[form], "flop_count": "4 heads rows keys head_dim (q k^T and p v)",
                  "rows": a.chunk, "calls": 1 if form == "chunk" else a.chunk,
                  "timer": "tb_attention_bench's clock on the device, around the kernel call(s) only",
                  "outside_kernel": "the program run as the host saw it minus the kernel time: process start, "
                                    "input load, output write and the link (the first run's warm-up excluded)"},
            params=params | {"form": form}, evidence=evidence[form],
        )

    yield from decode_step_records(cfg, attention_run, q, k, v, mask, params)
    if cfg.ratios.reps:
        yield from ratio_records(cfg, ctx, programs, host_counts)

    # Rollback: one layer's K and V caches (float32 rows of head_dim per KV head), a full window.
    ctx.progress("native_bench cache rollback vs one decode step, on the device")
    row_bytes = a.head_dim * 4
    full = rng.integers(0, 256, (2 * a.kv_heads, c.window, row_bytes), dtype=np.uint8)
    rows = rng.integers(0, 256, (2 * a.kv_heads, a.chunk, row_bytes), dtype=np.uint8)
    n_pad = a.chunk - c.real
    def cache_job(warmup: int, reps: int) -> NativeJob:
        return NativeJob(programs / "tb_cache_bench", {"cache": full, "rows": rows}, ["exact", "rolled"],
                         ["{inputs}", ".", f"count={c.window}", f"sink={c.sink}", f"n_pad={n_pad}", f"warmup={warmup}",
                          f"reps={reps}"], measured=True)

    result = run_native(ctx.device, cache_job(b.warmup, b.reps))
    cache_counts = result.counts or (count_instructions(ctx.device, cache_job(0, 1)) if host_counts else None)
    ops = {name: Figure.of(s, "s") for name, s in result.timings["seconds"].items()}
    padded = np.asarray(result.timings["seconds"]["snapshot"]) + np.asarray(result.timings["seconds"]["padded_append"]) \
        + np.asarray(result.timings["seconds"]["rollback"])
    extra = Figure.of(np.maximum(padded - np.asarray(result.timings["seconds"]["exact_append"]), 0.0), "s")
    decode_step = times["decode_steps"].median / a.chunk
    same = bool(np.array_equal(result.outputs["exact"], result.outputs["rolled"]))
    shape = f"window={c.window},sink={c.sink},real={c.real},pads={n_pad},kv={a.kv_heads},hd={a.head_dim}"
    params = {"kernel": "sliding_cache", "window": c.window, "sink": c.sink, "real": c.real, "pads": n_pad,
              "kv_heads": a.kv_heads, "head_dim": a.head_dim, "threads": cfg.threads}
    yield Record("native_bench", f"cache/{shape}/byte-identical", "oracle", "bitexact", "pass" if same else "fail",
                 0.0 if same else float("-inf"), {"rows_compared": int(full.shape[1])}, params=params,
                 detail="" if same else "padded append + rollback left other bytes than the exact append",
                 evidence=[result.evidence.as_dict()])
    for form, t in ops.items():
        counted = {"instructions": Figure.of(cache_counts.of(form), "instructions")} if cache_counts else {}
        yield Record(
            "native_bench", f"cache/{shape}/{form}", "measure",
            figures={"time": t.scaled(1e6, "us"), **counted},
            metrics={"rollback_extra_us": extra.median * 1e6, "rollback_vs_decode_step": extra.median / decode_step},
            work={"bytes_per_plane_row": row_bytes, "planes": int(full.shape[0]),
                  "timer": "tb_cache_bench's clock on the device, each operation apart"},
            params=params | {"form": form}, evidence=[result.evidence.as_dict()],
        )


def decode_step_records(cfg, attention_run, q, k, v, mask, params) -> Iterator[Record]:
    """One decode step, the chunk's last row against all P + C keys, hot and cold, alternating."""
    a, b = cfg.attention, cfg.bench
    step = {"q": np.ascontiguousarray(q[:, -1:]), "k": k, "v": v, "mask": np.ascontiguousarray(mask[:, :, -1:])}
    runs = {"decode_step_hot": dict(warmup=1, cold_mb=0), "decode_step_cold": dict(warmup=0, cold_mb=b.cold_mb)}
    samples: dict[str, list[float]] = {form: [] for form in runs}
    evidence: dict[str, list] = {form: [] for form in runs}
    for _ in range(b.reps):
        for form, how in runs.items():
            result = attention_run("chunk", how["warmup"], 1, step, how["cold_mb"])
            samples[form] += result.timings["seconds"]
            evidence[form].append(result.evidence.as_dict())
    n_keys = a.past + a.chunk
    # what one step must read: K and V of every key, and its mask row per head
    streamed = 4 * (2 * a.kv_heads * n_keys * a.head_dim + a.heads * n_keys)
    for form, s in samples.items():
        t = Figure.of(s, "s")
        yield Record(
            "native_bench", f"attention/heads={a.heads},kv={a.kv_heads},hd={a.head_dim},keys={n_keys}/{form}",
            "measure", figures={"time": t.scaled(1e3, "ms"), "bandwidth": t.rate(streamed / 1e9, "GB/s")},
            metrics={"cold_vs_hot": Figure.of(samples["decode_step_cold"], "s").median
                     / Figure.of(samples["decode_step_hot"], "s").median},
            work={"bytes": streamed, "bytes_count": "K and V of every key (float32) and one mask row per head",
                  "cold": f"caches evicted before each timed call ({b.cold_mb} MiB written and read)"
                          if form.endswith("cold") else "a warm-up call first: operands in cache if they fit"},
            params=params | {"form": form, "keys": n_keys}, evidence=evidence[form])


def _gdn_name(tokens: int, kda: bool) -> str:
    return f"T={tokens}{' kda' if kda else ''}"


def torch_target(tokens: int) -> float:
    """Issue 25's goal for GDN chunkwise over transformers' torch_chunk_gated_delta_rule (time ratio)."""
    return TORCH_TARGETS[max([t for t in TORCH_TARGETS if t <= tokens] or [min(TORCH_TARGETS)])]


def ggml_program(cfg: DictConfig, ctx):
    """tb_ggml_gdn (ggml's CPU GATED_DELTA_NET on .npy inputs, testbed.backends.llamacpp) built for this
    host, or None with the reason (ratios.ggml=auto: a missing build is a note, not a failure)."""
    if not cfg.ratios.ggml:
        return None, "ratios.ggml=false"
    try:
        from testbed.backends.llamacpp import build as llamacpp_build

        ctx.progress("native_bench ratios: ggml's GATED_DELTA_NET (tb_ggml_gdn) for the host")
        return llamacpp_build.build("host", "", ("tb_ggml_gdn",), ctx.progress).program("tb_ggml_gdn"), None
    except Exception as e:  # noqa: BLE001 - auto: measure without it and say why
        if cfg.ratios.ggml == "auto":
            return None, f"ggml could not be built here: {e}"
        raise


def torch_reference(cfg: DictConfig):
    """transformers' torch_chunk_gated_delta_rule (its PyTorch fallback, what Qwen3-Next runs on a CPU
    without flash-linear-attention), or None with the reason."""
    if not cfg.ratios.torch:
        return None, "ratios.torch=false"
    try:
        import logging

        import torch
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

        logging.getLogger("transformers").setLevel(logging.ERROR)  # its "falling back" notice, once per call
        return (torch, torch_chunk_gated_delta_rule), None
    except Exception as e:  # noqa: BLE001
        if cfg.ratios.torch == "auto":
            return None, f"transformers / torch not importable: {e}"
        raise


def ratio_records(cfg: DictConfig, ctx, programs, host_counts: bool = False) -> Iterator[Record]:
    """Every variant of one repetition interleaved (an order shuffled per repetition): chunk attention at
    each of ratios.key_counts, GDN chunkwise at each ratios.gdn.tokens (scalar gate and KDA), tb_gemm at
    n^3; on this host also numpy's sgemm (OpenBLAS), ggml's GATED_DELTA_NET and transformers' torch
    chunkwise where they exist. Then issue 25's ratios per repetition; on a device that counts (or
    the host with `host_counts`: each of testbed's programs once more under valgrind), each kernel's
    instructions per FLOP beside the reference loop's (tb_gemm_bench form=loop)."""
    a, r, b = cfg.attention, cfg.ratios, cfg.bench
    target = target_for_abi(ctx.device.profile.abi)
    rng = np.random.default_rng([cfg.seed, 14])
    keys = sorted(set(as_list(r.key_counts)))
    variants, flops, references, outputs, evidence, counts = {}, {}, {}, {}, {}, {}
    what: dict[str, str] = {}
    jobs: dict[str, NativeJob] = {}  # testbed's own programs' runs, by variant: what the host counts
    here = ctx.device.profile.transport == "local" and not ctx.device.profile.has("emulated")

    def program_run(name: str, program: Path, inputs: dict, output_names: list[str], args: list[str],
                    threads: int | None = None):
        job = NativeJob(program, inputs, output_names, ["{inputs}", ".", *args, f"threads={threads or cfg.threads}",
                                                        f"warmup={b.warmup}", "reps=1"], measured=False)
        if program.parent == programs:
            jobs[name] = job

        def run() -> dict[str, float]:
            result = run_native(ctx.device, job)
            outputs[name] = result.outputs
            evidence.setdefault(name, []).append(result.evidence.as_dict())
            if result.counts:
                counts.setdefault(name, []).append(result.counts.per_call)
            what.setdefault(name, result.timings.get("gemm_isa", ""))
            if result.timings.get("program") == "tb_gdn_bench" and result.timings.get("chunk") != chunk:
                raise RuntimeError(f"{name}: the program ran chunk={result.timings.get('chunk')}, the FLOP count "
                                   f"assumes {chunk} (testbed.backends.native.gdn.auto_chunk disagrees with the kernels)")
            return {"wall": result.timings["seconds"][0], "cpu": result.timings["cpu_seconds"][0]}
        return run

    for n_keys in keys:
        name = f"attention keys={n_keys}"
        q = rng.standard_normal((a.heads, a.chunk, a.head_dim)).astype(np.float32)
        k = rng.standard_normal((a.kv_heads, n_keys, a.head_dim)).astype(np.float32)
        v = rng.standard_normal((a.kv_heads, n_keys, a.head_dim)).astype(np.float32)
        mask = gemma.attention_mask(np.arange(n_keys - a.chunk, n_keys), np.arange(n_keys), cfg.cache.window, a.heads,
                                    "global")
        references[name] = {"out": gemma.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                                    mask, 1 / np.sqrt(a.head_dim))}
        variants[name] = program_run(name, programs / "tb_attention_bench", {"q": q, "k": k, "v": v, "mask": mask},
                                     ["out"], ["form=chunk"])
        flops[name] = attention_flops(a.heads, a.chunk, n_keys, a.head_dim)
        if cfg.threads > 1 and n_keys == keys[-1]:  # the CPU the threads cost: the same call on one thread
            variants[name + ONE] = program_run(name + ONE, programs / "tb_attention_bench",
                                               {"q": q, "k": k, "v": v, "mask": mask}, ["out"], ["form=chunk"], 1)
            flops[name + ONE], references[name + ONE] = flops[name], references[name]

    g = r.gdn
    chunk = g.chunk or auto_chunk(g.head_size)  # 0: the kernel's own choice for the head size
    ggml, ggml_note = ggml_program(cfg, ctx) if here else (None, "not this host")
    torch_ref, torch_note = torch_reference(cfg) if here else (None, "not this host")
    gdn_cases = [(t, kda) for t in sorted(set(as_list(g.tokens))) for kda in sorted(set(as_bools(g.kda)))]
    for tokens, kda in gdn_cases:
        x = gdn.draw_inputs(1, tokens, g.heads, g.head_size, kda=kda, seed=cfg.seed)
        out, state = gdn.gdn_serial(*(arr.astype(np.float64) for arr in x.arrays()))
        inputs = dict(zip(GDN_INPUTS, x.arrays()))
        case = _gdn_name(tokens, kda)
        names = [f"gdn chunkwise {case}"] + ([f"ggml {case}"] if ggml else []) + (
            [f"torch {case}"] if torch_ref and not kda else [])
        for name in names:
            references[name] = {"out": out, "state": state}
            flops[name] = gdn.gdn_chunkwise_flops(1, tokens, g.heads, g.head_size, chunk if name == names[0]
                                                  else TORCH_CHUNK, kda)
        args = ["form=chunkwise", f"chunk={g.chunk or 'auto'}", "head_map=tiled"]
        variants[names[0]] = program_run(names[0], programs / "tb_gdn_bench", inputs, ["out", "state"], args)
        if cfg.threads > 1 and not kda:
            variants[names[0] + ONE] = program_run(names[0] + ONE, programs / "tb_gdn_bench", inputs, ["out", "state"],
                                                   args, 1)
            flops[names[0] + ONE], references[names[0] + ONE] = flops[names[0]], references[names[0]]
        if ggml:
            variants[f"ggml {case}"] = program_run(f"ggml {case}", ggml, inputs, ["out", "state"], [])
        if torch_ref and not kda:
            variants[f"torch {case}"] = torch_run(f"torch {case}", torch_ref, x, TORCH_CHUNK, cfg.threads, outputs)
    # the matrix product itself, and on a device that counts the reference loop it must match
    m = rng.standard_normal((r.gemm, r.gemm)).astype(np.float32)
    zero = np.zeros_like(m)
    references["gemm"] = {"c": m.astype(np.float64) @ m.astype(np.float64)}
    # one thread whatever cfg.threads: tb_gemm is one thread's product (its callers split the work)
    variants["gemm"] = program_run("gemm", programs / "tb_gemm_bench", {"a": m, "b": m, "c": zero}, ["c"], ["form=gemm"],
                                   threads=1)
    flops["gemm"] = 2 * r.gemm**3
    if ctx.device.profile.has("counts") or host_counts:
        references["gemm loop"] = references["gemm"]
        variants["gemm loop"] = program_run("gemm loop", programs / "tb_gemm_bench", {"a": m, "b": m, "c": zero},
                                            ["c"], ["form=loop"], threads=1)
        flops["gemm loop"] = flops["gemm"]
    # a library's sgemm is a reference rate only where the kernels ran: this host, not under emulation;
    # every candidate library (OpenBLAS, oneMKL where installed) on `threads` threads and (for the
    # spinning rule, and tb_gemm's one thread) on one thread, all interleaved with the rest
    repeat, best = 1, None
    if here:
        products = blas_reference.square_products(r.sgemm, [cfg.seed, 14])
        repeat = blas_reference.repeats_for(products)  # calls long enough for the CPU clock
        best = blas_reference.BestReference(products, cfg.threads, repeat)
        variants |= best.variants()
        flops |= dict.fromkeys(best.variants(), 2 * r.sgemm**3)
        if best.missing:
            ctx.progress(f"native_bench ratios: the reference is {', '.join(best.candidates)} alone: "
                         f"{'; '.join(best.missing.values())}")
    for note in (ggml_note, torch_note):
        if note:
            ctx.progress(f"native_bench ratios: {note}")
    ctx.progress(f"native_bench ratios: {', '.join(variants)}, interleaved")
    timed = time_interleaved(variants, reps=r.reps, warmup=1, seed=cfg.seed, timer=lambda run: run())
    if host_counts:
        ctx.progress(f"native_bench ratios: counting {', '.join(jobs)} under valgrind")
        for name, job in jobs.items():
            counts[name] = [count_instructions(ctx.device, job).per_call]
    # fused: the build asked for; multiply_add: how it computes (arm32's fused build computes unfused)
    params = {"part": "ratios", "threads": cfg.threads, "order_seed": timed.seed, "fused": bool(cfg.fused),
              "multiply_add": build_info(programs / "tb_gemm_bench").get("multiply_add"),
              "gemm_isa": what.get("gemm")}
    # per thread count, the faster library on these products is the reference ("sgemm", SGEMM_1)
    picks = {}
    if best:
        picks["sgemm"] = best.pick(timed.samples)
        if cfg.threads > 1:
            picks[SGEMM_1] = best.pick(timed.samples, one_thread=True)
        for label, pick in picks.items():
            ctx.progress(f"native_bench ratios: {label}: {pick.describe()}; {pick.info['choice']['says']}")
    blas = {name: blas_reference.blas_info(timer.threads, timer.library) for name, timer in variants.items()
            if isinstance(timer, blas_reference.ProductsTimer)}

    for name, reference in references.items():
        verdict = check_nmse(reference, {key: outputs[name][key] for key in reference})
        yield Record("native_bench", f"ratios/{name}", "oracle", "nmse", verdict.verdict, verdict.margin,
                     verdict.metrics, params=params | {"kernel": name}, detail=verdict.detail,
                     evidence=evidence.get(name, [])[-1:])
    loop_ipf = np.median(counts["gemm loop"]) / flops["gemm loop"] if counts.get("gemm loop") else None
    for name, clocks in timed.figures.items():
        wall, cpu = clocks["wall"], clocks["cpu"]
        figures = {"time": wall.scaled(1e3, "ms"), "cpu_time": cpu.scaled(1e3, "ms"),
                   "gflops": wall.rate(flops[name] / 1e9, "GFLOP/s"),
                   "gflops_cpu": cpu.rate(flops[name] / 1e9, "GFLOP/s")}
        metrics = {"interleave.positions": timed.positions(name), "wall_over_cpu": wall.median / cpu.median}
        if counts.get(name):  # exact: instructions on this ISA, per FLOP of the kernel's own count
            figures["instructions"] = Figure.of(counts[name], "instructions")
            figures["instructions_per_flop"] = Figure.of([c / flops[name] for c in counts[name]], "instructions/FLOP")
            if loop_ipf:
                metrics["instructions_vs_reference_loop"] = float(np.median(counts[name]) / flops[name] / loop_ipf)
            if target in FMA_IDEAL:
                metrics |= fma_ideal_metrics(name, float(np.median(counts[name]) / flops[name]), target)
        yield Record("native_bench", f"ratios/{name}", "measure", figures=figures, metrics=metrics,
                     work={"flops": flops[name], "flop_count": flop_count(name, blas),
                           "timer": f"the library's process on this host, around {repeat} product(s) per call, "
                                    "per product" if name in blas else "the host's thread clock around the torch call"
                           if name.startswith("torch") else "the program's own clocks on the device, around the kernel call",
                           **({"reference": blas[name]} if name in blas else {})},
                     params=params | {"kernel": name}, evidence=evidence.get(name, []))
    # the reference per thread count: the chosen library's figures under the name the ratios divide by
    for label, pick in picks.items():
        clocks = timed.figures[pick.name]
        yield Record("native_bench", f"ratios/{label}", "measure",
                     figures={"time": clocks["wall"].scaled(1e3, "ms"), "cpu_time": clocks["cpu"].scaled(1e3, "ms"),
                              "gflops": clocks["wall"].rate(flops[pick.name] / 1e9, "GFLOP/s"),
                              "gflops_cpu": clocks["cpu"].rate(flops[pick.name] / 1e9, "GFLOP/s")},
                     metrics={"reference_library": pick.library, "reference_decided": pick.info["choice"]["decided"],
                              "reference_choice": pick.info["choice"]["says"],
                              "wall_over_cpu": clocks["wall"].median / clocks["cpu"].median},
                     work={"flops": flops[pick.name], "flop_count": "2 n^3", "what": pick.describe(),
                           "variant": pick.name, "reference": pick.info},
                     params=params | {"kernel": label})

    source = {label: pick.name for label, pick in picks.items()}  # "sgemm" -> the chosen library's variant

    def ratio(top: str, bottom: str, clock: str, of_time: bool) -> Figure:
        """Per repetition, of the two variants run in it: rate(top) / rate(bottom), or time(top) /
        time(bottom) (of_time: how much of the other's time the kernel takes)."""
        top, bottom = source.get(top, top), source.get(bottom, bottom)
        pairs = zip(timed.samples[top][clock], timed.samples[bottom][clock])
        per_rep = [t / u if of_time else (flops[top] / t) / (flops[bottom] / u) for t, u in pairs]
        return Figure.of(per_rep, "x")

    # (top, bottom, target, at most?, what)
    pairs = [(f"attention keys={keys[-1]}", f"attention keys={keys[0]}", KEYS_TARGET, False,
              f"chunk attention GFLOP/s at {keys[-1]} keys over {keys[0]} keys (issue 14)")]
    spin = None
    if here:
        library = f"sgemm's, the faster library here per thread count ({picks['sgemm'].describe()})"
        pairs += [(f"attention keys={n}", "sgemm", ATTENTION_TARGET, False,
                   f"chunk attention GFLOP/s at {n} keys over {library}") for n in keys]
        for tokens, kda in gdn_cases:
            case = _gdn_name(tokens, kda)
            pairs.append((f"gdn chunkwise {case}", "sgemm", KDA_SGEMM_TARGET if kda else SGEMM_TARGET, False,
                          f"GDN chunkwise GFLOP/s (work really done, gdn_chunkwise_flops) over {library}"))
            if ggml:
                pairs.append((f"gdn chunkwise {case}", f"ggml {case}", GGML_KDA_TARGET if kda else GGML_TARGET, True,
                              "GDN chunkwise's time over ggml's CPU GATED_DELTA_NET's (tb_ggml_gdn), same inputs"))
            if torch_ref and not kda:
                pairs.append((f"gdn chunkwise {case}", f"torch {case}", torch_target(tokens), True,
                              "GDN chunkwise's time over transformers' torch_chunk_gated_delta_rule's, same inputs"))
        pairs.append(("gemm", SGEMM_1 if cfg.threads > 1 else "sgemm", gemm_target(), False,
                      f"tb_gemm at {r.gemm}^3 over {library} at {r.sgemm}^3, both on one thread"))
        chosen = picks["sgemm"]
        cpu_1 = timed.figures[chosen.one_thread]["cpu"].median  # the same library on one thread
        # spinning, and OpenBLAS on a kernel narrower than the targets may use (an environment forcing
        # one): no target judged
        spin = blas_reference.spinning(timed.figures[chosen.name]["cpu"].median, cpu_1, cfg.threads) | chosen.rule
        why = blas_reference.refusal(spin, cfg.threads)
        if why:
            ctx.progress(f"native_bench ratios: vs sgemm: {why}")
    pairs += [(name[:-len(ONE)], name, THREADS_TARGET, True,
               f"the call's time on {cfg.threads} threads over its time on one: by the CPU clock, what the threads "
               f"cost beyond the work (the pool's wake-ups, the split); by the wall clock, the speed-up")
              for name in variants if name.endswith(ONE)]
    # every anchor built or run at its best here: ggml for this CPU, torch with its version and threads
    anchors = {"ggml": {"build": "llama.cpp's ggml, GGML_NATIVE=ON: built for this CPU (testbed.backends.llamacpp)",
                        "cpu_isa": blas_reference.cpu_isa()} if ggml else None,
               "torch": {"version": torch_ref[0].__version__, "threads": cfg.threads,
                         "cpu_capability": torch_ref[0].backends.cpu.get_cpu_capability()} if torch_ref else None}
    anchors = {k: v for k, v in anchors.items() if v}
    for top, bottom, target, at_most, text in pairs:
        wall, cpu = ratio(top, bottom, "wall", at_most), ratio(top, bottom, "cpu", at_most)
        library = bottom in ("sgemm", SGEMM_1)
        medians = {"cpu": cpu.median, "wall": wall.median}
        if target is None:
            metrics = {"target": None}
        elif at_most:
            metrics = {"target": target, "target_is": "at most",
                       **{f"meets_target_{clock}": bool(x <= target) for clock, x in medians.items()},
                       "short_by_cpu": blas_reference.shortfall(cpu.median, target, at_most=True)}
        else:
            metrics = blas_reference.judge(target, medians, spin if library else None, cfg.threads) | {
                "target_is": "at least"}
            metrics["short_by_cpu"] = (blas_reference.shortfall(cpu.median, target, at_most=False)
                                       if metrics["meets_target_cpu"] is not None else None)
        if library:  # beside the reference's ratio, the same over each candidate library (CPU, median)
            for lib in best.candidates:
                under = blas_reference.variant_name("sgemm", lib, bottom == SGEMM_1 and cfg.threads > 1)
                metrics[f"ratio_cpu_vs_{lib}"] = ratio(top, under, "cpu", at_most).median
        yield Record("native_bench", f"ratios/{top} vs {bottom}", "measure",
                     figures={"ratio": wall, "ratio_cpu": cpu}, metrics=metrics,
                     work={"what": text, "ratio": "per repetition, of the two variants run in it; median, min, max",
                           **({"reference": picks[bottom].info} if library else {}),
                           **({"reference": anchors[bottom.split()[0]]} if bottom.split()[0] in anchors else {})},
                     params=params | {"kernel": "ratio", "top": top, "bottom": bottom},
                     # the ratio is of the device's own clocks: the evidence of the two runs it divides
                     evidence=evidence.get(top, [])[-1:] + evidence.get(bottom, [])[-1:])
    for name, note in (("ggml", ggml_note), ("torch", torch_note)):
        if note and here:
            yield Record("native_bench", f"ratios/{name} reference", "measure", figures={},
                         metrics={"reference_missing": note}, params=params | {"kernel": f"{name} reference"})


def ab_calls(cfg: DictConfig) -> list:
    """The ratios' measured kernel calls for `testbed ab` (one timed call per program run, the build
    `fused` asks for): chunk attention at each ratios.key_counts, GDN chunkwise at each ratios.gdn.tokens
    and gate, and tb_gemm at ratios.gemm^3, on the inputs ratio_records draws."""
    from testbed.backends.native.device import Call

    a, r, b = cfg.attention, cfg.ratios, cfg.bench
    rng = np.random.default_rng([cfg.seed, 14])
    timed = [f"threads={cfg.threads}", f"warmup={b.warmup}", "reps=1"]
    calls = []
    for n_keys in sorted(set(as_list(r.key_counts))):
        q = rng.standard_normal((a.heads, a.chunk, a.head_dim)).astype(np.float32)
        k = rng.standard_normal((a.kv_heads, n_keys, a.head_dim)).astype(np.float32)
        v = rng.standard_normal((a.kv_heads, n_keys, a.head_dim)).astype(np.float32)
        mask = gemma.attention_mask(np.arange(n_keys - a.chunk, n_keys), np.arange(n_keys), cfg.cache.window, a.heads,
                                    "global")
        calls.append(Call(f"attention keys={n_keys}", "tb_attention_bench", {"q": q, "k": k, "v": v, "mask": mask},
                          ["{inputs}", ".", "form=chunk", *timed], ["out"],
                          {"flops": attention_flops(a.heads, a.chunk, n_keys, a.head_dim)}))
    g = r.gdn
    chunk = g.chunk or auto_chunk(g.head_size)
    for tokens in sorted(set(as_list(g.tokens))):
        for kda in sorted(set(as_bools(g.kda))):
            x = gdn.draw_inputs(1, tokens, g.heads, g.head_size, kda=kda, seed=cfg.seed)
            calls.append(Call(f"gdn chunkwise {_gdn_name(tokens, kda)}", "tb_gdn_bench",
                              dict(zip(GDN_INPUTS, x.arrays())),
                              ["{inputs}", ".", "form=chunkwise", f"chunk={g.chunk or 'auto'}", "head_map=tiled",
                               *timed], ["out", "state"],
                              {"flops": gdn.gdn_chunkwise_flops(1, tokens, g.heads, g.head_size, chunk, kda)}))
    m = np.random.default_rng([cfg.seed, 14, r.gemm]).standard_normal((r.gemm, r.gemm)).astype(np.float32)
    calls.append(Call("gemm", "tb_gemm_bench", {"a": m, "b": m, "c": np.zeros_like(m)},
                      ["{inputs}", ".", "form=gemm", "threads=1", f"warmup={b.warmup}", "reps=1"], ["c"],
                      {"flops": 2 * r.gemm**3}))
    return calls


def gemm_target() -> float:
    """tb_gemm's goal over the best library's sgemm: GEMM_TARGET on the CPU's widest ISA, AVX2_GEMM_TARGET
    where TB_ISA forces the kernels (and the reference, like for like) onto AVX2."""
    return AVX2_GEMM_TARGET if blas_reference.target_isa() == "avx2" else GEMM_TARGET


def fma_ideal_metrics(name: str, instructions_per_flop: float, target: str) -> dict:
    """A kernel's exact instructions per FLOP over its ISA's FMA ideal (FMA_IDEAL), with its goal
    (IDEAL_TARGETS: at most) judged: met, or short_by the factor it must still shed."""
    ideal, what = FMA_IDEAL[target]
    over = instructions_per_flop / ideal
    goal = next((t for prefix, t in IDEAL_TARGETS if name.startswith(prefix)), None)
    metrics = {"fma_ideal_instructions_per_flop": ideal, "fma_ideal": what, "instructions_vs_fma_ideal": over}
    if goal is not None:
        metrics |= {"fma_ideal_target": goal, "meets_fma_ideal_target": bool(over <= goal),
                    "fma_ideal_short_by": blas_reference.shortfall(over, goal, at_most=True)}
    return metrics


def flop_count(name: str, blas: dict) -> str:
    if name.startswith(("gdn", "ggml", "torch")):
        return ("gdn_chunkwise_flops: the work the chunkwise form really does (GDN chunkwise at its chunk, ggml and "
                "torch at torch's chunk 64: a common yardstick; their ratios are of times)")
    if name in blas or name.startswith("gemm"):
        return "2 n^3"
    return "4 heads rows keys head_dim (q k^T and p v)"


def torch_run(name: str, torch_ref, x, chunk: int, threads: int, outputs: dict):
    """A variant timing transformers' torch_chunk_gated_delta_rule on x by this thread's CPU clock
    (torch's intra-op threads: `threads`), its outputs in refimpl's layout (the state transposed)."""
    torch, fn = torch_ref
    q, k, v, g, beta, state = (torch.from_numpy(np.ascontiguousarray(arr)) for arr in x.arrays())
    initial = state.transpose(-1, -2).contiguous()

    def run() -> dict[str, float]:
        torch.set_num_threads(threads)
        cpu = time.thread_time if threads == 1 else time.process_time
        wall0, cpu0 = time.perf_counter(), cpu()
        with torch.no_grad():
            out, final = fn(q, k, v, g, beta, chunk_size=chunk, initial_state=initial, output_final_state=True)
        seconds = {"wall": time.perf_counter() - wall0, "cpu": cpu() - cpu0}
        outputs[name] = {"out": out.numpy(), "state": final.transpose(-1, -2).contiguous().numpy()}
        return seconds
    return run


def view(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for _, r in df[df["kind"] == "measure"].iterrows():
        if r.get("params.kernel") == "ratio" or str(r.get("params.kernel")).endswith(" reference"):
            note = r.get("metrics.target_refused")
            note = note if isinstance(note, str) else r.get("metrics.reference_missing")
            target = r.get("metrics.target")
            rows.append({"device": r["device"], "case": r["case"], "threads": r.get("params.threads"),
                         "fused": r.get("params.fused"),
                         "ratio (CPU)": r.get("figures.ratio_cpu.median"),
                         "min": r.get("figures.ratio_cpu.min"), "max": r.get("figures.ratio_cpu.max"),
                         "ratio (wall)": r.get("figures.ratio.median"),
                         "target": None if target is None or target != target
                         else f"{'<=' if r.get('metrics.target_is') == 'at most' else '>='} {target}",
                         "meets (CPU)": r.get("metrics.meets_target_cpu"),
                         "short by (CPU)": r.get("metrics.short_by_cpu"),
                         "reference": r.get("metrics.reference_library"),
                         "reference CPU / 1 thread": r.get("metrics.reference_cpu_over_1thread"),
                         "note": note if isinstance(note, str) else None})
            continue
        is_cache = r.get("params.kernel") == "sliding_cache"
        chosen = r.get("metrics.reference_choice")  # the reference's own row: which library, how sure
        rows.append({"device": r["device"], "case": r["case"], "threads": r.get("params.threads"),
                     "fused": r.get("params.fused"),
                     "time": r.get("figures.time.median"), "unit": r.get("figures.time.unit"),
                     "GFLOP/s": None if is_cache else r.get("figures.gflops.median"),
                     "GFLOP/s (CPU)": r.get("figures.gflops_cpu.median"), "wall / CPU": r.get("metrics.wall_over_cpu"),
                     "x decode": None if is_cache else r.get("metrics.speedup_vs_decode"),
                     "outside kernel ms": None if is_cache else r.get("figures.outside_kernel.median"),
                     "GB/s": r.get("figures.bandwidth.median"),
                     "instructions / FLOP": r.get("figures.instructions_per_flop.median"),
                     "x FMA ideal": r.get("metrics.instructions_vs_fma_ideal"),
                     "FMA goal": r.get("metrics.fma_ideal_target"),
                     "short by": r.get("metrics.fma_ideal_short_by"),
                     "vs reference loop": r.get("metrics.instructions_vs_reference_loop"),
                     "rollback / decode step": r.get("metrics.rollback_vs_decode_step") if is_cache else None,
                     "note": f"{r.get('work.what')}; {chosen}" if isinstance(chosen, str) else None,
                     "samples": tables.samples(r)})
    return pd.DataFrame(rows)
