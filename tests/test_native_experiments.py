"""`testbed run gdn backend=native` and `testbed run native_bench`: records stored, bad input refused
before any work with one line and exit status 2."""

import pandas as pd
import pytest

from testbed import cli, config, runner
from testbed.backends.native import build as kernel_build
from testbed.measure import blas_reference


def run(overrides, experiment):
    return runner.execute(config.load(overrides, experiment=experiment))


def test_gdn_native_oracles_and_bench_records(results_dir):
    outcome = run(["backend=native", "matrix=awkward", "bench.tokens=[70]", "bench.head_size=32",
                   "bench.heads=2", "bench.reps=1", "threads=2"], "gdn")
    df = outcome.frame()
    oracles = df[df["kind"] == "oracle"]
    assert len(oracles) and (oracles["verdict"] == "pass").all()
    assert set(oracles["oracle"]) == {"nmse", "bitexact"}
    measured = df[df["kind"] == "measure"]
    # the forms' records, and the run's machine probe (numpy's sgemm on the kernel's thread count)
    probe = measured[measured["params.role"] == "machine_probe"]
    bench = measured[measured["params.role"] != "machine_probe"]
    assert len(probe) == 1 and probe["figures.sgemm.role"].iloc[0] == "machine_probe"
    assert sorted(bench["params.form"]) == ["chunkwise", "serial"]
    assert (bench["params.threads"] == 2).all()
    assert (bench["artifacts.kernels_source_hash"] == kernel_build.source_hash()).all()
    assert (results_dir / "records.jsonl").exists()


def test_native_bench_records_ratios(results_dir):
    outcome = run(["attention.past=40", "attention.chunk=8", "attention.head_dim=32", "cache.window=32",
                   "cache.real=5", "bench.reps=2", "bench.warmup=0", "bench.cold_mb=8", "ratios.reps=0"],
                  "native_bench")
    df = outcome.frame()
    measured = df[df["kind"] == "measure"]
    attention = measured[measured["params.kernel"] == "attention"]
    assert sorted(attention["params.form"]) == ["chunk", "decode_step_cold", "decode_step_hot", "decode_steps"]
    chunk_vs_steps = attention[attention["params.form"].isin(["chunk", "decode_steps"])]
    assert (chunk_vs_steps["metrics.speedup_vs_decode"] > 0).all()
    one_step = attention[attention["params.form"].str.startswith("decode_step_")]
    assert (one_step["figures.bandwidth.unit"] == "GB/s").all() and (one_step["work.bytes"] > 0).all()
    cache = measured[measured["params.kernel"] == "sliding_cache"]
    assert set(cache["params.form"]) == {"exact_append", "snapshot", "padded_append", "rollback"}
    assert (cache["metrics.rollback_vs_decode_step"] >= 0).all()
    # every timed call computed the full result: both attention forms and the rolled-back cache checked
    oracles = df[df["kind"] == "oracle"]
    assert len(oracles) == 3 and (oracles["verdict"] == "pass").all()
    assert all(ev and ev[0]["device"] == "host" for ev in df["evidence"])


def test_native_bench_ratios_are_per_repetition_of_interleaved_variants(results_dir):
    reps = 3
    outcome = run(["attention.past=40", "attention.chunk=8", "attention.head_dim=32", "cache.window=32",
                   "cache.real=5", "bench.reps=1", "bench.warmup=0", "bench.cold_mb=8", f"ratios.reps={reps}",
                   "ratios.key_counts=[16,96]", "ratios.gdn.heads=2", "ratios.gdn.head_size=32",
                   "ratios.gdn.tokens=[70]", "ratios.gdn.kda=[false,true]", "ratios.gdn.chunk=16", "ratios.sgemm=64",
                   "ratios.gemm=48", "ratios.ggml=false", "ratios.torch=false"], "native_bench")
    df = outcome.frame()
    part = df[df["params.part"] == "ratios"]
    variants = part[(part["kind"] == "measure") & (part["params.kernel"] != "ratio")
                    & ~part["params.kernel"].str.endswith(" reference")].set_index("params.kernel")
    kernels = ["attention keys=16", "attention keys=96", "gdn chunkwise T=70", "gdn chunkwise T=70 kda", "gemm"]
    # every candidate library is a variant of its own; "sgemm" is the one chosen (the faster), under that name
    libraries = [f"sgemm ({lib})" for lib, why in blas_reference.libraries().items() if why is None]
    assert sorted(variants.index) == sorted([*kernels, *libraries, "sgemm"])
    chosen = variants.loc["sgemm"]
    assert chosen["work.variant"] == f"sgemm ({chosen['metrics.reference_library']})"
    assert chosen["figures.gflops_cpu.median"] == variants.loc[chosen["work.variant"], "figures.gflops_cpu.median"]
    timed = variants.loc[[*kernels, *libraries]]
    # every repetition ran every variant once: their positions fill 0..n-1 in each repetition
    for positions in zip(*timed["metrics.interleave.positions"]):
        assert sorted(positions) == list(range(len(timed)))
    for rate in ("gflops", "gflops_cpu"):
        assert (variants[f"figures.{rate}.reps"] == reps).all() and (variants[f"figures.{rate}.min"] > 0).all()
    assert (variants["metrics.wall_over_cpu"] > 0).all()
    assert (part["params.fused"] == False).all()  # noqa: E712 - the bit-exact build unless asked
    ratios = part[part["params.kernel"] == "ratio"].set_index(["params.top", "params.bottom"])
    targets = ratios["metrics.target"].to_dict()
    # issue 45's goals against the best library (issue 14's for attention at many keys over few)
    assert targets == {("attention keys=96", "attention keys=16"): 0.8, ("attention keys=16", "sgemm"): 0.85,
                       ("attention keys=96", "sgemm"): 0.85, ("gdn chunkwise T=70", "sgemm"): 0.75,
                       ("gdn chunkwise T=70 kda", "sgemm"): 0.7, ("gemm", "sgemm"): 0.9}
    for (top, bottom), r in ratios.iterrows():
        # a ratio per repetition: within the ratios of the two variants' extreme rates
        fig = {k: r[f"figures.ratio_cpu.{k}"] for k in ("median", "min", "max", "reps")}
        assert fig["reps"] == reps and fig["min"] <= fig["median"] <= fig["max"]
        high, low = variants.loc[top], variants.loc[bottom]
        slack = 1 + 1e-9  # the same quotients, taken in another order
        assert high["figures.gflops_cpu.min"] / low["figures.gflops_cpu.max"] <= fig["min"] * slack
        assert fig["max"] <= high["figures.gflops_cpu.max"] / low["figures.gflops_cpu.min"] * slack
    # every timed kernel computed the full result
    checked = part[part["kind"] == "oracle"]
    assert sorted(checked["params.kernel"]) == kernels
    assert (checked["verdict"] == "pass").all()
    # the missing references say why
    missing = part[part["params.kernel"].str.endswith(" reference")]
    assert set(missing["metrics.reference_missing"]) == {"ratios.ggml=false", "ratios.torch=false"}


def test_native_bench_against_ggml_and_torch_times_and_judges_at_most(results_dir, monkeypatch):
    """ggml's op and transformers' chunkwise as time references: ratios of times, targets at most."""
    from testbed.experiments import native_bench

    pytest.importorskip("transformers", exc_type=ImportError)
    monkeypatch.setattr(native_bench, "ggml_program", lambda cfg, ctx: (None, "not built in this test"))
    outcome = run(["attention.past=40", "attention.chunk=8", "attention.head_dim=32", "cache.window=32",
                   "cache.real=5", "bench.reps=1", "bench.warmup=0", "bench.cold_mb=8", "ratios.reps=2",
                   "ratios.key_counts=[16,96]", "ratios.gdn.heads=2", "ratios.gdn.head_size=32",
                   "ratios.gdn.tokens=[600]", "ratios.gdn.kda=false", "ratios.sgemm=64", "ratios.gemm=48",
                   "ratios.torch=true"], "native_bench")
    df = outcome.frame()
    ratio = df[(df["params.kernel"] == "ratio") & (df["params.bottom"] == "torch T=600")].iloc[0]
    assert ratio["metrics.target"] == 0.25 and ratio["metrics.target_is"] == "at most"
    assert ratio["metrics.meets_target_cpu"] == (ratio["figures.ratio_cpu.median"] <= 0.25)
    torch_oracle = df[(df["kind"] == "oracle") & (df["params.kernel"] == "torch T=600")]
    assert (torch_oracle["verdict"] == "pass").all() and len(torch_oracle) == 1


@pytest.mark.parametrize("argv,says", [
    (["run", "gdn", "threads=2"], "threads=2 needs backend=native"),
    (["run", "gdn", "backend=native", "threads=0"], "threads=0 is out of range"),
    (["run", "native_bench", "cache.real=65"], "cache.real=65 exceeds attention.chunk=64"),
    (["run", "native_bench", "cache.window=64"], "does not fit the cache tail"),
    (["run", "native_bench", "ratios.key_counts=[32,8192]"], "ratios.key_counts=[32, 8192] is not accepted"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, results_dir, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err
    assert not (results_dir / "records.jsonl").exists()


def test_chunk_prefill_on_the_native_engine_passes_its_oracles(results_dir):
    outcome = run(["backend=native", "mode=all", "bench.reps=2", "bench.warmup=0"], "chunk_prefill")
    df = outcome.frame()
    oracles = df[df["kind"] == "oracle"]
    assert len(oracles) and (oracles["verdict"] == "pass").all() and (df["backend"] == "native").all()
    # every verdict and figure names the engine run it came from, timed by the program itself
    for oracle, runs in zip(df["oracle"], df["evidence"]):  # mask_heads runs the engine's attention kernel alone
        program = "tb_attention_bench" if oracle == "mask_heads" else "tb_model_bench"
        assert runs and all(r["ran"] == program and len(r["sha256"]) == 64 for r in runs)
    timed = df[df["params.form"] == "chunk_call"]
    # the device's clock: the two timed chunk calls
    seconds = timed["evidence"].iloc[0][0]["device_seconds"]
    assert seconds == pytest.approx(timed["figures.time.min"].iloc[0] + timed["figures.time.max"].iloc[0])


def test_tail_on_the_native_engine_passes_its_oracles(results_dir):
    """The padded-tail engine in C: byte-identical cache grid of whole prefills and first-token suite."""
    tiny = ["shape.vocab=256", "shape.hidden=64", "shape.heads=4", "shape.head_dim=16", "shape.mlp=128"]
    outcome = run(["backend=native", "mode=all", *tiny, "oracle.grid_windows=[16]", "oracle.grid_sinks=[0,3]",
                   "prompt_tokens=[140]", "reps=2", "warmup=0"], "tail")
    df = outcome.frame()
    oracles = df[df["kind"] == "oracle"]
    assert set(oracles["oracle"]) == {"cache_bytes", "first_token", "determinism", "telemetry", "exact_state",
                                      "naive"}
    assert (oracles["verdict"] == "pass").all() and (df["backend"] == "native").all()
    grid = oracles[oracles["oracle"] == "cache_bytes"]
    assert {"eviction by pads only", "overshoot"} <= set(grid["metrics.covers"])
    bench = df[df["kind"] == "measure"]
    assert sorted(bench["params.mode"]) == ["padded", "scalar"]
    assert set(bench["metrics.telemetry.tail_mode"]) == {"padded", "scalar"}
    assert all(runs and runs[0]["ran"] == "tb_model_bench" for runs in df["evidence"])


def test_the_native_engine_scales_the_global_layers_rope_as_the_model_says(results_dir):
    """Gemma 3 4B and up divide the global layers' RoPE frequencies by a linear factor (8); the engine
    must take it from the model (it once ignored it: every global layer rotated at the unscaled rate)."""
    scaled = ["+model.overrides.rope_global=5000.0", "+model.overrides.rope_scaling_global=4.0",
              "+model.overrides.window=16", "chunk=8", "cases=[{past: 40, tokens: 11}]"]
    oracles = run(["backend=native", "mode=oracle", *scaled], "chunk_prefill").frame().query("kind == 'oracle'")
    assert len(oracles) and (oracles["verdict"] == "pass").all(), oracles[["case", "oracle", "detail"]]
