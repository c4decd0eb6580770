"""The library a kernel's rate is divided by, and when a ratio over it may be judged against a target.

A ratio "of sgemm" divides by the best library available at the same thread count: numpy's BLAS
(OpenBLAS on these hosts) on this host, limited to the kernel's threads through threadpoolctl
(`threadpool_limits(limits=N, user_api="blas")`), timed interleaved with the kernel in the same
job. Where numpy is not (a device), the project's own gemm may serve as a reference only under its
own name (`own_gemm`), never as sgemm: dividing by an unfused in-house product flatters the kernel
(engine_bench once reported 1.60 / 2.27 "of sgemm" that were 0.52 / 0.61 of OpenBLAS).

The spinning rule: OpenBLAS's extra threads spin-wait for work, and on a busy host they are
charged CPU time for it (at 2 threads on a loaded 2-core machine, several times the 1-thread CPU
time for the same product: a CPU-time ratio over it came out 3.80 where it was 0.46). So the
reference is also timed on ONE thread in the same job; when its CPU time per call at N threads is
more than SPIN_LIMIT times its 1-thread CPU time, the record says `reference_spinning: true` with
both figures and no target is judged from it (meets_target* stored as null, `target_refused` says why).

What ran is recorded beside every such figure (`blas_info`): threadpoolctl's internal_api, version,
architecture (the kernel OpenBLAS chose for this CPU) and num_threads, and the OPENBLAS_* variables
of the environment (never changed here: some machines set OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE).
"""

from __future__ import annotations

import os
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import numpy as np


SPIN_LIMIT = 1.2  # CPU time per call at N threads over the 1-thread CPU time above which the reference spins
OWN_GEMM = "own_gemm"  # the label of the project's own product where it is the only reference (a device)


@lru_cache(maxsize=1)
def _controller():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def numpy_first(blas: list[dict]) -> list[dict]:
    """threadpoolctl's BLAS libraries with numpy's own first (the one under numpy's package or its
    numpy.libs): it lists them in load order, and scipy (imported by transformers) or torch may have
    loaded another OpenBLAS first, of another version."""
    home = Path(np.__file__).resolve().parent
    mine = (str(home) + os.sep, str(home.parent / "numpy.libs") + os.sep)
    return sorted(blas, key=lambda m: not str(m.get("filepath", "")).startswith(mine))


def blas_info(threads: int | None = None) -> dict:
    """numpy's BLAS as threadpoolctl sees it (numpy_first): internal_api,
    version, architecture, its own thread count (num_threads) and `threads`, the limit the reference
    runs under; plus any OPENBLAS_* environment variables."""
    blas = numpy_first([m for m in _controller().info() if m.get("user_api") == "blas"])
    info = {key: blas[0].get(key) for key in ("internal_api", "version", "architecture", "num_threads",
                                               "threading_layer", "prefix")} if blas else {"internal_api": None}
    info["libraries"] = len(blas)
    if threads is not None:
        info["threads"] = threads
        info["limit"] = f"threadpoolctl threadpool_limits(limits={threads}, user_api='blas')"
    env = {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")}
    if env:
        info["environment"] = env
    return info


MIN_CALL_SECONDS = 0.05  # a timed reference call lasts at least this long on one thread (see products_timer)


def products_timer(products: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], threads: int, repeat: int = 1
                   ) -> Callable[[], dict[str, float]]:
    """A variant for testbed.measure.timing.time_interleaved: every product a @ b into out by numpy's BLAS on
    `threads` threads, `repeat` times; its wall and CPU seconds per time (per set of products).

    CPU: on N > 1 threads this process's CPU clock (every BLAS thread's time, spinning included: what
    the library is charged); on one thread the calling thread's own CPU clock, the product's work
    alone: OpenBLAS's workers idle from an N-thread call just before go on spinning for a while, and
    the process clock would charge them to it (measured here: 6.8 ms of CPU for a 3.0 ms one-thread
    512^3 product timed right after a 2-thread one). `repeat` (repeats_for) makes a call long: the
    process clock reads the other threads' time as of their last scheduler tick (4 ms at HZ=250), so
    the CPU figure of a 2 ms call on 2 threads is mostly that staleness (measured: 0.72x its
    1-thread figure, which no real product can be)."""
    products = list(products)
    cpu = time.process_time if threads > 1 else time.thread_time

    def run() -> dict[str, float]:
        with _controller().limit(limits=threads, user_api="blas"):
            wall0, cpu0 = time.perf_counter(), cpu()
            for _ in range(repeat):
                for a, b, out in products:
                    np.matmul(a, b, out=out)
            return {"wall": (time.perf_counter() - wall0) / repeat, "cpu": (cpu() - cpu0) / repeat}
    return run


def repeats_for(products: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
                min_seconds: float = MIN_CALL_SECONDS) -> int:
    """How many times a timed call repeats the products so that it lasts at least min_seconds on one
    thread (timed once after a warm-up; the same count then serves every thread count)."""
    once = products_timer(products, 1)
    once()
    return max(1, int(np.ceil(min_seconds / max(once()["wall"], 1e-9))))


def square_products(n: int, seed=0) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """One float32 n x n by n x n product (2 n^3 FLOP)."""
    m = np.random.default_rng(seed).standard_normal((n, n)).astype(np.float32)
    return [(m, m, np.empty_like(m))]


def spinning(cpu_per_call: float, cpu_per_call_1thread: float, threads: int) -> dict:
    """The spinning rule on the reference's median CPU seconds per call at `threads` threads and on
    one thread (measured in the same job): what a record stores beside a ratio over it."""
    over = cpu_per_call / cpu_per_call_1thread if cpu_per_call_1thread > 0 else float("inf")
    return {"reference_spinning": bool(threads > 1 and over > SPIN_LIMIT),
            "reference_cpu_per_call_s": float(cpu_per_call),
            "reference_cpu_per_call_1thread_s": float(cpu_per_call_1thread),
            "reference_cpu_over_1thread": float(over), "spin_limit": SPIN_LIMIT}


def refusal(spin: dict, threads: int) -> str | None:
    """Why no target may be judged from this reference, or None."""
    if not spin.get("reference_spinning"):
        return None
    return (f"no target judged: the reference spins (its CPU time per call on {threads} threads is "
            f"{spin['reference_cpu_over_1thread']:.2f}x its 1-thread CPU time, above {SPIN_LIMIT}x)")


def shortfall(ratio: float, target: float, at_most: bool) -> float | None:
    """By what factor a ratio misses its target (> 1: what it must still gain), None when it meets it."""
    miss = ratio / target if at_most else target / ratio
    return float(miss) if miss > 1 else None


def judge(target: float, ratios: dict[str, float], spin: dict | None, threads: int) -> dict:
    """metrics for a ratio with a target (at least `target`): meets_target_<clock> per clock in
    `ratios`, or, when the reference spins, each of them null and `target_refused` saying why.
    spin=None: the reference is not a library (nothing to spin); judged as given."""
    why = refusal(spin or {}, threads)
    metrics = {"target": target, **{f"meets_target_{clock}": None if why else bool(r >= target)
                                    for clock, r in ratios.items()}}
    if why:
        metrics["target_refused"] = why
    return metrics | (spin or {})
