"""What a program's and an engine's own clocks and counts become in the records.

Clocks. A copy of kernels/ whose clock (kernels/bench/harness.c now_seconds) idles IDLE seconds right after
it reads the time: every timed region then holds IDLE of wall time its CPU time does not, whatever else the
machine does. testbed-c built from that copy (a lab's engine) and its tb_gdn_bench: every figure, ratio and
piece of evidence read from the wall clock must exceed its CPU twin by the idle; one read from the CPU clock,
or a wall figure filled from it, cannot. Checked through chunk_prefill's bench (time and cpu_time) and tail's
(ttft and ttft_cpu), `testbed ab` of two engines, and gdn's bench on the native program.

Counts. testbed-c on qemu-aarch64 (which counts every instruction of a run) marks each call (tb_engine.h):
chunk_prefill's bench keeps each timed call's instructions, its evidence says "per call".

Planted (issue 44): wall and CPU seconds swapped where tail reads an engine's timed call and where the native
GDN runner reads its program's; the marks of timings.json ignored (testbed.backends.engine.runner._counts).
Each fails the checks the real code passes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from testbed import config, runner
from testbed.backends.engine import runner as engine_runner
from testbed.backends.native import build as kernel_build, gdn as native_gdn
from testbed.experiments import tail
from tests.mutants import mutant

IDLE = 0.05  # seconds idled inside every timed region
IDLING = ("    clock_gettime(CLOCK_MONOTONIC, &ts);\n    return",
          "    clock_gettime(CLOCK_MONOTONIC, &ts);\n"
          f"    {{ struct timespec idle = {{0, {int(IDLE * 1e9)}}}; nanosleep(&idle, NULL); }} /* planted */\n"
          "    return")
ENGINE_BENCH = ["mode=bench", "bench.past=8", "chunk=8", "bench.reps=2", "bench.warmup=0",
                "latency.utterance_tokens=[16]"]
TAIL_BENCH = ["mode=bench", "chunk=8", "tail=[3]", "reps=2", "warmup=0", "shape.hidden=64", "shape.layers=2",
              "shape.heads=2", "shape.kv_heads=1", "shape.head_dim=32", "shape.mlp=128", "shape.vocab=256",
              "shape.window=32"]
GDN_BENCH = ["backend=native", "mode=bench", "bench.tokens=[48]", "bench.heads=2", "bench.head_size=32",
             "bench.reps=2", "bench.warmup=0"]


def run(overrides, experiment):
    return runner.execute(config.load(overrides, experiment=experiment))


def samples(record: dict, figure: str) -> np.ndarray:
    """A figure's repetitions in seconds."""
    f = record["figures"][figure]
    return np.asarray(f["samples"], float) * {"s": 1.0, "ms": 1e-3}[f["unit"]]


def wall_over_cpu(rows: list[dict], wall: str, cpu: str) -> list[str]:
    """Where a record's wall figure does not exceed its CPU figure, repetition by repetition, by the idle."""
    return [f"{r['case']}: {wall} {samples(r, wall)} against {cpu} {samples(r, cpu)}" for r in rows
            if not (samples(r, wall) >= samples(r, cpu) + 0.9 * IDLE).all()]


@pytest.fixture(scope="module")
def idling(tmp_path_factory):
    """The idling copy of kernels/, and a lab holding testbed-c built from it (engines/idling.yaml)."""
    from tests.test_engine_contract import patched_lab_engine

    lab = tmp_path_factory.mktemp("lab")
    patched_lab_engine(lab, "idling", "bench/harness.c", *IDLING)
    return lab


@pytest.fixture
def lab(idling, monkeypatch):
    monkeypatch.setenv("TESTBED_LAB", str(idling))
    return idling


def engine_clock_problems() -> list[str]:
    """What is wrong with how the engine's clocks reach chunk_prefill's and tail's records."""
    problems = []
    rows = run(["backend=engine", "engine=idling", *ENGINE_BENCH], "chunk_prefill").rows
    calls = [r for r in rows if r["kind"] == "measure" and r["case"].endswith(("chunk_call", "decode_step"))]
    problems += [f"{r['case']}: time {samples(r, 'time')} is not wall time holding the idle" for r in calls
                 if not (samples(r, "time") >= 0.9 * IDLE).all()]
    problems += [f"{r['case']}: no cpu_time beside its time" for r in calls if "cpu_time" not in r["figures"]] or \
        wall_over_cpu(calls, "time", "cpu_time")
    for e in calls[0]["evidence"]:
        d = e["detail"]
        if not e["device_seconds"] >= d["cpu_seconds"] + 0.9 * IDLE * d["timed_calls"]:
            problems.append(f"evidence: device_seconds {e['device_seconds']} against cpu_seconds {d['cpu_seconds']} "
                            f"over {d['timed_calls']} calls")
    rows = run(["backend=engine", "engine=idling", *TAIL_BENCH], "tail").rows
    timed = [r for r in rows if r["kind"] == "measure" and "ttft" in r["figures"]]
    problems += wall_over_cpu(timed, "ttft", "ttft_cpu") or ([] if timed else ["tail recorded no ttft"])
    return problems


@pytest.mark.quick
def test_an_engines_wall_clock_reaches_the_wall_figures(lab, results_dir):
    assert engine_clock_problems() == []


def test_wall_and_cpu_swapped_where_tail_reads_an_engine_are_caught(lab, results_dir, monkeypatch):
    swapped = mutant(tail, "bench_records",
                     'return {"wall": float(timed[0]["wall_s"]), "cpu": float(timed[0]["cpu_s"])}',
                     'return {"wall": float(timed[0]["cpu_s"]), "cpu": float(timed[0]["wall_s"])}')
    monkeypatch.setattr(tail, "bench_records", swapped)
    assert engine_clock_problems() != []


def test_ab_of_two_engines_pairs_wall_with_wall_and_cpu_with_cpu(lab, results_dir):
    """A (the idling build) spends IDLE more wall time per call than B (testbed-c), the same CPU time: B/A by the
    wall clock is far below B/A by CPU time (at any load: it would take B's calls slowed 100 times)."""
    p = subprocess.run([sys.executable, "-m", "testbed", "ab", "engine:idling", "engine:testbed-c",
                        "experiment=chunk_prefill", "bench.past=8", "chunk=8", "--reps", "6"],
                       capture_output=True, text=True, cwd=kernel_build.ROOT)
    assert p.returncode in (0, 1), p.stderr
    records = [json.loads(line) for line in (results_dir / "records.jsonl").read_text().splitlines()]
    [ab] = [r for r in records if r.get("kind") == "measure"]
    wall, cpu = ab["figures"]["ab_ratio_wall"]["median"], ab["figures"]["ab_ratio_cpu"]["median"]
    assert wall < cpu / 5, (wall, cpu)
    assert ab["metrics"]["ab"]["a_ms"] >= 1e3 * IDLE


@pytest.fixture(scope="module")
def idling_gdn(tmp_path_factory):
    """tb_gdn_bench from the idling copy of kernels/ (one program's build)."""
    from tests.native_support import HYBRID_SOURCES, mutant_one_program

    return mutant_one_program("host", "bench/harness.c", *IDLING, "tb_gdn_bench", HYBRID_SOURCES).parent


def program_clock_problems() -> list[str]:
    rows = run(GDN_BENCH, "gdn").rows
    timed = [r for r in rows if r["kind"] == "measure" and "cpu_time" in r["figures"]]
    return wall_over_cpu(timed, "time", "cpu_time") or ([] if timed else ["no record has both clocks"])


def test_a_programs_wall_clock_reaches_the_wall_figures(idling_gdn, results_dir, monkeypatch):
    monkeypatch.setattr(native_gdn, "build_programs", lambda target, **kw: idling_gdn)
    assert program_clock_problems() == []


def test_wall_and_cpu_swapped_where_a_program_is_read_are_caught(idling_gdn, results_dir, monkeypatch):
    monkeypatch.setattr(native_gdn, "build_programs", lambda target, **kw: idling_gdn)
    swapped = mutant(native_gdn.NativeGDN, "bench", 'seconds[form] += result.timings["seconds"]',
                     'seconds[form] += result.timings.get("cpu_seconds") or []')
    monkeypatch.setattr(native_gdn.NativeGDN, "bench", swapped)
    assert program_clock_problems() != []


# --- counts ----------------------------------------------------------------------------------------------

AARCH64 = pytest.mark.skipif(shutil.which("qemu-aarch64") is None or shutil.which("aarch64-linux-gnu-gcc") is None,
                             reason="qemu-user and gcc-aarch64-linux-gnu (scripts/bootstrap.sh --test)")


def count_problems() -> list[str]:
    """What is wrong with testbed-c's per-call counts in chunk_prefill's bench on qemu-aarch64."""
    rows = run(["backend=engine", "engine=testbed-c", "device=qemu-aarch64", *ENGINE_BENCH], "chunk_prefill").rows
    calls = {r["case"].split("/")[-1]: r for r in rows if r["kind"] == "measure"}
    problems = [f"{name}: no per-call instructions" for name in ("chunk_call", "decode_step")
                if "instructions" not in calls[name]["figures"]]
    if not problems:
        chunk, step = (np.asarray(calls[n]["figures"]["instructions"]["samples"])
                       for n in ("chunk_call", "decode_step"))
        if not (len(chunk) == len(step) == 2 and (step > 0).all() and chunk.min() > 2 * step.max()):
            problems.append(f"chunk call {chunk}, decode step {step} instructions: not 2 repetitions each, the "
                            "chunk's 8 rows above twice one row's")
    counted = {e["detail"]["counted"] for r in calls.values() for e in r["evidence"]}
    if counted != {"per call (tb_engine.h marks)"}:
        problems.append(f"the evidence says the engine was counted {counted}")
    return problems


@AARCH64
def test_an_engines_marked_calls_are_counted_one_by_one(results_dir):
    assert count_problems() == []


@AARCH64
def test_marks_ignored_are_caught(results_dir, monkeypatch):
    ignored = mutant(engine_runner, "_counts", 'marks = tuple(timings.get("marks") or ())', "marks = ()")
    monkeypatch.setattr(engine_runner, "_counts", ignored)
    assert count_problems() != []
