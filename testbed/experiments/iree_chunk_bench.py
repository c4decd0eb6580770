"""Experiment `iree_chunk_bench`: one chunk call against decode calls through IREE (seed 000).

The chunk graph (C rows against P cached positions) and the decode graph (one row against P) are
compiled for the target (through the artifact cache) and timed, by default with
iree-benchmark-module on .npy inputs, the command a device runs. The figure that matters is the
ratio: how many decode steps one chunk call costs. An utterance of n tokens is cheaper as one chunk
call than as n decode calls once n exceeds it. The seed measured 17.6 on a Mali GPU (4.58 s per
64-row chunk, 0.26 s per decode step); the record states both.

Two timers answer two questions (they differed up to 5x on the host):

  tool    iree-benchmark-module's own time per invocation: the module's work with its inputs already
          resident (imported once, outside the timing). The kernel's cost: what to compare with
          another compiler, another schedule or the seed's device figure.
  python  the in-process runtime, timed around the whole call: the inputs (the past K/V among them)
          marshalled from numpy and the outputs read back, every call. What an engine driving the
          module from the host pays per call; minus `tool`, the cost around the kernel.
  both    the two, alternated in one job, with that difference recorded per call.

Timing does not depend on the values, so the past K/V are seeded random numbers, not a prefill.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from refimpl import gemma
from testbed.backends.iree.graphs import gemma as graphs
from testbed.backends.iree.runtime import TargetRunner, benchmark_tool
from testbed.config import Choice, Float, Int
from testbed.experiments.chunk_prefill import PRESETS, _model_key, load_model
from testbed.measure.timing import time_alternating
from testbed.models.contract import pack_prefill_with_past
from testbed.report import tables
from testbed.results import Record

PARAMS = {
    "backend": Choice(("iree",)),
    "target": Choice(("host", "lavapipe")),
    "driver": Choice((None, "local-sync", "local-task", "vulkan")),
    "timer": Choice(("tool", "python", "both")),
    "past": Int(1, 1 << 16),
    "chunk": Int(1, 4096),
    "reps": Int(1, 1000),
    "warmup": Int(0, 100),
    "seed": Int(0),
    "model.preset": Choice(tuple(PRESETS)),
    "seed_figure.chunk_s": Float(0.0),
    "seed_figure.decode_s": Float(0.0),
}


def call_inputs(model: gemma.GemmaConfig, past: int, rows: int, seed: int) -> list[np.ndarray]:
    """One call's arguments in contract order: a seeded utterance of `rows` tokens at position
    `past`, host-built tables and masks, random past K/V."""
    rng = np.random.default_rng(seed)
    inp = gemma.chunk_inputs(model, rng.integers(0, model.vocab, rows), past, rows)
    ks = [rng.standard_normal((model.kv_heads, past, model.head_dim), np.float32) for _ in range(model.layers)]
    vs = [rng.standard_normal((model.kv_heads, past, model.head_dim), np.float32) for _ in range(model.layers)]
    return pack_prefill_with_past(model, inp, ks, vs)


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    model, w = load_model(*_model_key(cfg))[:2]
    run = TargetRunner(cfg.target, cfg.driver, progress=ctx.progress)
    calls = {
        "chunk_call": (graphs.prefill_with_past(model, w, cfg.chunk, cfg.past),
                       call_inputs(model, cfg.past, cfg.chunk, cfg.seed)),
        # decode_with_past's contract is prefill_with_past's at C = 1 without the select
        "decode_step": (graphs.decode_with_past(model, w, cfg.past), call_inputs(model, cfg.past, 1, cfg.seed)[:-1]),
    }
    sessions = {name: run.session(graph) for name, (graph, _) in calls.items()}
    timers = ("tool", "python") if cfg.timer == "both" else (cfg.timer,)
    times = {}
    for timer in timers:
        ctx.progress(f"timing chunk call and decode step ({timer})")
        if timer == "tool":
            times[timer] = {name: benchmark_tool(sessions[name].artifact, run.driver, args, reps=cfg.reps)
                            for name, (_, args) in calls.items()}
        else:
            times[timer] = time_alternating({name: (lambda s=sessions[name], a=args: s(*a))
                                             for name, (_, args) in calls.items()}, reps=cfg.reps, warmup=cfg.warmup)
    shape = {"layers": model.layers, "hidden": model.hidden, "heads": model.heads, "kv_heads": model.kv_heads,
             "head_dim": model.head_dim, "vocab": model.vocab}
    params = {"past": cfg.past, "chunk": cfg.chunk, "target": cfg.target, "driver": run.driver, **shape}
    seed = cfg.seed_figure
    for timer, timed in times.items():
        suffix = f"/{timer}" if len(times) > 1 else ""
        for name, rows in (("chunk_call", cfg.chunk), ("decode_step", 1)):
            flops = gemma.graph_flops(model, rows, cfg.past)
            around = {}
            if len(times) > 1 and timer == "python":  # the cost around the module: marshalling, readback
                around = {"around_module_s": timed[name].median - times["tool"][name].median}
            yield Record("iree_chunk_bench", f"P={cfg.past},C={cfg.chunk}/{name}{suffix}", "measure",
                         figures={"time": timed[name], "gflops": timed[name].rate(flops / 1e9, "GFLOP/s")},
                         metrics=around,
                         work={"flops": flops, "rows": rows, "keys": cfg.past + rows,
                               "flop_count": "refimpl.gemma.graph_flops"},
                         params=params | {"form": name, "timer": timer},
                         artifacts={"module": str(run.artifacts[calls[name][0].name].folder.name)})
        yield Record("iree_chunk_bench", f"P={cfg.past},C={cfg.chunk}/ratio{suffix}", "measure",
                     metrics={"decode_steps_per_chunk_call": timed["chunk_call"].median / timed["decode_step"].median,
                              "seed_decode_steps_per_chunk_call": seed.chunk_s / seed.decode_s,
                              "seed_target": seed.target, "seed_chunk": seed.chunk},
                     params=params | {"form": "ratio", "timer": timer})


def view(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for _, r in df.iterrows():
        if r["kind"] == "oracle":  # a run that broke leaves one "error" record saying why
            rows.append({"case": r["case"], "verdict": r["verdict"], "detail": r["detail"]})
            continue
        base = {"target": r.get("params.target"), "driver": r.get("params.driver"), "timer": r.get("params.timer"),
                "model": "L{} h{} hd{} V{}".format(*(int(r[f"params.{k}"]) for k in ("layers", "hidden", "head_dim",
                                                                                     "vocab"))),
                "case": r["case"]}
        if r.get("params.form") == "ratio":
            rows.append(base | {"decode steps per chunk call": r.get("metrics.decode_steps_per_chunk_call"),
                                "seed (Mali)": r.get("metrics.seed_decode_steps_per_chunk_call")})
        else:
            rows.append(base | {"ms": r["figures.time.median"] * 1e3, "min ms": r["figures.time.min"] * 1e3,
                                "max ms": r["figures.time.max"] * 1e3, "reps": r["figures.time.reps"],
                                "GFLOP/s": r.get("figures.gflops.median"), "samples": tables.samples(r)})
    return pd.DataFrame(rows)
