"""Experiment `native_bench`: the native attention and sliding-cache kernels, measured as ratios.

attention  one chunk of C query rows against P past + C new keys, vs the same C rows as C decode
           calls (C = 1, each against the cache filled up to its own position): speedup.
rollback   the padded tail's extra cache work (snapshot before the padded append, rollback after it)
           on one layer's K and V at the model shape, vs one decode step of that layer's attention.

Every ratio is taken from timings interleaved in one run (testbed.measure.time_alternating).
Decode calls go through ctypes one by one, as an engine's step loop would; the per-call overhead
(microseconds) is included and small beside a call's work.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from refimpl import gemma
from testbed.config import Choice, Int
from testbed.errors import UsageError
from testbed.measure import time_alternating
from testbed.results import Record

PARAMS = {
    "backend": Choice(("native",)),
    "threads": Int(1, 256),
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
}


def validate(cfg: DictConfig) -> None:
    a, c = cfg.attention, cfg.cache
    if a.heads % a.kv_heads:
        raise UsageError(f"attention.heads={a.heads} is not a multiple of attention.kv_heads={a.kv_heads}")
    if c.real > a.chunk:
        raise UsageError(f"cache.real={c.real} exceeds attention.chunk={a.chunk}; accepted: 0..{a.chunk}")
    if c.window <= a.chunk + c.sink:
        raise UsageError(f"attention.chunk={a.chunk} does not fit the cache tail (window {c.window} - sink "
                         f"{c.sink}); padding needs window > chunk + sink")
    from testbed.backends.native import library as native

    native.library()


def attention_flops(heads: int, rows: int, keys: int, head_dim: int) -> int:
    """q k^T and p v over every key column the kernel computes: 2 multiply-adds per (row, key, dim)."""
    return 4 * heads * rows * keys * head_dim


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    from testbed.backends.native import library as native

    artifacts = native.build_info()
    a, c, b = cfg.attention, cfg.cache, cfg.bench
    rng = np.random.default_rng(cfg.seed)
    n_keys = a.past + a.chunk
    q = rng.standard_normal((a.heads, a.chunk, a.head_dim)).astype(np.float32)
    k = rng.standard_normal((a.kv_heads, n_keys, a.head_dim)).astype(np.float32)
    v = rng.standard_normal((a.kv_heads, n_keys, a.head_dim)).astype(np.float32)
    positions = np.arange(a.past, n_keys)
    mask = gemma.attention_mask(positions, np.arange(n_keys), c.window, a.heads, "global")
    scale = 1.0 / np.sqrt(a.head_dim)
    # decode step i sees the cache up to its own row: its mask row, cut to that length
    step_masks = [np.ascontiguousarray(mask[:, :, i:i + 1, :a.past + i + 1]) for i in range(a.chunk)]
    step_queries = [np.ascontiguousarray(q[:, i:i + 1]) for i in range(a.chunk)]

    def chunk_call():
        native.attention(q, k, v, mask, scale, threads=cfg.threads)

    def decode_calls():
        for i in range(a.chunk):
            native.attention(step_queries[i], k, v, step_masks[i], scale, threads=cfg.threads,
                             length=a.past + i + 1)

    ctx.progress("native_bench attention: chunk vs decode steps")
    times = time_alternating({"chunk": chunk_call, "decode_steps": decode_calls}, reps=b.reps, warmup=b.warmup)
    flops = {"chunk": attention_flops(a.heads, a.chunk, n_keys, a.head_dim),
             "decode_steps": sum(attention_flops(a.heads, 1, a.past + i + 1, a.head_dim) for i in range(a.chunk))}
    shape = f"heads={a.heads},kv={a.kv_heads},hd={a.head_dim},P={a.past},C={a.chunk}"
    for form, t in times.items():
        yield Record(
            "native_bench", f"attention/{shape}/{form}", "measure",
            figures={"time": t.scaled(1e3, "ms"), "tokens_per_s": t.rate(a.chunk, "tokens/s"),
                     "gflops": t.rate(flops[form] / 1e9, "GFLOP/s")},
            metrics={"speedup_vs_decode": times["decode_steps"].median / t.median},
            work={"flops": flops[form], "flop_count": "4 heads rows keys head_dim (q k^T and p v)",
                  "rows": a.chunk, "calls": 1 if form == "chunk" else a.chunk},
            params={"kernel": "attention", "form": form, "heads": a.heads, "kv_heads": a.kv_heads,
                    "head_dim": a.head_dim, "past": a.past, "chunk": a.chunk, "threads": cfg.threads},
            artifacts=artifacts,
        )

    # Rollback: one layer's K and V caches (float32 rows of head_dim per KV head), full window.
    ctx.progress("native_bench cache rollback vs one decode step")
    row_bytes = a.head_dim * 4
    full = rng.integers(0, 256, (2 * a.kv_heads, c.window, row_bytes), dtype=np.uint8)
    chunk_rows = rng.integers(0, 256, (2 * a.kv_heads, a.chunk, row_bytes), dtype=np.uint8)
    n_pad = a.chunk - c.real
    work = full.copy()

    def padded_with_rollback():
        work[:] = full  # the same starting cache every time (a copy of window rows, timed alike below)
        cache = native.SlidingCache(work, count=c.window, sink=c.sink)
        saved = cache.snapshot(c.real, n_pad)
        cache.append(chunk_rows)
        cache.rollback(n_pad, saved)

    def exact_append():
        work[:] = full
        native.SlidingCache(work, count=c.window, sink=c.sink).append(chunk_rows[:, :c.real])

    decode_step = step_queries[-1], step_masks[-1], a.past + a.chunk
    times = time_alternating(
        {"padded+rollback": padded_with_rollback, "exact_append": exact_append,
         "decode_step": lambda: native.attention(decode_step[0], k, v, decode_step[1], scale,
                                                 threads=cfg.threads, length=decode_step[2])},
        reps=b.reps, warmup=b.warmup)
    rollback_cost = max(times["padded+rollback"].median - times["exact_append"].median, 0.0)
    shape = f"window={c.window},sink={c.sink},real={c.real},pads={n_pad},kv={a.kv_heads},hd={a.head_dim}"
    for form, t in times.items():
        yield Record(
            "native_bench", f"cache/{shape}/{form}", "measure",
            figures={"time": t.scaled(1e6, "us")},
            metrics={"rollback_us": rollback_cost * 1e6,
                     "rollback_vs_decode_step": rollback_cost / times["decode_step"].median},
            work={"bytes_per_copy": int(full.nbytes), "what": {
                "padded+rollback": "cache reset copy + snapshot + padded append + rollback",
                "exact_append": "cache reset copy + unpadded append",
                "decode_step": f"one attention call, C=1 against {decode_step[2]} keys"}[form]},
            params={"kernel": "sliding_cache", "form": form, "window": c.window, "sink": c.sink, "real": c.real,
                    "pads": n_pad, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "threads": cfg.threads},
            artifacts=artifacts,
        )


def view(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for _, r in df[df["kind"] == "measure"].iterrows():
        is_cache = r.get("params.kernel") == "sliding_cache"
        rows.append({"device": r["device"], "case": r["case"], "threads": r.get("params.threads"),
                     "time": r.get("figures.time.median"), "unit": r.get("figures.time.unit"),
                     "GFLOP/s": None if is_cache else r.get("figures.gflops.median"),
                     "x decode": None if is_cache else r.get("metrics.speedup_vs_decode"),
                     "rollback / decode step": r.get("metrics.rollback_vs_decode_step") if is_cache else None})
    return pd.DataFrame(rows)
