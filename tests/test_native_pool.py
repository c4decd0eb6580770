"""The host library's threads and floating-point mode (kernels/tb_parallel.c).

Threads: a persistent pool, created on the first call that asks for more than one thread and kept,
never a thread per call (counted in /proc/self/task: the pool's threads are named tb_pool); the
static partition gives the same bits at any thread count; a forked child still computes.
Denormals: every kernel entry point computes with FTZ/DAZ, as the device programs do (the same
inputs near the denormal range give the flushed result), and gives the calling thread its own mode
back (numpy on that thread still sees denormals afterwards). Each property also has its planted
bug, compiled into its own library (tests/native_support.mutant_library), which the same check
must catch.
"""

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from refimpl import gdn as ref
from tests.native_support import mutant_library
from testbed.backends.native import library as native

DENORMAL = np.float32(1e-40)  # below float32's least normal 1.18e-38
assert 0 < DENORMAL < np.finfo(np.float32).tiny


def pool_threads() -> set[int]:
    """This process's threads named tb_pool (the pool's workers, of every kernels library loaded)."""
    tids = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == "tb_pool":
                tids.add(int(task.name))
        except OSError:  # a thread that ended while we looked
            pass
    return tids


def small_inputs(heads=4, tokens=40, d=16, seed=1):
    return ref.draw_inputs(1, tokens, heads, d, seed=seed).arrays()


def denormal_state_call(lib, form):
    """GDN on a state of denormals with q = 1, k = v = beta = 0 and gate 0 (decay exp(0) = 1): with
    FTZ/DAZ every product reads the state as zero (state and output exactly 0); with IEEE denormals
    the state stays 1e-40 and the output is a small denormal sum."""
    d, tokens = 8, 3
    q = np.ones((1, tokens, 1, d), np.float32)
    k = v = np.zeros((1, tokens, 1, d), np.float32)
    g = beta = np.zeros((1, tokens, 1), np.float32)
    state = np.full((1, 1, d, d), DENORMAL, np.float32)
    if form == "serial":
        return native.gdn_serial(q, k, v, g, beta, state, lib=lib)
    return native.gdn_chunkwise(q, k, v, g, beta, state, chunk=2, lib=lib)


def flushes(lib) -> bool:
    results = [denormal_state_call(lib, form) for form in ("serial", "chunkwise")]
    return all(not out.any() and not state.any() for out, state in results)


def numpy_sees_denormals() -> bool:
    return bool((np.full(4, DENORMAL, np.float32) * np.float32(2)).any())


def on_a_fresh_thread(fn):
    """fn() on a thread of its own (the FP mode is per thread: a planted bug that leaves it changed
    must not leak into the rest of the test session)."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("value", fn()))
    t.start()
    t.join()
    return box["value"]


def test_kernels_flush_denormals_as_the_device_programs_do():
    assert flushes(native.library())


def test_the_caller_gets_its_own_fp_mode_back():
    def check(lib):
        before = numpy_sees_denormals()
        flushes(lib)
        return before, numpy_sees_denormals()

    assert on_a_fresh_thread(lambda: check(native.library())) == (True, True)


def test_library_without_the_flush_is_caught():
    # planted: the entry points never set FTZ/DAZ (the host library as it was: IEEE denormals)
    lib = mutant_library("tb_parallel.c", "if ((now & FLUSH_BITS) != FLUSH_BITS) fp_set(now | FLUSH_BITS);",
                         "(void)now;")
    assert not flushes(lib)


def test_library_that_keeps_the_flush_on_the_caller_is_caught():
    # planted: the mode is set and never given back (numpy on the calling thread then flushes too)
    lib = mutant_library("tb_parallel.c", "if ((now & FLUSH_BITS) != mode.saved) fp_set((now & ~FLUSH_BITS) | mode.saved);",
                         "(void)now;")

    def check():
        before = numpy_sees_denormals()
        flushes(lib)
        return before, numpy_sees_denormals()

    assert on_a_fresh_thread(check) == (True, False)


def test_same_bits_at_any_thread_count():
    x = small_inputs(heads=5)
    one = native.gdn_chunkwise(*x, chunk=16, threads=1)
    for threads in (2, 3, 5, 8):
        got = native.gdn_chunkwise(*x, chunk=16, threads=threads)
        assert all(np.array_equal(a, b) for a, b in zip(one, got)), threads


POOL_PROBE = """
import json, sys
from pathlib import Path
from testbed.backends.native import library as native
from tests.test_native_pool import pool_threads, small_inputs
lib = native.load_library(Path(sys.argv[1]))
x = small_inputs()
before = pool_threads()
native.gdn_chunkwise(*x, chunk=16, threads=2, lib=lib)
first = pool_threads()
later = []
for _ in range(int(sys.argv[2])):
    native.gdn_serial(*x, threads=2, lib=lib)
    native.gdn_chunkwise(*x, chunk=16, threads=2, lib=lib)
    later.append(sorted(pool_threads()))
print(json.dumps({"before": sorted(before), "first": sorted(first), "later": later,
                  "workers": lib.tb_pool_workers()}))
"""


def pool_probe(lib_path, calls=30) -> dict:
    """In a fresh process with only this library loaded (the pool's threads are named tb_pool, the
    same name in every build): its tb_pool threads before any call, after one 2-thread call, and
    after each of `calls` pairs of 2-thread calls."""
    import json
    import subprocess
    import sys

    from testbed import PROJECT_ROOT

    p = subprocess.run([sys.executable, "-c", POOL_PROBE, str(lib_path), str(calls)], cwd=PROJECT_ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def pool_is_kept(probe: dict) -> bool:
    """No pool before the first call; one worker after it, the same thread through every later call."""
    return (not probe["before"] and len(probe["first"]) == 1 == probe["workers"]
            and all(tids == probe["first"] for tids in probe["later"]))


def test_the_pool_starts_its_threads_once():
    assert pool_is_kept(pool_probe(native.library_path()))
    # in this process: more threads than the pool holds, it grows once, then stays
    lib = native.library()
    x = small_inputs()
    native.gdn_chunkwise(*x, chunk=16, threads=3)
    grown = pool_threads()
    assert len(grown) >= 2 and lib.tb_pool_workers() >= 2
    for _ in range(10):
        native.attention(*attention_inputs(), 0.25, threads=3)
        native.gdn_serial(*x, threads=2)
    assert pool_threads() == grown


def attention_inputs():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((4, 3, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 20, 16)).astype(np.float32) for _ in range(2))
    return q, k, v, np.zeros((4, 3, 20), np.float32)


def test_a_pool_whose_workers_end_after_each_call_is_caught():
    # planted: each worker leaves after its range, so every call starts a new thread (the cost the
    # pool removes, as the library did before it had one)
    lib = mutant_library("tb_parallel.c", "if (--pool.pending == 0) pthread_cond_signal(&pool.done);",
                         "if (--pool.pending == 0) pthread_cond_signal(&pool.done);\n"
                         "        pool.workers--;\n        pthread_mutex_unlock(&pool.lock);\n        return NULL;")
    assert not pool_is_kept(pool_probe(lib._name, calls=5))


def test_calls_from_several_threads_at_once_share_the_pool():
    # ctypes lets go of the GIL: two Python threads can be inside the library together
    x = small_inputs(heads=6)
    want = native.gdn_chunkwise(*x, chunk=16, threads=1)
    errors = []

    def caller():
        for _ in range(20):
            got = native.gdn_chunkwise(*x, chunk=16, threads=2)
            if not all(np.array_equal(a, b) for a, b in zip(want, got)):
                errors.append("different bits")

    callers = [threading.Thread(target=caller) for _ in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in callers) and not errors


def test_a_forked_child_computes_with_threads():
    x = small_inputs()
    want = native.gdn_chunkwise(*x, chunk=16, threads=2)  # the parent's pool exists
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            got = native.gdn_chunkwise(*x, chunk=16, threads=2)
            code = 0 if all(np.array_equal(a, b) for a, b in zip(want, got)) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung in a 2-thread kernel call (a pool without its workers)")
