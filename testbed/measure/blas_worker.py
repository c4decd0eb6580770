"""The reference process: numpy's BLAS computing products on request, in a process of its own.

Started by testbed.measure.blas_reference.ReferenceProcess as a plain script (`python blas_worker.py`,
no testbed import: nothing but numpy and threadpoolctl loads here), with the environment the reference
must see: without OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, so OpenBLAS picks its own kernel for this CPU
whatever the caller's environment forces. Messages are pickles on stdin / stdout, one request, one reply:

  ("load", key, [(a, b), ...])   keep the products under `key` (out arrays allocated here)   -> "ok"
  ("run", key, threads, repeat)  every product `repeat` times on `threads` BLAS threads       -> {"wall", "cpu"}
  ("info",)                      threadpoolctl's view of numpy's BLAS, and the OPENBLAS_* seen -> dict
  ("result", key)                the products' outputs (for a check that they computed)       -> [out, ...]
  ("drop", key)                  let go of the products under `key`                          -> "ok"

The clocks are read here, around the products only, so the pipe's cost is never in a figure: wall by
perf_counter; CPU by this thread's clock on one thread, by the process's on more (every BLAS thread's
time, spinning included: what the library is charged; see blas_reference.products_timer).
"""

from __future__ import annotations

import os
import pickle
import sys
import time

import numpy as np
from threadpoolctl import ThreadpoolController


def numpy_blas(controller: ThreadpoolController) -> dict:
    """threadpoolctl's entry for numpy's own BLAS (the one under numpy's package or numpy.libs)."""
    home = os.path.dirname(os.path.realpath(np.__file__))
    mine = (home + os.sep, os.path.join(os.path.dirname(home), "numpy.libs") + os.sep)
    blas = [m for m in controller.info() if m.get("user_api") == "blas"]
    blas.sort(key=lambda m: not str(m.get("filepath", "")).startswith(mine))
    return blas[0] if blas else {}


def main() -> None:
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    controller = ThreadpoolController()
    products: dict = {}
    while True:
        try:
            message = pickle.load(requests)
        except EOFError:
            return
        kind = message[0]
        if kind == "load":
            _, key, pairs = message
            products[key] = [(a, b, np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b)))
                             for a, b in pairs]
            reply = "ok"
        elif kind == "run":
            _, key, threads, repeat = message
            cpu = time.process_time if threads > 1 else time.thread_time
            with controller.limit(limits=threads, user_api="blas"):
                wall0, cpu0 = time.perf_counter(), cpu()
                for _ in range(repeat):
                    for a, b, out in products[key]:
                        np.matmul(a, b, out=out)
                reply = {"wall": (time.perf_counter() - wall0) / repeat, "cpu": (cpu() - cpu0) / repeat}
        elif kind == "info":
            blas = numpy_blas(controller)
            reply = {"blas": {k: blas.get(k) for k in ("internal_api", "version", "architecture", "num_threads",
                                                        "threading_layer", "prefix")},
                     "libraries": sum(m.get("user_api") == "blas" for m in controller.info()),
                     "environment": {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")},
                     "numpy": np.__version__}
        elif kind == "drop":
            products.pop(message[1], None)
            reply = "ok"
        elif kind == "result":
            reply = [out for _, _, out in products[message[1]]]
        else:
            reply = {"error": f"unknown request {kind!r}"}
        pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()


if __name__ == "__main__":
    main()
