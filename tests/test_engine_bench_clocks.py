"""Engine benches never time by the wall clock alone (issue 45): on a loaded host llama.cpp's chunk call read
111 ms wall against 17.7 ms CPU. The engine backend's bench (chunk_prefill backend=engine mode=bench) and
engine_bench record each call's CPU time beside its wall time, and instructions where they were counted;
testbed's engine is offered through the contract in the build `fused=true` runs (engines/testbed-c-fused.yaml),
the one to set against llama.cpp's FMA build. No speed is asserted: what is recorded, and that it is the
right build."""

from __future__ import annotations

import json

import pytest

from testbed import config, runner
from testbed.backends.engine import build as engine_build, spec as engine_spec

TINY_ENGINE = ["shape.vocab=256", "shape.hidden=64", "shape.layers=2", "shape.heads=4", "shape.kv_heads=2",
               "shape.head_dim=16", "shape.mlp=128", "chunk=16", "past=32", "bench.reps=2", "bench.warmup=0"]


def run(overrides, experiment):
    return runner.execute(config.load(overrides, experiment=experiment)).frame()


@pytest.mark.parametrize("engine,multiply_add", [("testbed-c", "unfused"), ("testbed-c-fused", "fused")])
def test_testbed_c_is_offered_in_both_builds_and_its_bench_records_cpu_beside_wall(engine, multiply_add,
                                                                                    results_dir):
    spec = engine_spec.load(engine)
    program = engine_build.program_for(spec, "host")
    assert json.loads((program.parent / "build.json").read_text())["multiply_add"] == multiply_add
    df = run(["backend=engine", f"engine={engine}", "mode=all", "cases=[{past: 5, tokens: 7}]", "chunk=4",
              "bench.past=16", "bench.reps=2"], "chunk_prefill")
    oracles = df[df["kind"] == "oracle"]
    assert len(oracles) and (oracles["verdict"] == "pass").all(), oracles[["case", "verdict", "detail"]]
    calls = df[(df["kind"] == "measure") & df["params.form"].isin(["chunk_call", "decode_step"])]
    assert len(calls) == 2
    for _, r in calls.iterrows():
        assert r["figures.time.reps"] == r["figures.cpu_time.reps"] == 2
        assert r["figures.cpu_time.median"] > 0 and r["figures.gflops_cpu.median"] > 0


def test_the_native_backends_bench_records_cpu_beside_wall(results_dir):
    df = run(["backend=native", "mode=bench", "bench.past=16", "chunk=4", "bench.reps=2"], "chunk_prefill")
    calls = df[(df["kind"] == "measure") & df["params.form"].isin(["chunk_call", "decode_step"])]
    assert len(calls) == 2 and (calls["figures.cpu_time.median"] > 0).all()


def test_engine_bench_records_the_other_clock_and_counted_instructions(results_dir):
    """counts=true on the host: one more engine run under valgrind, apart from the timed ones, gives each
    record a chunk call's and a decode step's exact instructions; every record carries both clocks."""
    df = run(["counts=true", *TINY_ENGINE], "engine_bench")
    measured = df[df["kind"] == "measure"]
    assert set(measured["params.form"]) == {"matmul_vs_sgemm", "decode_vs_stream"}
    for _, r in measured.iterrows():
        prefix = "chunk_call" if r["params.form"] == "matmul_vs_sgemm" else "decode_step"
        assert r[f"figures.{prefix}_other_clock.median"] > 0
        assert r[f"figures.{prefix}_instructions.median"] > 0
        assert r[f"figures.{prefix}_instructions.unit"] == "instructions"
    chunk = measured[measured["params.form"] == "matmul_vs_sgemm"].iloc[0]
    decode = measured[measured["params.form"] == "decode_vs_stream"].iloc[0]
    # a chunk call of 16 rows does more work than one decode step
    assert chunk["figures.chunk_call_instructions.median"] > decode["figures.decode_step_instructions.median"]
