"""The library a kernel's rate is divided by, and when a ratio over it may be judged against a target.

A ratio "of sgemm" divides by the best library present at the same thread count, timed interleaved
with the kernel in the same job. Two libraries are tried on this host: numpy's BLAS (OpenBLAS in numpy's
wheel) and, where it is installed, oneMKL (the `mkl` wheel: `pip install 'testbed[perf]'`; never a
default dependency), each in a process of its own (ReferenceProcess, blas_worker.py) on the same
products. Each library is a variant of the caller's interleaved repetitions (BestReference.variants),
and per shape and thread count the reference is the faster of them by median CPU time
(BestReference.pick, deciding with decisions.best_of over the paired repetitions, its confidence
stated): on an Intel Xeon (Sapphire Rapids class) oneMKL's sequential cblas_sgemm was 1.04-1.16x
OpenBLAS's SkylakeX kernel, on an AMD EPYC (Zen 5) it runs its AVX2 Zen kernel at ~0.45x OpenBLAS's
AVX-512 one, so which library is the reference is measured, not assumed. A machine without oneMKL says
so beside every ratio (`missing`: OpenBLAS alone ran). Where numpy is not (a device), the project's own
gemm may serve as a reference only under its own name (`own_gemm`), never as sgemm: dividing by an
unfused in-house product flatters the kernel (engine_bench once reported 1.60 / 2.27 "of sgemm" that
were 0.52 / 0.61 of OpenBLAS).

The best kernel, whatever the environment says: machines here (developers', CI's) set
OPENBLAS_CORETYPE=Haswell and OPENBLAS_L2_SIZE=512, and OpenBLAS then runs its AVX2 sgemm on an AVX-512
CPU (86-97 GFLOP/s at 512^3 where its own SkylakeX kernel does 143-166: every ratio over it read ~1.6x
too good; issue 35). So each reference process is started without the variables that force a library
onto another kernel or thread count (KERNEL_VARIABLES: OpenBLAS's, and oneMKL's MKL_ENABLE_INSTRUCTIONS,
MKL_CBWR, MKL_DEBUG_CPU_TYPE, its threading ones), fed products and asked for its clocks through a pipe.
Where the target itself is forced onto a narrower kernel (TB_ISA=avx2 on an AVX-512 CPU) the reference
is each library's kernel for that ISA (OPENBLAS_CORETYPE=Haswell, MKL_ENABLE_INSTRUCTIONS=AVX2), like
for like. Records name the library that was the reference, its version, kernel (`architecture`: the
OpenBLAS core, or the dispatch library oneMKL loaded) and ISA, the CPU's widest ISA (/proc/cpuinfo),
and every candidate's figures. OpenBLAS on its own kernel is the floor of the reference: where it ran a
narrower kernel than the one it should have (or one whose ISA testbed cannot tell) no target is judged
(`kernel_rule`), and says why. oneMKL runs the kernel its own dispatch picks for this CPU (on AMD its
Zen code, AVX2): as a candidate it can only raise the reference, never flatter a ratio.

The spinning rule: OpenBLAS's extra threads spin-wait for work, and on a busy host they are
charged CPU time for it (at 2 threads on a loaded 2-core machine, several times the 1-thread CPU
time for the same product: a CPU-time ratio over it came out 3.80 where it was 0.46). So the
reference is also timed on ONE thread in the same job; when its CPU time per call at N threads is
more than SPIN_LIMIT times its 1-thread CPU time, the record says `reference_spinning: true` with
both figures and no target is judged from it (meets_target* stored as null, `target_refused` says why).
oneMKL runs one thread through its sequential layer and N through Intel OpenMP (the INTEL layer).

What ran is recorded beside every such figure (`blas_info`): the library, threadpoolctl's internal_api,
version, architecture and num_threads (oneMKL: its version string, dispatch library, threading layer)
as the reference process sees them, the variables it ran with, and those of this process it was started
without.
"""

from __future__ import annotations

import atexit
import ctypes.util
import importlib.metadata
import itertools
import os
import pickle
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np

from testbed import children
from testbed.measure import decisions

SPIN_LIMIT = 1.2  # CPU time per call at N threads over the 1-thread CPU time above which the reference spins
OWN_GEMM = "own_gemm"  # the label of the project's own product where it is the only reference (a device)
# The libraries tried as the reference, in the order they are listed; OpenBLAS (numpy's) is always there
LIBRARIES = ("openblas", "mkl")
LIBRARY_NAMES = {"openblas": "OpenBLAS", "mkl": "oneMKL"}
MKL_MISSING = "oneMKL is not installed (pip install 'testbed[perf]' installs the mkl wheel)"

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
# Per library, what gives its kernel for a narrower ISA a target is forced onto (TB_ISA): the variable and its value
NARROWER_KERNEL = {"openblas": ("OPENBLAS_CORETYPE", {"avx2": "Haswell", "avx": "Sandybridge"}),
                   "mkl": ("MKL_ENABLE_INSTRUCTIONS", {"avx2": "AVX2", "avx": "AVX"})}
CORETYPE_FOR_ISA = NARROWER_KERNEL["openblas"][1]
# Variables that make a library pick or tune another kernel (or thread count, or print into the pipe)
# than its own for this CPU: never passed to a reference process
KERNEL_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR",
                    "MKL_DEBUG_CPU_TYPE", "MKL_THREADING_LAYER", "MKL_INTERFACE_LAYER", "MKL_NUM_THREADS",
                    "MKL_DYNAMIC", "MKL_VERBOSE")


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


@lru_cache(maxsize=1)
def mkl_runtime() -> tuple[str | None, str]:
    """oneMKL's single dynamic library (libmkl_rt) and where it came from: the `mkl` wheel's file, else
    one the system's loader finds; (None, why) where there is none."""
    try:
        dist = importlib.metadata.distribution("mkl")
        for file in dist.files or ():
            if file.name.startswith("libmkl_rt.so"):
                path = Path(dist.locate_file(file)).resolve()
                if path.is_file():
                    return str(path), f"the mkl wheel {dist.version}"
    except importlib.metadata.PackageNotFoundError:
        pass
    found = ctypes.util.find_library("mkl_rt")
    if found:
        return found, "the system's libmkl_rt"
    return None, MKL_MISSING


def libraries() -> dict[str, str | None]:
    """The reference's candidate libraries here: name -> None where it runs, or why it does not."""
    return {"openblas": None, "mkl": None if mkl_runtime()[0] else mkl_runtime()[1]}


def reference_environment(environ=os.environ, library: str = "openblas") -> dict[str, str]:
    """A reference process's environment: this one without the variables that force a library's kernel
    (KERNEL_VARIABLES), with the library's variable for a narrower ISA only where TB_ISA forces the
    targets onto it (like for like)."""
    env = {k: v for k, v in environ.items() if k not in KERNEL_VARIABLES}
    want = target_isa(environ)
    if want != cpu_isa():
        variable, values = NARROWER_KERNEL[library]
        env[variable] = values[want]
    return env


def mkl_layer(threads: int) -> str:
    """oneMKL's threading layer for a call on `threads` threads: sequential for one (no OpenMP runtime
    in the call at all), Intel OpenMP for more."""
    return "SEQUENTIAL" if threads == 1 else "INTEL"


class ReferenceProcess:
    """One library in a process of its own (blas_worker.py), started with reference_environment():
    products loaded once, then each `run` one timed call, its clocks read in there. `layer`: oneMKL's
    threading layer (mkl_layer); None for OpenBLAS, whose threads threadpoolctl limits per call."""

    def __init__(self, library: str = "openblas", layer: str | None = None, environ=os.environ):
        self.library, self.layer = library, layer
        self.environ = reference_environment(environ, library)
        self.removed = {k: environ[k] for k in KERNEL_VARIABLES if k in environ and
                        self.environ.get(k) != environ[k]}
        argv = [sys.executable, str(Path(__file__).with_name("blas_worker.py")), library]
        if library == "mkl":
            path, why = mkl_runtime()
            if path is None:
                raise RuntimeError(why)
            argv += [path, layer or "SEQUENTIAL"]
        self._proc = children.start(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.environ)
        self._lock = threading.Lock()
        self._keys = itertools.count()

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def ask(self, *message):
        with self._lock:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the {LIBRARY_NAMES[self.library]} reference process exited "
                                   f"(status {self._proc.returncode})")
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


_processes: dict[tuple[str, str | None], ReferenceProcess] = {}
_process_lock = threading.Lock()


def reference_process(library: str = "openblas", threads: int = 1) -> ReferenceProcess:
    """This process's reference process for a library and thread count (oneMKL: one per threading
    layer), started on first use, closed at exit; restarted when TB_ISA or the environment's kernel
    variables changed since, or when it is gone (a library that failed to load exits)."""
    layer = mkl_layer(threads) if library == "mkl" else None
    with _process_lock:
        process = _processes.get((library, layer))
        if process is None or not process.alive or process.environ != reference_environment(library=library):
            if process is not None:
                process.close()
            process = _processes[(library, layer)] = ReferenceProcess(library, layer)
            atexit.register(process.close)
        return process


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


def blas_info(threads: int | None = None, library: str = "openblas") -> dict:
    """A library as its reference process sees it: library, internal_api, version, architecture (the
    kernel it runs: OpenBLAS's core, oneMKL's dispatch library), its own thread count (num_threads) and
    `threads`, the limit the reference runs under; the kernel's ISA, the CPU's widest and the one the
    targets may use; the variables it ran with and those it was started without."""
    process = reference_process(library, threads or 1)
    seen = process.ask("info")
    info = dict(seen["blas"]) if seen["blas"].get("internal_api") else {"library": library, "internal_api": None}
    info["process"] = "its own (testbed/measure/blas_worker.py), through a pipe, interleaved with the targets"
    info["kernel_isa"] = info.pop("kernel_isa_seen", None) if library == "mkl" else kernel_isa(info.get("architecture"))
    info["cpu_isa"] = cpu_isa()
    info["target_isa"] = target_isa()
    if threads is not None:
        info["threads"] = threads
        info["limit"] = (f"threadpoolctl threadpool_limits(limits={threads}, user_api='blas')" if library == "openblas"
                         else f"MKL_Set_Num_Threads_Local({threads}), threading layer {process.layer}")
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
    name = LIBRARY_NAMES.get(info.get("library", "openblas"), "the library")
    if ran is None:
        why = f"{name}'s kernel {info.get('architecture')!r} is not one testbed knows the ISA of"
    elif ISA_RANK.get(ran, 0) < ISA_RANK.get(want, 0):
        chooses = {variable for variable, _ in NARROWER_KERNEL.values()}  # what picks a library's kernel
        forced = {k: v for k, v in info.get("environment", {}).items() if k in chooses}
        why = (f"the reference ran {name}'s {info.get('architecture')} kernel ({ran}) where the targets may use "
               f"{want}" + "".join(f" ({k}={v})" for k, v in forced.items()))
    else:
        why = None
    rule["reference_kernel_narrower"] = why is not None
    if why:
        rule["reference_kernel_why"] = why
    return rule


MIN_CALL_SECONDS = 0.05  # a timed reference call lasts at least this long on one thread (see products_timer)


def products_timer(products: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], threads: int, repeat: int = 1,
                   library: str = "openblas") -> "ProductsTimer":
    """A variant for testbed.measure.timing.time_interleaved: every product a @ b by `library` in its
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
    return ProductsTimer(products, threads, repeat, library)


class ProductsTimer:
    """products_timer's variant: the products loaded into the library's reference process once (again
    into a new one, should the reference process have been restarted since: TB_ISA changed)."""

    def __init__(self, products, threads: int, repeat: int = 1, library: str = "openblas"):
        self.products = list(products)
        self.threads, self.repeat, self.library = threads, repeat, library
        self._loaded: list = [None, None]  # [process, key]: what the finalizer lets go of
        weakref.finalize(self, _drop, self._loaded)  # the worker lets go of them with the timer
        self._key()

    def _key(self) -> int:
        process = reference_process(self.library, self.threads)
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
    thread (timed once after a warm-up, by numpy's OpenBLAS; the same count then serves every library
    and thread count)."""
    once = products_timer(products, 1)
    once()
    return max(1, int(np.ceil(min_seconds / max(once()["wall"], 1e-9))))


# --- the best library per shape ----------------------------------------------------------------------


def variant_name(label: str, library: str, one_thread: bool = False) -> str:
    """The interleaved variant of one candidate library: "sgemm (openblas)", "sgemm 1 thread (mkl)"."""
    return f"{label}{' 1 thread' if one_thread else ''} ({library})"


def choose(samples: dict[str, dict[str, Sequence[float]]], clock: str = "cpu") -> dict:
    """The reference among candidate libraries timed interleaved on the same products: the faster by
    median `clock` seconds per call (samples: library -> clock -> seconds, one per repetition, the
    repetitions paired), with the decision's confidence (decisions.best_of, paired bootstrap). Where
    the data cannot tell them apart the faster median is still the reference (the higher bar), and
    `says` says it is undecided. Returns {library, by, says, decided, medians_s, over_best (each
    library's median over the reference's: >= 1), faster_in (repetitions the reference beat every
    other in), reps}."""
    if not samples:
        raise ValueError("no candidate library was timed")
    by_library = {lib: np.asarray(s[clock], float) for lib, s in samples.items()}
    reps = min(v.size for v in by_library.values())
    by_library = {lib: v[:reps] for lib, v in by_library.items()}
    decision = decisions.best_of(by_library, paired=True, by=f"median {clock} time per call")
    best = decision["best"]
    medians = {lib: float(np.median(v)) for lib, v in by_library.items()}
    others = [v for lib, v in by_library.items() if lib != best]
    faster_in = int(np.sum(np.all([by_library[best] < v for v in others], axis=0))) if others else reps
    return {"library": best, "by": f"median {clock} seconds per call", "says": decision["says"],
            "decided": bool(decision["decided"]), "medians_s": medians,
            "over_best": {lib: m / medians[best] for lib, m in medians.items()}, "faster_in": faster_in,
            "reps": int(reps)}


class BestReference:
    """The reference for one set of products at one thread count: a ProductsTimer per candidate library
    (and, at threads > 1, each on one thread too: the spinning rule, and what a one-thread kernel is
    divided by), to be timed interleaved with the kernels; then `pick` names the faster per thread
    count and gives its samples, what ran, and the rules' figures."""

    def __init__(self, products, threads: int, repeat: int, label: str = "sgemm"):
        self.label, self.threads = label, threads
        self.missing = {lib: why for lib, why in libraries().items() if why}
        self.timers: dict[str, ProductsTimer] = {}
        for lib in LIBRARIES:
            if lib in self.missing:
                continue
            try:
                timers = {variant_name(label, lib): products_timer(products, threads, repeat, lib)}
                if threads > 1:
                    timers[variant_name(label, lib, True)] = products_timer(products, 1, repeat, lib)
            except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
                if lib == "openblas":  # numpy's: the floor of the reference, never optional
                    raise
                # an optional library that does not run here (a broken install) is missing, and says why
                self.missing[lib] = f"{LIBRARY_NAMES[lib]} did not run: {e or type(e).__name__}"
                continue
            self.timers |= timers

    @property
    def candidates(self) -> list[str]:
        return [lib for lib in LIBRARIES if lib not in self.missing]

    def variants(self) -> dict[str, ProductsTimer]:
        """name -> timer, for time_interleaved (every candidate at `threads`, and on one thread at threads > 1)."""
        return dict(self.timers)

    def pick(self, samples: dict, one_thread: bool = False) -> "Pick":
        """The reference at `threads` (one_thread: on one thread) from the interleaved samples
        (time_interleaved's Interleaved.samples: variant -> clock -> seconds)."""
        threads = 1 if one_thread else self.threads
        names = {lib: variant_name(self.label, lib, one_thread and self.threads > 1) for lib in self.candidates}
        decision = choose({lib: samples[name] for lib, name in names.items()})
        lib = decision["library"]
        infos = {c: blas_info(threads, c) for c in self.candidates}
        info = dict(infos[lib])
        info["candidates"] = {c: {"version": i.get("version"), "kernel": i.get("architecture"),
                                  "kernel_isa": i.get("kernel_isa"),
                                  "median_cpu_s": decision["medians_s"][c],
                                  "over_reference": decision["over_best"][c]} for c, i in infos.items()}
        info["choice"] = decision
        if self.missing:
            info["missing"] = self.missing
        # OpenBLAS on its own kernel is the reference's floor: its kernel rule is the one judged
        rule = kernel_rule(infos["openblas"]) | {"reference_library": lib,
                                                 "reference_kernel": info.get("architecture"),
                                                 "reference_kernel_isa": info.get("kernel_isa")}
        one = names[lib] if threads == 1 else variant_name(self.label, lib, True)
        return Pick(lib, names[lib], one, samples[names[lib]], info, rule)


@dataclass
class Pick:
    """The chosen reference of a BestReference: its library, its variant's name and samples (clock ->
    seconds per repetition), the name of the same library's one-thread variant, what ran (blas_info
    with every candidate and the decision) and the kernel rule's figures."""

    library: str
    name: str
    one_thread: str
    samples: dict
    info: dict
    rule: dict

    def describe(self) -> str:
        """One line for a ratio's text: the library, its kernel and ISA, and how it was chosen."""
        i = self.info
        others = ", ".join(f"{LIBRARY_NAMES[c]} {v['over_reference']:.2f}x its time" for c, v in
                           i["candidates"].items() if c != self.library)
        missing = "; ".join(i.get("missing", {}).values())
        return (f"{LIBRARY_NAMES[self.library]} {i.get('version')} ({i.get('architecture')} kernel, "
                f"{i.get('kernel_isa')}), the faster here" + (f" ({others})" if others else "")
                + (f"; {missing}" if missing else ""))


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
