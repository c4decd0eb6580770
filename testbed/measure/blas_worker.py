"""The reference process: one BLAS library computing products on request, in a process of its own.

Started by testbed.measure.blas_reference.ReferenceProcess as a plain script (no testbed import:
nothing but numpy, threadpoolctl and the library loads here), with the environment the reference must
see (without the variables that force a library onto another kernel than its own for this CPU):

  python blas_worker.py openblas              numpy's own BLAS (OpenBLAS in numpy's wheel), np.matmul;
                                              its threads limited per request by threadpoolctl
  python blas_worker.py mkl PATH LAYER        oneMKL's cblas_sgemm through ctypes from PATH (libmkl_rt),
                                              threading layer LAYER (SEQUENTIAL: one thread, what the
                                              1-thread reference runs; INTEL: Intel OpenMP, N threads)

Messages are pickles on stdin / stdout, one request, one reply:

  ("load", key, [(a, b), ...])   keep the products under `key` (out arrays allocated here)   -> "ok"
  ("run", key, threads, repeat)  every product `repeat` times on `threads` BLAS threads       -> {"wall", "cpu"}
  ("info",)                      the library: name, version, kernel, its ISA, the variables seen -> dict
  ("result", key)                the products' outputs (for a check that they computed)       -> [out, ...]
  ("drop", key)                  let go of the products under `key`                          -> "ok"

The clocks are read here, around the products only, so the pipe's cost is never in a figure: wall by
perf_counter; CPU by this thread's clock on one thread, by the process's on more (every BLAS thread's
time, spinning included: what the library is charged; see blas_reference.products_timer). The
replies go to a private copy of stdout: fd 1 is pointed at stderr first, so a library that prints
(MKL_VERBOSE) cannot corrupt the pipe.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import sys
import time

import numpy as np
from threadpoolctl import ThreadpoolController

# cblas enums (mkl_cblas.h, cblas.h)
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
# MKL_Set_Threading_Layer's values (mkl_service.h)
MKL_LAYERS = {"INTEL": 0, "SEQUENTIAL": 1, "GNU": 2, "TBB": 3}
# oneMKL's CPU-dispatch libraries (libmkl_NAME.so) by the widest ISA their code uses; `def` is the
# baseline (SSE2) library, which also holds MKL's AVX2 kernels for AMD Zen (asked below)
MKL_DISPATCH_ISA = {"avx10": "avx512", "avx512": "avx512", "avx512_mic": "avx512", "avx2": "avx2", "avx": "avx",
                    "mc3": "sse", "mc": "sse", "def": "sse"}
# the variables the reference reports having seen (the kernel-forcing ones are removed by the caller)
SEEN_PREFIXES = ("OPENBLAS_", "MKL_", "KMP_", "OMP_")


def numpy_blas(controller: ThreadpoolController) -> dict:
    """threadpoolctl's entry for numpy's own BLAS (the one under numpy's package or numpy.libs)."""
    home = os.path.dirname(os.path.realpath(np.__file__))
    mine = (home + os.sep, os.path.join(os.path.dirname(home), "numpy.libs") + os.sep)
    blas = [m for m in controller.info() if m.get("user_api") == "blas"]
    blas.sort(key=lambda m: not str(m.get("filepath", "")).startswith(mine))
    return blas[0] if blas else {}


def matrix_layout(m: np.ndarray) -> tuple[int, int]:
    """(transpose flag, leading dimension) of a float32 matrix for a row-major cblas call: a C-contiguous
    matrix as it is, a Fortran-contiguous one (a weight W passed as W.T) as the transpose of its rows."""
    if m.flags.c_contiguous:
        return NO_TRANS, max(1, m.strides[0] // 4)
    if m.flags.f_contiguous:
        return TRANS, max(1, m.strides[1] // 4)
    raise ValueError(f"a product's operand of shape {m.shape} is neither C- nor Fortran-contiguous")


class OpenBLAS:
    """numpy's BLAS: np.matmul, its threads limited by threadpoolctl."""

    def __init__(self):
        self.controller = ThreadpoolController()

    def product(self, a: np.ndarray, b: np.ndarray, out: np.ndarray):
        return lambda: np.matmul(a, b, out=out)

    def threads(self, n: int):
        return self.controller.limit(limits=n, user_api="blas")

    def info(self) -> dict:
        blas = numpy_blas(self.controller)
        kernel = blas.get("architecture")
        return {"library": "openblas", "internal_api": blas.get("internal_api"), "version": blas.get("version"),
                "architecture": kernel, "kernel": kernel, "num_threads": blas.get("num_threads"),
                "threading_layer": blas.get("threading_layer"), "prefix": blas.get("prefix"),
                "libraries": sum(m.get("user_api") == "blas" for m in self.controller.info()),
                "call": "numpy.matmul (numpy's own OpenBLAS)"}


class _Threads:
    """A context that sets MKL's thread count for this thread (MKL_Set_Num_Threads_Local)."""

    def __init__(self, mkl, n: int):
        self.mkl, self.n = mkl, n

    def __enter__(self):
        self.before = self.mkl.MKL_Set_Num_Threads_Local(self.n)

    def __exit__(self, *exc):
        self.mkl.MKL_Set_Num_Threads_Local(self.before)


class MKL:
    """oneMKL's cblas_sgemm from libmkl_rt through ctypes, on numpy's arrays in place."""

    def __init__(self, path: str, layer: str):
        self.path, self.layer = path, layer
        self.lib = ctypes.CDLL(path)
        set_layer = self.lib.MKL_Set_Threading_Layer(MKL_LAYERS[layer])  # before any other MKL call
        if set_layer != MKL_LAYERS[layer]:
            raise RuntimeError(f"oneMKL refused threading layer {layer} (it runs layer {set_layer})")
        f32 = ctypes.POINTER(ctypes.c_float)
        self.lib.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, f32, ctypes.c_int, f32, ctypes.c_int,
                                                              ctypes.c_float, f32, ctypes.c_int]
        self.lib.cblas_sgemm.restype = None
        self.lib.MKL_Set_Num_Threads_Local.restype = ctypes.c_int
        self.lib.MKL_Set_Num_Threads_Local.argtypes = [ctypes.c_int]
        self.called = False

    def product(self, a: np.ndarray, b: np.ndarray, out: np.ndarray):
        (m, k), n = a.shape, b.shape[1]
        ta, lda = matrix_layout(a)
        tb, ldb = matrix_layout(b)
        if not out.flags.c_contiguous:
            raise ValueError("a product's output must be C-contiguous")
        f32 = ctypes.POINTER(ctypes.c_float)
        args = (ROW_MAJOR, ta, tb, m, n, k, 1.0, a.ctypes.data_as(f32), lda, b.ctypes.data_as(f32), ldb, 0.0,
                out.ctypes.data_as(f32), max(1, n))
        sgemm = self.lib.cblas_sgemm

        def run():
            sgemm(*args)
            self.called = True
        return run

    def threads(self, n: int):
        return _Threads(self.lib, n)

    @staticmethod
    def mapped() -> list[str]:
        """The paths of the MKL libraries this process has mapped (/proc/self/maps)."""
        try:
            with open("/proc/self/maps") as maps:
                return sorted({line.split(None, 5)[-1].strip() for line in maps if "/libmkl_" in line})
        except OSError:
            return []

    def dispatch(self) -> str | None:
        """The CPU-dispatch library MKL loaded for its kernels (libmkl_NAME.so: def, mc3, avx2, avx512,
        avx10), once a product ran."""
        for path in self.mapped():
            stem = os.path.basename(path).split(".so")[0][len("libmkl_"):]
            if stem in MKL_DISPATCH_ISA:
                return stem
        return None

    def zen(self) -> bool | None:
        """Whether MKL runs its AMD Zen code paths here (mkl_serv_cpuiszen of the libmkl_core it loaded):
        the `def` library's sgemm kernel for Zen is AVX2. None where that cannot be asked."""
        core = next((p for p in self.mapped() if os.path.basename(p).startswith("libmkl_core.so")), None)
        try:
            return bool(ctypes.CDLL(core, mode=getattr(os, "RTLD_NOLOAD", 4)).mkl_serv_cpuiszen()) if core else None
        except (OSError, AttributeError):
            return None

    def info(self) -> dict:
        if not self.called:  # MKL picks its kernel library on the first call
            one = np.ones((8, 8), np.float32)
            self.product(one, one, np.empty_like(one))()
        text = ctypes.create_string_buffer(512)
        self.lib.mkl_get_version_string(text, len(text))
        version = text.value.decode(errors="replace").strip()
        dispatch = self.dispatch()
        zen = self.zen() if dispatch == "def" else None
        isa = "avx2" if zen else MKL_DISPATCH_ISA.get(dispatch or "")
        kernel = f"{dispatch} (AMD Zen kernels)" if zen else dispatch
        # "... Version 2026.2-Product Build 20260915 for ...": 2026.2
        number = version.split("Version ", 1)[-1].split()[0].split("-")[0] if "Version " in version else version
        return {"library": "mkl", "internal_api": "mkl", "version": number, "version_string": version,
                "architecture": kernel,
                "kernel": kernel, "kernel_isa_seen": isa, "num_threads": self.lib.MKL_Get_Max_Threads(),
                "threading_layer": self.layer.lower(), "prefix": "libmkl_rt", "filepath": self.path, "libraries": 1,
                "call": f"cblas_sgemm (oneMKL through ctypes, threading layer {self.layer})"}


def main() -> None:
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the pipe
    kind = sys.argv[1] if len(sys.argv) > 1 else "openblas"
    library = MKL(sys.argv[2], sys.argv[3]) if kind == "mkl" else OpenBLAS()
    products: dict = {}
    while True:
        try:
            message = pickle.load(requests)
        except EOFError:
            return
        request = message[0]
        if request == "load":
            _, key, pairs = message
            loaded = []
            for a, b in pairs:
                out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
                loaded.append((library.product(a, b, out), out))
            products[key] = loaded
            reply = "ok"
        elif request == "run":
            _, key, threads, repeat = message
            cpu = time.process_time if threads > 1 else time.thread_time
            with library.threads(threads):
                wall0, cpu0 = time.perf_counter(), cpu()
                for _ in range(repeat):
                    for run, _out in products[key]:
                        run()
                reply = {"wall": (time.perf_counter() - wall0) / repeat, "cpu": (cpu() - cpu0) / repeat}
        elif request == "info":
            reply = {"blas": library.info(), "numpy": np.__version__,
                     "environment": {k: v for k, v in os.environ.items() if k.startswith(SEEN_PREFIXES)}}
        elif request == "drop":
            products.pop(message[1], None)
            reply = "ok"
        elif request == "result":
            reply = [out for _, out in products[message[1]]]
        else:
            reply = {"error": f"unknown request {request!r}"}
        pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()


if __name__ == "__main__":
    main()
