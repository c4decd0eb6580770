"""Experiment `engine_bench`: the model engine's rates on the device, as ratios measured in one run.

matmul_vs_sgemm   a chunk call's weight matrix products (the engine's own timer around them) in
                  GFLOP/s, over a plain float32 matrix product of the chunk's widest shape (C x hidden
                  by hidden x mlp, weights already transposed) timed in the same repetition
decode_vs_stream  a decode step's time, over the time to read its weights once (every projection and
                  the tied LM head, in the weights' dtype) at the bandwidth of a streaming read of
                  256 MiB timed in the same repetition

Both by the wall clock and by the process's CPU clock (one thread: the CPU clock leaves out the time
other processes held the core on a shared machine). Each ratio is computed per repetition (chunk call, decode step, sgemm and streaming read interleave
in the program), and reported as median, min and max over them; beside it the ratio of the best
times (on a shared machine the best repetition is the least disturbed one). Measurements, not
verdicts: the configured targets are printed beside them.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from refimpl import gemma
from testbed import tables
from testbed.backends.native import engine
from testbed.config import Choice, Float, Int
from testbed.results import Figure, Record
from testbed.token_oracle import TokenCase

PARAMS = {
    "backend": Choice(("native",)),
    "threads": Int(1, 256),
    "weights": Choice(engine.WEIGHT_DTYPES),
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
}


def matmul_flops(cfg: gemma.GemmaConfig, rows: int) -> int:
    """The weight products of one call of `rows` rows: q, k, v, o, gate, up, down per layer, and the
    LM head on the one selected row."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return cfg.layers * 2 * rows * cfg.hidden * (2 * q + 2 * kv + 3 * cfg.mlp) + 2 * cfg.hidden * cfg.vocab


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    model = gemma.GemmaConfig(**OmegaConf.to_container(cfg.shape, resolve=True))
    w = gemma.init_weights(model, cfg.seed)
    prompt = np.random.default_rng(cfg.seed).integers(0, model.vocab, cfg.past + cfg.chunk)
    ctx.progress(f"engine_bench P={cfg.past} C={cfg.chunk} weights={cfg.weights}")
    result = engine.chunk_prefill(ctx.device, model, w, prompt, TokenCase(cfg.past, cfg.chunk, cfg.chunk),
                                  weights_dtype=cfg.weights, group=cfg.group, threads=cfg.threads,
                                  warmup=cfg.bench.warmup, reps=cfg.bench.reps, reference=True)
    t = {k: np.asarray(v, float) for k, v in result.timings.items() if k.endswith("seconds")}
    m, n, k = result.timings["sgemm_shape"]
    params = {"chunk": cfg.chunk, "past": cfg.past, "weights": cfg.weights, "threads": cfg.threads,
              "hidden": model.hidden, "layers": model.layers}
    evidence = [result.evidence.as_dict()]
    weight_bytes = engine.weights_stream_bytes(model, cfg.weights, cfg.group)
    # by the wall clock, and by the CPU clock (on a shared machine: without the time others held the core)
    for clock, suffix in (("wall", "seconds"), ("cpu", "cpu_seconds")):
        matmul = matmul_flops(model, cfg.chunk) / t[f"matmul_{suffix}"] / 1e9
        sgemm = 2 * m * n * k / t[f"sgemm_{suffix}"] / 1e9
        bandwidth = result.timings["stream_bytes"] / t[f"stream_{suffix}"] / 1e9
        stream_s = weight_bytes / (bandwidth * 1e9)
        decode_s = t[f"decode_{suffix}"]
        yield Record("engine_bench", f"C={cfg.chunk}/matmul_vs_sgemm/{clock}", "measure",
                     figures={"ratio": Figure.of(matmul / sgemm, "x"), "matmul": Figure.of(matmul, "GFLOP/s"),
                              "sgemm": Figure.of(sgemm, "GFLOP/s"), "chunk_call": Figure.of(t[suffix], "s")},
                     metrics={"target": cfg.targets.matmul_vs_sgemm, "target_is": "at least",
                              "ratio_of_best": float(matmul.max() / sgemm.max())},
                     work={"matmul_flops": matmul_flops(model, cfg.chunk), "sgemm_shape": [m, n, k]},
                     params=params | {"form": "matmul_vs_sgemm", "clock": clock}, evidence=evidence)
        yield Record("engine_bench", f"decode_vs_stream/{clock}", "measure",
                     figures={"ratio": Figure.of(decode_s / stream_s, "x"), "decode_step": Figure.of(decode_s, "s"),
                              "stream": Figure.of(stream_s, "s"), "bandwidth": Figure.of(bandwidth, "GB/s")},
                     metrics={"target": cfg.targets.decode_vs_stream, "target_is": "at most",
                              "ratio_of_best": float(decode_s.min() / stream_s.min())},
                     work={"weight_bytes": weight_bytes, "stream_bytes": result.timings["stream_bytes"]},
                     params=params | {"form": "decode_vs_stream", "clock": clock}, evidence=evidence)


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
                     "reference": r.get("figures.sgemm.median") if "matmul" in r["case"]
                     else r.get("figures.stream.median"),
                     "unit": "GFLOP/s" if "matmul" in r["case"] else "s", "samples": tables.samples(r)})
    return pd.DataFrame(rows)
