"""Timing: warm-up, then repetitions, each timed with a monotonic clock. Returns a Figure in seconds."""

from __future__ import annotations

import time
from typing import Callable

from testbed.results import Figure


def time_call(fn: Callable[[], object], reps: int = 5, warmup: int = 1) -> Figure:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return Figure.of(samples, "s")


def time_alternating(fns: dict[str, Callable[[], object]], reps: int = 5, warmup: int = 1) -> dict[str, Figure]:
    """Time several variants with their repetitions interleaved (A B A B ...), so slow drifts of a
    noisy machine (thermal, other load) fall on all of them alike; compare their ratios."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: Figure.of(s, "s") for name, s in samples.items()}
