"""Timing: warm-up, then repetitions, each timed with a monotonic clock. Returns a Figure in seconds.

A stop (SIGINT, SIGTERM, SIGHUP: testbed.stop) is looked at before every call, so a run in a worker
thread (testbed nightly) stops after the call it is in, not after all its repetitions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Hashable

import numpy as np

from testbed.heartbeat import Tick
from testbed.results import Figure
from testbed.stop import raise_if_stopped


def time_call(fn: Callable[[], object], reps: int = 5, warmup: int = 1) -> Figure:
    for _ in range(warmup):
        raise_if_stopped()
        fn()
    samples = []
    for _ in range(reps):
        raise_if_stopped()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return Figure.of(samples, "s")


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def host_clocks(fn: Callable[[], object]) -> dict[str, float]:
    """Seconds `fn` took on both clocks: wall, and this process's CPU time (on a shared machine,
    what the work itself cost, whatever else ran)."""
    start = {c: clock() for c, clock in CLOCKS.items()}
    fn()
    return {c: clock() - start[c] for c, clock in CLOCKS.items()}


def interleaved_order(keys: list[Hashable], reps: int, seed: int | None) -> list[list[Hashable]]:
    """Per repetition, every key once. Without a seed, in the given order each time (A B A B);
    with one, each repetition shuffled by numpy's generator seeded [seed, rep], so a drift within a
    repetition (load rising while it runs) does not fall on the same variant each time."""
    if seed is None:
        return [list(keys) for _ in range(reps)]
    return [[keys[i] for i in np.random.default_rng([seed, rep]).permutation(len(keys))] for rep in range(reps)]


@dataclass
class Interleaved:
    """Variants timed interleaved: their samples per clock, in repetition order; the order they ran in."""

    samples: dict[Hashable, dict[str, list[float]]]  # per variant and clock, seconds, one per repetition
    order: list[list[Hashable]]  # per repetition, the variants in the order they were timed
    seed: int | None             # the shuffle's seed (None: the given order every repetition)

    @property
    def figures(self) -> dict[Hashable, dict[str, Figure]]:
        """Per variant and clock, a Figure in seconds (median, min, max, reps)."""
        return {key: {c: Figure.of(s, "s") for c, s in by_clock.items()} for key, by_clock in self.samples.items()}

    def positions(self, key: Hashable) -> list[int]:
        """Where `key` ran in each repetition (0 = first)."""
        return [rep.index(key) for rep in self.order]


def time_interleaved(fns: dict[Hashable, Callable[[], object]], reps: int = 5, warmup: int = 1,
                     seed: int | None = None, timer: Callable[[Callable[[], object]], dict[str, float]] = host_clocks,
                     progress: Callable[[str], None] | None = None, what: str = "timing") -> Interleaved:
    """Time several variants with their repetitions interleaved: every repetition runs each variant
    once (interleaved_order), so slow drifts of a noisy machine (thermal, other load) fall on all of
    them alike; compare their ratios. `timer` runs a variant and returns its seconds per clock: the
    host's clocks around the call, or a device program's own clocks read from what it returns.
    `progress` hears each timed call as a heartbeat Tick ("WHAT: call 5/40"): a bench of minutes says
    how far it is, and how long it has left, without a log line per call."""
    order = interleaved_order(list(fns), reps, seed)
    for _ in range(warmup):
        for fn in fns.values():
            raise_if_stopped()
            fn()
    samples: dict[Hashable, dict[str, list[float]]] = {key: {} for key in fns}
    calls, done = reps * len(fns), 0
    for rep in order:
        for key in rep:
            raise_if_stopped()
            done += 1
            if progress is not None:
                progress(Tick(f"{what}: call {done}/{calls}"))
            for clock, seconds in timer(fns[key]).items():
                samples[key].setdefault(clock, []).append(seconds)
    return Interleaved(samples, order, seed)


def time_alternating_clocks(fns: dict[str, Callable[[], object]], reps: int = 5, warmup: int = 1,
                            progress: Callable[[str], None] | None = None,
                            what: str = "timing") -> dict[str, dict[str, Figure]]:
    """time_interleaved in the given order every repetition (A B A B ...): per variant, wall and CPU."""
    return time_interleaved(fns, reps, warmup, progress=progress, what=what).figures


def time_alternating(fns: dict[str, Callable[[], object]], reps: int = 5, warmup: int = 1) -> dict[str, Figure]:
    """time_alternating_clocks' wall-clock figures."""
    return {name: clocks["wall"] for name, clocks in time_alternating_clocks(fns, reps, warmup).items()}


def cpu_seconds() -> float:
    """CPU seconds this process and the programs it ran (device programs, compilers, emulators) have
    used so far: what a night or an A/B job cost the host, whatever else ran beside it."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
