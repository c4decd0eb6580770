"""The library a kernel's rate is divided by, and when a ratio over it may be judged against a target.

A ratio "of sgemm" divides by the best library available at the same thread count: numpy's BLAS
(OpenBLAS on these hosts) on this host, limited to the kernel's threads through threadpoolctl
(`threadpool_limits(limits=N, user_api="blas")`), timed interleaved with the kernel in the same
job. Where numpy is not (a device), the project's own gemm may serve as a reference only under its
own name (`own_gemm`), never as sgemm: dividing by an unfused in-house product flatters the kernel
(engine_bench once reported 1.60 / 2.27 "of sgemm" that were 0.52 / 0.61 of OpenBLAS).

The best kernel, whatever the environment says: machines here (developers', CI's) set
OPENBLAS_CORETYPE=Haswell and OPENBLAS_L2_SIZE=512, and OpenBLAS then runs its AVX2 sgemm on an AVX-512
CPU (86-97 GFLOP/s at 512^3 where its own SkylakeX kernel does 143-166: every ratio over it read ~1.6x
too good; issue 35). So the reference runs in a process of its own (ReferenceProcess, blas_worker.py)
started without those variables, fed products and asked for its clocks through a pipe; each request is
one variant of the caller's interleaved repetitions, so the comparison stays interleaved in one job.
Where the target itself is forced onto a narrower kernel (TB_ISA=avx2 on an AVX-512 CPU) the reference
is OpenBLAS's kernel for that ISA (OPENBLAS_CORETYPE=Haswell), like for like. Records name the kernel
the reference ran (`architecture`), its ISA, and the CPU's widest ISA (/proc/cpuinfo); a reference that
ran a narrower kernel than the one it should have judges no target (`kernel_rule`), and says why.

The spinning rule: OpenBLAS's extra threads spin-wait for work, and on a busy host they are
charged CPU time for it (at 2 threads on a loaded 2-core machine, several times the 1-thread CPU
time for the same product: a CPU-time ratio over it came out 3.80 where it was 0.46). So the
reference is also timed on ONE thread in the same job; when its CPU time per call at N threads is
more than SPIN_LIMIT times its 1-thread CPU time, the record says `reference_spinning: true` with
both figures and no target is judged from it (meets_target* stored as null, `target_refused` says why).

What ran is recorded beside every such figure (`blas_info`): threadpoolctl's internal_api, version,
architecture (the kernel OpenBLAS chose) and num_threads as the reference process sees them, the
OPENBLAS_* variables it ran with, and those of this process it was started without.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import subprocess
import sys
import threading
import weakref
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from testbed import children

SPIN_LIMIT = 1.2  # CPU time per call at N threads over the 1-thread CPU time above which the reference spins
OWN_GEMM = "own_gemm"  # the label of the project's own product where it is the only reference (a device)

# The ISAs a kernel may be built for, narrowest first; OpenBLAS's kernel names (threadpoolctl's
# `architecture`, lower case) by the widest ISA their sgemm uses.
ISA_ORDER = ("scalar", "sse", "avx", "avx2", "avx512", "neon", "sve")
ISA_RANK = {"scalar": 0, "sse": 1, "avx": 2, "avx2": 3, "avx512": 4, "neon": 1, "sve": 2}
OPENBLAS_KERNEL_ISA = {
    **dict.fromkeys(("skylakex", "cooperlake", "sapphirerapids"), "avx512"),
    **dict.fromkeys(("haswell", "zen"), "avx2"),
    **dict.fromkeys(("sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"), "avx"),
    **dict.fromkeys(("katmai", "coppermine", "northwood", "prescott", "banias", "core2", "penryn", "dunnington",
                     "nehalem", "atom", "opteron", "opteron_sse3", "barcelona", "nano"), "sse"),
    **dict.fromkeys(("armv8", "cortexa53", "cortexa55", "cortexa57", "cortexa72", "cortexa73", "cortexx1",
                     "neoversen1", "thunderx", "thunderx2t99", "thunderx3t110", "falkor", "tsv110", "emag8180",
                     "vortex", "ft2000"), "neon"),
    **dict.fromkeys(("neoversev1", "neoversev2", "neoversen2", "a64fx", "armv8sve", "cortexa510", "cortexa710",
                     "cortexx2"), "sve"),
}
# The OPENBLAS_CORETYPE that gives OpenBLAS's kernel for a narrower ISA a target is forced onto (TB_ISA)
CORETYPE_FOR_ISA = {"avx2": "Haswell", "avx": "Sandybridge"}
# Variables that make OpenBLAS pick or tune another kernel than its own for this CPU: never passed to the reference
KERNEL_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


@lru_cache(maxsize=1)
def cpu_isa(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The widest ISA this CPU's flags name (x86: avx512f, avx2 with fma, avx, sse2; ARM: sve, asimd)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return "scalar"
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags |= set(line.split(":", 1)[1].split())
    for isa, needs in (("avx512", {"avx512f"}), ("avx2", {"avx2", "fma"}), ("avx", {"avx"}), ("sse", {"sse2"}),
                       ("sve", {"sve"}), ("neon", {"asimd"}), ("neon", {"neon"})):
        if needs <= flags:
            return isa
    return "scalar"


def target_isa(environ=os.environ) -> str:
    """The widest ISA the targets may use: the CPU's, or the narrower one TB_ISA forces them onto."""
    cpu = cpu_isa()
    forced = environ.get("TB_ISA", "").strip().lower()
    if forced in ISA_RANK and forced in CORETYPE_FOR_ISA and ISA_RANK[forced] < ISA_RANK.get(cpu, 0):
        return forced
    return cpu


def reference_environment(environ=os.environ) -> dict[str, str]:
    """The reference process's environment: this one without the variables that force OpenBLAS's
    kernel (KERNEL_VARIABLES), with OPENBLAS_CORETYPE for a narrower ISA only where TB_ISA forces
    the targets onto it (like for like)."""
    env = {k: v for k, v in environ.items() if k not in KERNEL_VARIABLES}
    want = target_isa(environ)
    if want != cpu_isa():
        env["OPENBLAS_CORETYPE"] = CORETYPE_FOR_ISA[want]
    return env


class ReferenceProcess:
    """numpy's BLAS in a process of its own (blas_worker.py), started with reference_environment():
    products loaded once, then each `run` one timed call, its clocks read in there."""

    def __init__(self, environ=os.environ):
        self.environ = reference_environment(environ)
        self.removed = {k: environ[k] for k in KERNEL_VARIABLES if k in environ and
                        self.environ.get(k) != environ[k]}
        self._proc = children.start([sys.executable, str(Path(__file__).with_name("blas_worker.py"))],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.environ)
        self._lock = threading.Lock()
        self._keys = itertools.count()

    def ask(self, *message):
        with self._lock:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the BLAS reference process exited (status {self._proc.returncode})")
            pickle.dump(message, self._proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self._proc.stdin.flush()
            return pickle.load(self._proc.stdout)

    def load(self, products: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> int:
        key = next(self._keys)
        self.ask("load", key, [(a, b) for a, b, *_ in products])
        return key

    def drop(self, key: int) -> None:
        """Let go of a key's products (a finished timer's); nothing once the process is gone."""
        if self._proc.poll() is None and not self._proc.stdin.closed:
            self.ask("drop", key)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        children.end(self._proc)


_process: ReferenceProcess | None = None
_process_lock = threading.Lock()


def reference_process() -> ReferenceProcess:
    """This process's one reference process (started on first use, closed at exit; restarted when
    TB_ISA or the environment's kernel variables changed since)."""
    global _process
    with _process_lock:
        if _process is None or _process.environ != reference_environment():
            if _process is not None:
                _process.close()
            _process = ReferenceProcess()
            atexit.register(_process.close)
        return _process


def numpy_first(blas: list[dict]) -> list[dict]:
    """threadpoolctl's BLAS libraries with numpy's own first (the one under numpy's package or its
    numpy.libs): it lists them in load order, and scipy (imported by transformers) or torch may have
    loaded another OpenBLAS first, of another version."""
    home = Path(np.__file__).resolve().parent
    mine = (str(home) + os.sep, str(home.parent / "numpy.libs") + os.sep)
    return sorted(blas, key=lambda m: not str(m.get("filepath", "")).startswith(mine))


def kernel_isa(architecture: str | None) -> str | None:
    """The ISA of OpenBLAS's kernel by its name, None for a name testbed does not know."""
    return OPENBLAS_KERNEL_ISA.get(str(architecture or "").lower())


def blas_info(threads: int | None = None) -> dict:
    """The reference's BLAS as threadpoolctl sees it in the reference process: internal_api, version,
    architecture (the kernel it runs), its own thread count (num_threads) and `threads`, the limit the
    reference runs under; the kernel's ISA, the CPU's widest and the one the targets may use; the
    OPENBLAS_* variables it ran with and those it was started without."""
    process = reference_process()
    seen = process.ask("info")
    info = dict(seen["blas"]) if seen["blas"].get("internal_api") else {"internal_api": None}
    info["libraries"] = seen["libraries"]
    info["process"] = "its own (testbed/measure/blas_worker.py), through a pipe, interleaved with the targets"
    info["kernel_isa"] = kernel_isa(info.get("architecture"))
    info["cpu_isa"] = cpu_isa()
    info["target_isa"] = target_isa()
    if threads is not None:
        info["threads"] = threads
        info["limit"] = f"threadpoolctl threadpool_limits(limits={threads}, user_api='blas')"
    if seen["environment"]:
        info["environment"] = seen["environment"]
    if process.removed:
        info["environment_removed"] = process.removed
    return info


def kernel_rule(info: dict) -> dict:
    """What a record stores beside a ratio over the reference described by `info` (blas_info): the
    kernel's and the CPU's ISAs, and `reference_kernel_narrower` with why when the reference ran a
    narrower kernel than the targets may use (or one whose ISA testbed cannot tell): then no target
    is judged from it (refusal)."""
    ran, want = info.get("kernel_isa"), info.get("target_isa") or info.get("cpu_isa")
    rule = {"reference_kernel": info.get("architecture"), "reference_kernel_isa": ran, "cpu_isa": info.get("cpu_isa"),
            "target_isa": want}
    if ran is None:
        why = f"OpenBLAS's kernel {info.get('architecture')!r} is not one testbed knows the ISA of"
    elif ISA_RANK.get(ran, 0) < ISA_RANK.get(want, 0):
        forced = info.get("environment", {}).get("OPENBLAS_CORETYPE")
        why = (f"the reference ran OpenBLAS's {info.get('architecture')} kernel ({ran}) where the targets may use "
               f"{want}" + (f" (OPENBLAS_CORETYPE={forced})" if forced else ""))
    else:
        why = None
    rule["reference_kernel_narrower"] = why is not None
    if why:
        rule["reference_kernel_why"] = why
    return rule


MIN_CALL_SECONDS = 0.05  # a timed reference call lasts at least this long on one thread (see products_timer)


def products_timer(products: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], threads: int, repeat: int = 1
                   ) -> "ProductsTimer":
    """A variant for testbed.measure.timing.time_interleaved: every product a @ b by numpy's BLAS in the
    reference process (ReferenceProcess) on `threads` threads, `repeat` times; its wall and CPU seconds
    per time (per set of products), read in there around the products.

    CPU: on N > 1 threads the reference process's CPU clock (every BLAS thread's time, spinning included:
    what the library is charged); on one thread its calling thread's own CPU clock, the product's work
    alone: OpenBLAS's workers idle from an N-thread call just before go on spinning for a while, and
    the process clock would charge them to it (measured here: 6.8 ms of CPU for a 3.0 ms one-thread
    512^3 product timed right after a 2-thread one). `repeat` (repeats_for) makes a call long: the
    process clock reads the other threads' time as of their last scheduler tick (4 ms at HZ=250), so
    the CPU figure of a 2 ms call on 2 threads is mostly that staleness (measured: 0.72x its
    1-thread figure, which no real product can be)."""
    return ProductsTimer(products, threads, repeat)


class ProductsTimer:
    """products_timer's variant: the products loaded into the reference process once (again into a new
    one, should the reference process have been restarted since: TB_ISA changed)."""

    def __init__(self, products, threads: int, repeat: int = 1):
        self.products = list(products)
        self.threads, self.repeat = threads, repeat
        self._loaded: list = [None, None]  # [process, key]: what the finalizer lets go of
        weakref.finalize(self, _drop, self._loaded)  # the worker lets go of them with the timer
        self._key()

    def _key(self) -> int:
        process = reference_process()
        if self._loaded[0] is not process:
            self._loaded[:] = [process, process.load(self.products)]
        return self._loaded[1]

    def __call__(self) -> dict[str, float]:
        key = self._key()
        return self._loaded[0].ask("run", key, self.threads, self.repeat)

    def outputs(self) -> list[np.ndarray]:
        """The products' results as last computed (a check that the timed calls computed them)."""
        key = self._key()
        return self._loaded[0].ask("result", key)


def _drop(loaded: list) -> None:
    process, key = loaded
    if process is not None:
        process.drop(key)


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
    """Why no target may be judged from this reference (its spinning figures, and kernel_rule's when
    merged in), or None."""
    if spin.get("reference_kernel_narrower"):
        return f"no target judged: {spin.get('reference_kernel_why')}"
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
