"""Experiment `transport`: the cost of the link to a device.

push     seconds to push size_mb of random bytes, including the on-device size and sha256 check
pull     seconds to pull them back, including the check
run      round trip of `true` (connection, shell, framing, exit code)

Rates are bytes over the median time; the push and pull verification is part of what is timed,
because every testbed transfer pays it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator

import pandas as pd
from omegaconf import DictConfig

from testbed.config import Int
from testbed.measure.timing import time_call
from testbed.report import tables
from testbed.results import Record

PARAMS = {"size_mb": Int(1, 4096), "reps": Int(1, 100)}


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    device = ctx.device
    size = cfg.size_mb << 20
    with tempfile.TemporaryDirectory(prefix="testbed-transport-") as tmp:
        src, back = Path(tmp) / "payload.bin", Path(tmp) / "back.bin"
        src.write_bytes(os.urandom(size))
        try:
            ctx.progress(f"push {cfg.size_mb} MiB x{cfg.reps}")
            push = time_call(lambda: device.push(src, "transport/payload.bin"), reps=cfg.reps, warmup=0)
            ctx.progress(f"pull {cfg.size_mb} MiB x{cfg.reps}")
            pull = time_call(lambda: device.pull("transport/payload.bin", back), reps=cfg.reps, warmup=0)
        finally:
            device.run(["rm", "-rf", "transport"], timeout=60)
    ctx.progress(f"run `true` x{cfg.reps * 4}")
    rtt = time_call(lambda: device.run(["true"], timeout=60), reps=cfg.reps * 4, warmup=0)
    for name, t in (("push", push), ("pull", pull)):
        yield Record("transport", name, "measure",
                     figures={"time": t, "rate": t.rate(size / 1e6, "MB/s")},
                     work={"bytes": size, "what": f"{name} of {cfg.size_mb} MiB with size and sha256 verified"},
                     params={"size_mb": cfg.size_mb})
    yield Record("transport", "run", "measure", figures={"time": rtt.scaled(1e3, "ms")},
                 work={"what": "round trip of `true`: shell, framing, exit status"})


def view(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for _, r in df.iterrows():
        rate = r.get("figures.rate.median")
        rows.append({"device": r["device"], "case": r["case"], "median": r["figures.time.median"],
                     "unit": r["figures.time.unit"], "min": r["figures.time.min"], "max": r["figures.time.max"],
                     "reps": r["figures.time.reps"], "MB/s": None if pd.isna(rate) else float(rate),
                     "samples": tables.samples(r)})
    return pd.DataFrame(rows)
