"""Experiment `llamacpp`: llama.cpp's tools on a device (seed 002's gate and figure).

test   test-backend-ops -o OP -b BACKEND: one verdict per case and the run's tally ("36/36 OK")
perf   test-backend-ops perf: us/run and GB/s per case (the tool's means)
bench  llama-bench -p 512: prompt tokens per second (pp512) over its repetitions
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

import pandas as pd
from omegaconf import DictConfig

from testbed.config import Choice, Int
from testbed.errors import UsageError
from testbed.results import Record
from testbed.backends.llamacpp import runner as llamacpp


@dataclass(frozen=True)
class Name:
    """An op or backend name as the tool spells it (letters, digits, underscore), or empty."""

    def check(self, key: str, value: Any) -> None:
        if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_]*", value):
            raise UsageError(f"{key}={value!r} is not accepted; accepted: a name of letters, digits and _")


PARAMS = {
    "mode": Choice(("test", "perf", "bench", "all")),
    "op": Name(),
    "backend": Name(),
    "prompt": Int(1, 1 << 16),
    "threads": Int(0, 256),
    "reps": Int(1, 100),
}


def validate(cfg: DictConfig) -> None:
    """The device must name the tools this mode runs (checked before connecting)."""
    tools = cfg.device.get("tools") or {}
    needed = (["test-backend-ops"] if cfg.mode in ("test", "perf", "all") else []) + \
             (["llama-bench"] if cfg.mode in ("bench", "all") and cfg.gguf else [])
    missing = [t for t in needed if not tools.get(t)]
    if missing:
        raise UsageError(f"device={cfg.device.name} has no tools.{missing[0]} in devices/{cfg.device.name}.yaml; "
                         f"devices with llama.cpp tools: hexagon, or add the path to the profile")


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    device = ctx.device
    backend = cfg.backend or device.profile.accelerators.get("backend") or "CPU"
    if cfg.mode in ("test", "all"):
        ctx.progress(f"test-backend-ops -o {cfg.op} -b {backend}")
        report, problems = llamacpp.test_backend_ops(device, cfg.op, backend)
        yield from llamacpp.test_records("llamacpp", cfg.op, backend, report, problems)
    if cfg.mode in ("perf", "all"):
        ctx.progress(f"test-backend-ops perf -o {cfg.op} -b {backend}")
        yield from llamacpp.perf_records(device, "llamacpp", cfg.op, backend)
    if cfg.mode in ("bench", "all") and cfg.gguf:
        threads = cfg.threads or max(device.profile.threads)
        ctx.progress(f"llama-bench -p {cfg.prompt} -t {threads}")
        yield from llamacpp.llama_bench_records(device, "llamacpp", cfg.gguf, cfg.prompt, threads, cfg.reps)


def view(df: pd.DataFrame) -> pd.DataFrame:
    """Tallies and failing cases, then figures: us/run and GB/s per perf case, tokens/s per bench."""
    rows = []
    for _, r in df.iterrows():
        if r["kind"] == "oracle" and (r["case"].endswith("/tally") or r["verdict"] != "pass"):
            rows.append({"device": r["device"], "case": r["case"], "verdict": r["verdict"],
                         "result": r.get("metrics.tally") or r.get("detail")})
        elif r["kind"] == "measure":
            tps = r.get("figures.tokens_per_s.median")
            rows.append({"device": r["device"], "case": r["case"], "verdict": "",
                         "result": (f"{tps:.1f} tokens/s" if pd.notna(tps) else
                                    f"{r.get('figures.time.median'):.2f} us/run, "
                                    f"{r.get('figures.bandwidth.median', float('nan')):.2f} GB/s")})
    return pd.DataFrame(rows)
