"""engine_compare (testbed's engine against llama.cpp by llama-bench's measures) at a small shape: both engines
judged against the float64 model before anything is timed, then timed interleaved through the contract, and
the rows in llama-bench's columns beside testbed's table; a planted wrong engine is never timed where it is
wrong; the q8_0 GGUF and testbed's int8 file hold the same numbers; on qemu-aarch64 the rows are exact
instructions per token. No timed assertions: the figures are checked for what they are, never for speed.

The model is refimpl's tiny Gemma (vocab 256, hidden 64, six layers), whose rows are whole q8_0 blocks. testbed's
engine is testbed-c here (the unfused build the suite builds anyway; the experiment's default is the FMA build),
llama.cpp the adapter tb_llama_engine (libllama, built by the suite's llama.cpp tests). llama-bench itself and
the FunctionGemma-sized run are opt-in (`-m slow_build`): llama-bench builds llama.cpp's common library, and
the real shape's files are GBs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from refimpl import gemma
from testbed import config, runner
from testbed.backends.native import build as kernel_build
from testbed.experiments import engine_compare
from testbed.models import gguf_files
from tests.test_engine_contract import lab_engine

gguf = pytest.importorskip("gguf", reason="the full extra: pip install 'testbed[full]'", exc_type=ImportError)
pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="llama.cpp's tree comes with its build tools")

SMALL = ["model=tiny", "engine=testbed-c", "threads=[1]", "pp=32", "plan={past: 40, tokens: 7, chunk: 16}", "tg=4",
         "reps=2", "warmup=0", "llama_bench=false"]
LLAMA_BENCH_COLUMNS = ["engine", "model", "size", "params", "backend", "threads", "test", "t/s"]


def run(overrides, device="host"):
    return runner.execute(config.load([*SMALL, f"device={device}", *overrides], experiment="engine_compare"))


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    store = tmp_path_factory.mktemp("results")
    os.environ["TESTBED_RESULTS"] = str(store)
    try:
        return run(["weights=[f32,q8_0]"]).frame(), store
    finally:
        del os.environ["TESTBED_RESULTS"]


def test_both_engines_are_judged_first_then_timed_in_llama_benchs_columns(compared):
    df, _ = compared
    oracles, measures = df[df["kind"] == "oracle"], df[df["kind"] == "measure"]
    # judged: 2 weight types x 3 tests x 2 engines, each against the float64 model at the test's last position
    assert len(oracles) == 12 and (oracles["verdict"] == "pass").all(), oracles[["case", "detail"]].to_string()
    assert set(oracles["params.position"]) == {31, 46, 3}
    rows = measures[measures["params.row"].isin(["testbed", "llama.cpp"])]
    assert len(rows) == 12  # per weight type, test and engine
    for _, r in rows.iterrows():
        assert r["figures.tokens_per_s.reps"] == 2 and r["figures.tokens_per_s.median"] > 0
        assert r["figures.cpu_seconds.median"] > 0 and 0 < r["figures.cpu_use.median"]
        # the engine's own memory (VmHWM), not the size of the process that started it (ru_maxrss keeps that
        # across execve: this pytest process holds far more than a tiny model's engine)
        assert 0 < r["figures.peak_rss.median"] < 200, r["case"]
        assert r["metrics.params_count"] == sum(a.size for a in gemma.init_weights(gemma.tiny_config(), 0).values())
    q8 = rows[rows["params.weights"] == "q8_0"].groupby("params.row")["metrics.size_bytes"].first()
    assert q8["testbed"] > q8["llama.cpp"]  # int8 + a float32 scale per 32 against q8_0's float16 scale
    ratios = measures[measures["case"].str.contains("/testbed_vs_llama.cpp/")]
    assert len(ratios) == 12 and set(ratios["params.clock"]) == {"wall", "cpu"}
    assert ratios["metrics.goal"].eq(1.0).all() and ratios["metrics.met"].isin([True, False]).all()
    shown = engine_compare.bench_view(df)
    assert list(shown.columns) == LLAMA_BENCH_COLUMNS
    assert set(shown["test"]) == {"pp32", "pp7 @ d40", "tg4"} and set(shown["backend"]) == {"CPU"}
    assert all(" ± " in cell for cell in shown["t/s"])
    params = sum(a.size for a in gemma.init_weights(gemma.tiny_config(), 0).values())
    assert set(shown["model"]) == {f"gemma3 {params / 1e3:.0f}K F32", f"gemma3 {params / 1e3:.0f}K Q8_0"}


def test_the_table_renders_for_people_and_programs(compared):
    _, store = compared
    env = {**os.environ, "TESTBED_RESULTS": str(store), "PYTHONPATH": str(kernel_build.ROOT)}
    for fmt in ("md", "csv", "json", "jsonl"):
        p = subprocess.run([sys.executable, "-m", "testbed", "table", "engine_compare", "--format", fmt],
                           capture_output=True, text=True, env=env)
        assert p.returncode == 0, p.stderr
        if fmt == "json":
            data = json.loads(p.stdout)
            rows = data["rows"] if isinstance(data, dict) else data
            timed = [r for r in rows if r.get("t_per_s") is not None]
            assert len(timed) == 12 and all(isinstance(r["t_per_s"], float) for r in timed)
            assert all(len(r["samples"]["tokens_per_s"]) == 2 for r in timed)
            mine = [r for r in timed if r["engine"] == "testbed"]
            assert all(r["vs_llama.cpp_wall"] for r in mine)
        if fmt == "md":
            assert "| engine" in p.stdout and "t/s" in p.stdout and "vs llama.cpp CPU" in p.stdout
    # the terminal's 120 columns show each row's figures (the model's words, in llama-bench's table too, last)
    p = subprocess.run([sys.executable, "-m", "testbed", "table", "engine_compare"], capture_output=True, text=True,
                       env=env)
    header = next(line for line in p.stdout.splitlines() if line.startswith("| engine"))
    assert all(f" {name} " in header for name in ("type", "test", "t/s", "min", "max", "CPU ms/token", "peak RSS MiB"))


def test_a_planted_wrong_engine_is_never_timed_where_it_is_wrong(tmp_path, monkeypatch, results_dir):
    """testbed's engine with a planted fault (every utterance call starts from empty caches: the state is not
    carried between calls): tg (one call per token) and the plan (after its past) give wrong tokens and are
    never timed; pp (one call from empty caches) is right, and is timed. llama.cpp is timed everywhere. The
    lab's yaml lists f32 weights only: at q8_0 its rows are its refusal (not supported), never timed."""
    lab = tmp_path / "lab"
    monkeypatch.setenv("TESTBED_LAB", str(lab))
    lab_engine(lab, "forgetful", ("TB_FAULT_STATE_NOT_CARRIED",))
    df = run(["engine=forgetful", "weights=[f32,q8_0]"]).frame()
    refused = df[(df["kind"] == "oracle") & (df["params.weights"] == "q8_0") & (df["params.row"] == "testbed")]
    assert len(refused) == 3 and (refused["verdict"] == "not supported").all()
    assert "does not take int8 weights" in refused["detail"].iloc[0]
    df = df[df["params.weights"] == "f32"]
    oracles = df[df["kind"] == "oracle"].set_index(["params.row", "params.test"])
    assert oracles.loc[("testbed", "tg4"), "verdict"] == "fail"
    assert oracles.loc[("testbed", "pp7 @ d40"), "verdict"] == "fail"
    assert oracles.loc[("testbed", "pp32"), "verdict"] == "pass"
    assert "never timed" in oracles.loc[("testbed", "tg4"), "detail"]
    assert (oracles.xs("llama.cpp")["verdict"] == "pass").all()
    timed = df[(df["kind"] == "measure") & df["figures.tokens_per_s.median"].notna()]
    assert set(timed.loc[timed["params.row"] == "testbed", "params.test"]) == {"pp32"}
    assert set(timed.loc[timed["params.row"] == "llama.cpp", "params.test"]) == {"pp32", "pp7 @ d40", "tg4"}
    assert set(df.loc[df["case"].str.contains("/testbed_vs_"), "params.test"]) == {"pp32"}


@pytest.mark.skipif(shutil.which("qemu-aarch64") is None or shutil.which("aarch64-linux-gnu-g++") is None,
                    reason="qemu-user and g++-aarch64-linux-gnu (scripts/bootstrap.sh --test)")
def test_on_qemu_aarch64_the_rows_are_exact_instructions_per_token(results_dir):
    """Nothing timed there: each engine's judged run counted through its marks. testbed's counts are exact and
    repeat; libllama starts more than one guest thread, so the plugin says "exact": false for llama.cpp, whose
    counts differ between runs by up to about 1e-4 (43 and 2,816 of 27 million measured)."""
    df = run(["weights=[f32]", "tests=[pp,tg]", "threads=[1,2]"], device="qemu-aarch64").frame()
    oracles = df[df["kind"] == "oracle"]
    assert len(oracles) == 4 and (oracles["verdict"] == "pass").all()
    counted = df[df["kind"] == "measure"]
    assert set(counted["params.row"]) == {"testbed", "llama.cpp"} and set(counted["params.threads"]) == {1}
    assert counted["figures.instructions_per_token.median"].gt(0).all()
    assert counted.loc[counted["params.row"] == "testbed", "metrics.exact"].all()
    assert not [c for c in counted.columns if c.startswith(("figures.tokens_per_s", "figures.seconds"))]
    pp = counted[counted["params.test"] == "pp32"].set_index("params.row")
    assert (pp["figures.instructions.median"] == 32 * pp["figures.instructions_per_token.median"]).all()
    again = run(["weights=[f32]", "tests=[pp]"], device="qemu-aarch64").frame()
    again = again[again["kind"] == "measure"].set_index("params.row")["figures.instructions.median"]
    first = pp["figures.instructions.median"]
    assert again["testbed"] == first["testbed"]
    assert abs(again["llama.cpp"] / first["llama.cpp"] - 1) < 1e-3  # measured: 43 and 2,816 of 27 million apart
    shown = engine_compare.view(df)
    assert shown["instructions/token"].notna().sum() == len(counted)


def test_the_q8_0_gguf_and_testbeds_int8_file_hold_the_same_numbers(tmp_path):
    """q8_0 blocks (a float16 d and 32 int8 q) and testbed's int8 rows with a float32 scale per 32: testbed's
    own quantiser, given the q8_0 values q * d, gives back q and d exactly, so both files are one model."""
    cfg = gemma.tiny_config()
    w = gemma.init_weights(cfg, 3)
    held = gguf_files.held_in(w, "q8_0")
    path = gguf_files.gguf_of(cfg, w, cache=tmp_path, tensor_type="q8_0")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    blocks = tensors["blk.0.ffn_down.weight"]
    assert blocks.tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    raw = np.asarray(blocks.data).reshape(-1, 34)
    d, q = raw[:, :2].copy().view(np.float16).astype(np.float32)[:, 0], raw[:, 2:].copy().view(np.int8)
    from testbed.backends.native.engine import stored_tensors
    stored = stored_tensors({"m": held["model.layers.0.mlp.down_proj.weight"]}, "int8", 32)
    np.testing.assert_array_equal(stored["m"].reshape(-1, 32), q)
    np.testing.assert_array_equal(stored["m_scale"].reshape(-1), d)
    wt = engine_compare.model_files(cfg, w, "q8_0")  # checks testbed's file against the GGUF's values itself
    assert wt.held.keys() == w.keys()


def test_bad_settings_are_one_line_and_exit_2(results_dir):
    env = {**os.environ, "PYTHONPATH": str(kernel_build.ROOT)}
    for bad, says in ((["weights=[f32,bf16]"], "weights='bf16' is not accepted"),
                      (["weights=[f32,f32]"], "names a value twice"),
                      (["plan={past: 8, tokens: 20, chunk: 16}"], "plan.tokens=20"),
                      (["reference_engine=testbed-c"], "from a gguf model")):
        p = subprocess.run([sys.executable, "-m", "testbed", "run", "engine_compare", *SMALL, *bad],
                           capture_output=True, text=True, env=env)
        assert p.returncode == 2 and says in p.stderr, (bad, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.slow_build
def test_llama_bench_itself_gives_llama_cpps_row(results_dir):
    df = run(["weights=[f16]", "llama_bench=true", "tests=[pp,tg]"]).frame()
    bench = df[(df["kind"] == "measure") & (df["params.row"] == "llama-bench")]
    assert set(bench["params.test"]) == {"pp32", "tg4"}
    for _, r in bench.iterrows():
        assert r["figures.tokens_per_s.reps"] == 2 and r["metrics.llama_bench.model_n_params"] > 0
        assert 0 < r["figures.peak_rss.median"] < 500 and r["figures.process_cpu_seconds.median"] > 0
    assert set(df.loc[df["case"].str.contains("/testbed_vs_llama-bench/"), "params.test"]) == {"pp32", "tg4"}
    assert list(engine_compare.bench_view(df).columns) == LLAMA_BENCH_COLUMNS


@pytest.mark.slow_build
def test_the_functiongemma_shaped_model_is_judged_and_compared(results_dir):
    """The real shape (18 layers, hidden 640, vocab 262144: GBs of files, written once per content): q8_0,
    pp512 and tg128 through both engines and llama-bench, one repetition."""
    df = runner.execute(config.load(["weights=[q8_0]", "threads=[1]", "tests=[pp,tg]", "reps=1"],
                                     experiment="engine_compare")).frame()
    oracles = df[df["kind"] == "oracle"]
    assert len(oracles) == 4 and (oracles["verdict"] == "pass").all(), oracles[["case", "detail"]].to_string()
    shown = engine_compare.bench_view(df)
    assert set(shown["engine"]) == {"testbed", "llama.cpp", "llama-bench"} and set(shown["test"]) == {"pp512", "tg128"}
