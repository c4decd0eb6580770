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


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_alternating_clocks(fns: dict[str, Callable[[], object]], reps: int = 5,
                            warmup: int = 1) -> dict[str, dict[str, Figure]]:
    """Time several variants with their repetitions interleaved (A B A B ...), so slow drifts of a
    noisy machine (thermal, other load) fall on all of them alike; compare their ratios. Each
    repetition on both clocks: wall, and this process's CPU time (on a shared machine, what the work
    itself cost, whatever else ran)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, dict[str, list[float]]] = {name: {c: [] for c in CLOCKS} for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = {c: clock() for c, clock in CLOCKS.items()}
            fn()
            for c, clock in CLOCKS.items():
                samples[name][c].append(clock() - start[c])
    return {name: {c: Figure.of(s, "s") for c, s in by_clock.items()} for name, by_clock in samples.items()}


def time_alternating(fns: dict[str, Callable[[], object]], reps: int = 5, warmup: int = 1) -> dict[str, Figure]:
    """time_alternating_clocks' wall-clock figures."""
    return {name: clocks["wall"] for name, clocks in time_alternating_clocks(fns, reps, warmup).items()}
