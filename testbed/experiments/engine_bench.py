"""Experiment `engine_bench`: the model engine's rates on the device, as ratios measured in one run.

Builds: `fused=false` (default) the unfused programs, bit-exact across targets; `fused=true` the FMA
build (faster, rounds once per multiply-add: judged by tolerance). Either way every run's logits (the
chunk call's selected row and the decode path's) are checked against the float64 model
(refimpl.gemma.prefill_at on the weights the engine computes with) by NMSE, one oracle record per
run set; each record names the build (`fused`) and the matrix products' micro-kernel (`gemm_isa`,
chosen at run time, TB_ISA forces one).

matmul_vs_sgemm   (this host) a chunk call's weight matrix products (the engine's own timer around
                  them) in GFLOP/s, over the best library's sgemm (the faster of OpenBLAS and oneMKL
                  where installed, each timed on them; testbed.measure.blas_reference) doing
                  the SAME products: every layer's q, k, v, o, gate, up, down on the chunk's C rows
                  with the model's float32 weights (the dequantised ones for f16 / int8), and the LM
                  head on one row, on the engine's thread count. Interleaved in one job: per
                  repetition one engine program run (reps=1) and the library's products, in an order
                  shuffled per repetition; at threads > 1 the products on one thread too, for the
                  spinning rule (reference_spinning: the library's CPU time per call above 1.2x its
                  1-thread figure; then no target is judged).
matmul_vs_own_gemm  (a device: no numpy there) the same engine products over the project's own
                  unfused gemm_nn at the chunk's widest shape (C x hidden by hidden x mlp), timed in
                  the program's repetitions: a reference labelled as what it is, never called sgemm,
                  and no sgemm target judged from it.
decode_vs_stream  a decode step's time, over the time to read its weights once (every projection and
                  the tied LM head, in the weights' dtype) at the bandwidth of a streaming read of
                  256 MiB timed in the same repetition (over huge pages where the kernel grants them:
                  the memory's best rate); cold (bench.cold_mb > 0, the default): the
                  caches evicted before each timed step, as a step after other work finds them

Both by the wall clock and by the process's CPU clock (on a shared machine the CPU clock leaves out
the time other processes held the core): one record per clock, each with the other clock's figure of
the same calls beside it (never wall alone), and the exact instructions of a chunk call and a decode
step where they were counted (a device that counts; the host with counts=true, under valgrind). Each
ratio is computed per repetition and reported as median, min and max over them; beside it the ratio of
the best times (on a shared machine the best repetition is the least disturbed one). Measurements: the
configured targets are printed beside them (matmul_vs_sgemm also says whether it meets its target,
unless the reference spins).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from refimpl import gemma
from testbed.backends.native import build as kernel_build, engine
from testbed.config import Choice, Float, Int
from testbed.measure import blas_reference
from testbed.measure.timing import time_interleaved
from testbed.oracles.numerical import check_nmse
from testbed.oracles.tokens import TokenCase
from testbed.report import tables
from testbed.results import Figure, Record

PARAMS = {
    "backend": Choice(("native",)),
    "threads": Int(1, 256),
    "counts": Choice((False, True)),
    "weights": Choice(engine.WEIGHT_DTYPES),
    "fused": Choice((False, True)),
    "group": Int(1, 1 << 16),
    "chunk": Int(1, 4096),
    "past": Int(0, 1 << 20),
    "seed": Int(0),
    "shape.vocab": Int(2),
    "shape.hidden": Int(1),
    "shape.layers": Int(1),
    "shape.heads": Int(1),
    "shape.kv_heads": Int(1),
    "shape.head_dim": Int(2),
    "shape.mlp": Int(1),
    "shape.window": Int(1),
    "targets.matmul_vs_sgemm": Float(0.0),
    "targets.decode_vs_stream": Float(0.0),
    "bench.warmup": Int(0, 100),
    "bench.reps": Int(1, 1000),
    "bench.cold_mb": Int(0, 1 << 16),
}


def matmul_flops(cfg: gemma.GemmaConfig, rows: int) -> int:
    """The weight products of one call of `rows` rows: q, k, v, o, gate, up, down per layer, and the
    LM head on the one selected row."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return cfg.layers * 2 * rows * cfg.hidden * (2 * q + 2 * kv + 3 * cfg.mlp) + 2 * cfg.hidden * cfg.vocab


def engine_products(model: gemma.GemmaConfig, w: dict, rows: int, seed) -> list[tuple]:
    """The chunk call's weight products as (a, b, out) for numpy: per layer x [rows, in] times each
    weight [out, in] transposed (the engine's y = x w^T, the same layout: no copy), and the LM head
    (the tied embedding) on one row. Their FLOP count is matmul_flops(model, rows)."""
    rng = np.random.default_rng(seed)
    q = model.heads * model.head_dim
    x = {n: rng.standard_normal((rows, n)).astype(np.float32) for n in {model.hidden, q, model.mlp}}
    products = []
    for i in range(model.layers):
        for name, inputs in (("self_attn.q_proj", model.hidden), ("self_attn.k_proj", model.hidden),
                             ("self_attn.v_proj", model.hidden), ("self_attn.o_proj", q),
                             ("mlp.gate_proj", model.hidden), ("mlp.up_proj", model.hidden),
                             ("mlp.down_proj", model.mlp)):
            weight = np.ascontiguousarray(w[f"model.layers.{i}.{name}.weight"], np.float32)
            assert weight.shape[1] == inputs, (name, weight.shape)
            products.append((x[inputs], weight.T, np.empty((rows, weight.shape[0]), np.float32)))
    embed = np.ascontiguousarray(w["model.embed_tokens.weight"], np.float32)
    products.append((x[model.hidden][:1], embed.T, np.empty((1, model.vocab), np.float32)))
    return products


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    model = gemma.GemmaConfig(**OmegaConf.to_container(cfg.shape, resolve=True))
    w = gemma.init_weights(model, cfg.seed)
    prompt = np.random.default_rng(cfg.seed).integers(0, model.vocab, cfg.past + cfg.chunk)
    ctx.progress(f"engine_bench P={cfg.past} C={cfg.chunk} weights={cfg.weights}")
    # numpy's sgemm is the reference only where the engine ran: this host, not under emulation
    here = ctx.device.profile.transport == "local" and not ctx.device.profile.has("emulated")

    built = engine.program_for(ctx.device, bool(cfg.fused))
    runs: list[engine.ChunkRun] = []

    def program(warmup: int, reps: int) -> engine.ChunkRun:
        runs.append(engine.chunk_prefill(ctx.device, model, w, prompt, TokenCase(cfg.past, cfg.chunk, cfg.chunk),
                                         weights_dtype=cfg.weights, group=cfg.group, threads=cfg.threads,
                                         warmup=warmup, reps=reps, reference=True, program=built,
                                         cold_mb=cfg.bench.cold_mb))
        return runs[-1]

    flops = matmul_flops(model, cfg.chunk)
    if here:
        t, timings, evidence, library = host_interleaved(cfg, ctx, model, w, program)
    else:
        result = program(cfg.bench.warmup, cfg.bench.reps)
        timings, evidence, library = result.timings, [result.evidence.as_dict()], None
        t = {k: np.asarray(v, float) for k, v in timings.items() if k.endswith("seconds")}
    instructions = counted_instructions(cfg, ctx, runs, model, w, prompt, built)
    params = {"chunk": cfg.chunk, "past": cfg.past, "weights": cfg.weights, "threads": cfg.threads,
              "hidden": model.hidden, "layers": model.layers, "fused": bool(cfg.fused),
              # how the build computes (build.multiply_add): what ran, whatever fused asked for
              "multiply_add": kernel_build.build_info(built).get("multiply_add"),
              "gemm_isa": timings.get("gemm_isa")}
    yield logits_oracle(cfg, model, w, prompt, runs, params)
    m, n, k = timings["sgemm_shape"]
    own_shape = {"own_gemm_shape": [m, n, k],
                 "own_gemm": "the project's gemm_nn (kernels/tb_linalg.h, unfused) at the chunk's widest shape, "
                             "timed in the program's repetitions"}
    weight_bytes = engine.weights_stream_bytes(model, cfg.weights, cfg.group)
    # by the wall clock, and by the CPU clock (on a shared machine: without the time others held the core)
    for clock, suffix in (("wall", "seconds"), ("cpu", "cpu_seconds")):
        matmul = flops / t[f"matmul_{suffix}"] / 1e9
        own = 2 * m * n * k / t[f"sgemm_{suffix}"] / 1e9
        bandwidth = timings["stream_bytes"] / t[f"stream_{suffix}"] / 1e9
        stream_s = weight_bytes / (bandwidth * 1e9)
        decode_s = t[f"decode_{suffix}"]
        figures = {"matmul": Figure.of(matmul, "GFLOP/s"), "own_gemm": Figure.of(own, "GFLOP/s"),
                   "chunk_call": Figure.of(t[suffix], "s"),
                   # the other clock's figure beside this one, and exact counts where they were taken
                   "chunk_call_other_clock": Figure.of(t["cpu_seconds" if clock == "wall" else "seconds"], "s"),
                   **({"chunk_call_instructions": instructions["chunk"]} if instructions else {})}
        if library is not None:
            sgemm = flops / library["seconds"][clock] / 1e9
            ratio = matmul / sgemm  # per repetition: the engine run and the products of the same one
            median = float(np.median(ratio))
            metrics = blas_reference.judge(cfg.targets.matmul_vs_sgemm, {clock: median}, library["spin"], cfg.threads)
            if metrics[f"meets_target_{clock}"] is not None:
                metrics["short_by"] = blas_reference.shortfall(median, cfg.targets.matmul_vs_sgemm, at_most=False)
            yield Record("engine_bench", f"C={cfg.chunk}/matmul_vs_sgemm/{clock}", "measure",
                         figures={"ratio": Figure.of(ratio, "x"), "sgemm": Figure.of(sgemm, "GFLOP/s"), **figures},
                         metrics=metrics | {"target_is": "at least", "ratio_of_best": float(matmul.max() / sgemm.max()),
                                            "matmul_vs_own_gemm": float(np.median(matmul / own))},
                         work={"matmul_flops": flops, "sgemm": library["what"], "reference": library["info"],
                               "interleave.order": library["order"], **own_shape},
                         params=params | {"form": "matmul_vs_sgemm", "clock": clock}, evidence=evidence)
        else:
            yield Record("engine_bench", f"C={cfg.chunk}/matmul_vs_own_gemm/{clock}", "measure",
                         figures={"ratio": Figure.of(matmul / own, "x"), **figures},
                         metrics={"target": None, "reference": blas_reference.OWN_GEMM,
                                  "target_refused": "no sgemm target is judged from the project's own gemm "
                                                    f"(targets.matmul_vs_sgemm={cfg.targets.matmul_vs_sgemm} is "
                                                    "for a library sgemm, measured on the host)",
                                  "ratio_of_best": float(matmul.max() / own.max())},
                         work={"matmul_flops": flops, **own_shape},
                         params=params | {"form": "matmul_vs_own_gemm", "clock": clock}, evidence=evidence)
        decode_median = float(np.median(decode_s / stream_s))
        yield Record("engine_bench", f"decode_vs_stream/{clock}", "measure",
                     figures={"ratio": Figure.of(decode_s / stream_s, "x"), "decode_step": Figure.of(decode_s, "s"),
                              "decode_step_other_clock": Figure.of(t["decode_cpu_seconds" if clock == "wall"
                                                                     else "decode_seconds"], "s"),
                              "stream": Figure.of(stream_s, "s"), "bandwidth": Figure.of(bandwidth, "GB/s"),
                              **({"decode_step_instructions": instructions["decode"]} if instructions else {})},
                     metrics={"target": cfg.targets.decode_vs_stream, "target_is": "at most",
                              f"meets_target_{clock}": bool(decode_median <= cfg.targets.decode_vs_stream),
                              "short_by": blas_reference.shortfall(decode_median, cfg.targets.decode_vs_stream,
                                                                   at_most=True),
                              "ratio_of_best": float(decode_s.min() / stream_s.min())},
                     work={"weight_bytes": weight_bytes, "stream_bytes": timings["stream_bytes"],
                           "decode": f"cold: caches evicted ({cfg.bench.cold_mb} MiB written and read) before each "
                                     "timed step" if cfg.bench.cold_mb else "warm: right after the chunk call"},
                     params=params | {"form": "decode_vs_stream", "clock": clock, "cold": bool(cfg.bench.cold_mb)},
                     evidence=evidence)


def counted_instructions(cfg: DictConfig, ctx, runs, model, w, prompt, built) -> dict[str, Figure]:
    """Exact instructions per chunk call and per decode step (the engine program's marks): what the
    timed runs counted on a device that counts, or on the host with counts=true one more run under
    valgrind, apart from the timed ones (its own figures, never a time). Empty where nothing counted."""
    counted = next((r.counts for r in runs if r.counts), None)
    if counted is None and cfg.counts and not ctx.device.profile.has("counts"):
        ctx.progress("engine_bench: counting a chunk call's and a decode step's instructions under valgrind")
        counted = engine.chunk_prefill(ctx.device, model, w, prompt, TokenCase(cfg.past, cfg.chunk, cfg.chunk),
                                       weights_dtype=cfg.weights, group=cfg.group, threads=cfg.threads, warmup=0,
                                       reps=1, program=built, count=True).counts
    if not counted:
        return {}
    return {region: Figure.of(counted.of(region), "instructions") for region in ("chunk", "decode")}


def logits_oracle(cfg: DictConfig, model, w, prompt, runs, params) -> Record:
    """Every timed run computed the model: its chunk call's selected logits and its decode path's
    logits (the same position, past + chunk - 1) against the float64 model on the weights the engine
    computes with, by NMSE (the worst run counts)."""
    weights = engine.dequantized(w, cfg.weights, cfg.group) if cfg.weights != "f32" else w
    w64 = {name: np.asarray(a, np.float64) for name, a in weights.items()}
    want = gemma.prefill_at(w64, model, np.asarray(prompt[:cfg.past + cfg.chunk]), cfg.past + cfg.chunk - 1)[0]
    verdicts = [check_nmse({"chunk_logits": want, "decode_logits": want},
                           {"chunk_logits": r.call_logits[-1], "decode_logits": r.decode_logits}) for r in runs]
    worst = min(verdicts, key=lambda v: v.margin if v.margin is not None else float("-inf"))
    passed = all(v.passed for v in verdicts)
    return Record("engine_bench", f"C={cfg.chunk}/logits", "oracle", worst.oracle, "pass" if passed else "fail",
                  worst.margin, worst.metrics | {"runs": len(runs)}, params=params,
                  detail=worst.detail, evidence=[runs[-1].evidence.as_dict()])


def host_interleaved(cfg: DictConfig, ctx, model, w, program):
    """This host: per repetition one engine program run (one timed chunk call, decode step, own gemm
    and streaming read) and numpy's sgemm on the engine's products, on cfg.threads threads and (for
    the spinning rule, at threads > 1) on one, in an order shuffled per repetition. Returns the
    program's timings per repetition, its first run's other timings, the runs' evidence, and the
    library reference (seconds per clock and repetition, spinning verdict, what ran)."""
    reference = engine.dequantized(w, cfg.weights, cfg.group) if cfg.weights != "f32" else w
    products = engine_products(model, reference, cfg.chunk, [cfg.seed, 21])
    runs: list[engine.ChunkRun] = []

    def engine_run() -> dict[str, float]:
        runs.append(program(cfg.bench.warmup, 1))
        return {"wall": runs[-1].timings["matmul_seconds"][0], "cpu": runs[-1].timings["matmul_cpu_seconds"][0]}

    repeat = blas_reference.repeats_for(products)
    best = blas_reference.BestReference(products, cfg.threads, repeat)
    variants = {"engine": engine_run, **best.variants()}
    ctx.progress(f"engine_bench: {', '.join(variants)} interleaved, {cfg.bench.reps} repetitions")
    for name, fn in variants.items():
        if name != "engine":  # each program run warms itself up (bench.warmup calls before its timed one)
            fn()
    timed = time_interleaved(variants, reps=cfg.bench.reps, warmup=0, seed=cfg.seed, timer=lambda run: run())
    t = {key: np.asarray([r.timings[key][0] for r in runs], float)
         for key in runs[0].timings if key.endswith("seconds")}
    # the faster library on these products at the engine's thread count is the reference
    pick = best.pick(timed.samples)
    ctx.progress(f"engine_bench reference: {pick.describe()}; {pick.info['choice']['says']}")
    seconds = {clock: np.asarray(pick.samples[clock], float) for clock in ("wall", "cpu")}
    one = timed.samples[pick.one_thread]["cpu"]
    info = pick.info
    # spinning, and OpenBLAS on a kernel narrower than the targets may use (an environment forcing
    # one): no target judged
    spin = blas_reference.spinning(float(np.median(seconds["cpu"])), float(np.median(one)), cfg.threads) | pick.rule
    why = blas_reference.refusal(spin, cfg.threads)
    if why:
        ctx.progress(f"engine_bench matmul_vs_sgemm: {why}")
    library = {"seconds": seconds, "spin": spin, "info": info, "order": timed.order,
               "what": f"{pick.describe()}, in a process of its own: float32 products of the chunk call's shapes: "
                       f"{len(products)} products ({model.layers} layers x q k v o gate up down, and the LM head "
                       f"on one row), {'dequantised ' if cfg.weights != 'f32' else ''}model weights, "
                       f"{cfg.threads} thread(s); each timed call repeats them {repeat} time(s), per-time seconds"}
    return t, runs[0].timings, [r.evidence.as_dict() for r in runs], library


def view(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for _, r in df[df["kind"] == "measure"].iterrows():
        rows.append({"device": r["device"], "case": r["case"], "weights": r.get("params.weights"),
                     "ratio": r.get("figures.ratio.median"), "min": r.get("figures.ratio.min"),
                     "max": r.get("figures.ratio.max"), "best / best": r.get("metrics.ratio_of_best"),
                     "target": f"{r.get('metrics.target_is')} "
                                                                    f"{r.get('metrics.target')}",
                     "engine": r.get("figures.matmul.median") if "matmul" in r["case"]
                     else r.get("figures.decode_step.median"),
                     "reference": (r.get("figures.sgemm.median") if "matmul_vs_sgemm" in r["case"]
                                   else r.get("figures.own_gemm.median")) if "matmul" in r["case"]
                     else r.get("figures.stream.median"),
                     "meets target": r.get("metrics.meets_target_" + str(r.get("params.clock"))),
                     "note": r.get("metrics.target_refused") if isinstance(r.get("metrics.target_refused"), str)
                     else None,
                     "unit": "GFLOP/s" if "matmul" in r["case"] else "s",
                     "instructions": r.get("figures.chunk_call_instructions.median") if "matmul" in r["case"]
                     else r.get("figures.decode_step_instructions.median"), "samples": tables.samples(r)})
    return pd.DataFrame(rows)
