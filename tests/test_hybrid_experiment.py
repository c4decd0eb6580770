"""The `hybrid` experiment through the CLI: oracle records, the crossover, tail and drift records and
tables, sweeps over the GDN chunk and the context, and bad input refused in one line."""

import itertools

import numpy as np
import pandas as pd
import pytest

from testbed import cli
from testbed.experiments import hybrid
from testbed.results import ResultsStore

SMALL = ["chunk=16", "gdn_chunk=8", "oracle.prompt_tokens=60", "oracle.past=[0,20]", "oracle.tokens=[16,5]",
         "oracle.tails=[3]"]
TINY_BENCH = ["bench.shape.vocab=128", "bench.shape.hidden=32", "bench.shape.layers=4", "bench.shape.mlp=64",
              "bench.shape.heads=2", "bench.shape.kv_heads=1", "bench.shape.head_dim=16",
              "bench.shape.linear_k_heads=1", "bench.shape.linear_v_heads=2", "bench.shape.linear_head_dim=16",
              "bench.prefill_chunk=16", "bench.reps=1", "bench.warmup=0"]


def records(results_dir):
    return ResultsStore(results_dir).records("hybrid")


@pytest.mark.parametrize("backend", ["refimpl", "native"])
def test_oracle_mode_passes_and_says_where_it_ran(results_dir, backend):
    assert cli.main(["run", "hybrid", f"backend={backend}", "mode=oracle", *SMALL]) == 0
    rows = records(results_dir)
    last = {"refimpl": "pad_identity", "native": "tail_bytes"}[backend]
    assert {r["oracle"] for r in rows} == {"token", "state", "naive", "first_token", "tail_state", last}
    assert all(r["verdict"] == "pass" and r["device"] == "host" and r["backend"] == backend for r in rows)
    assert {r["params"]["gdn"] for r in rows} == {"serial", "chunkwise"}
    if backend == "refimpl":
        # 2 chunk cases x 3 verdicts + 1 tail x 2 verdicts per form; pad identity where bit-exact is due
        assert len(rows) == 2 * 8 + 1 and not any(r["evidence"] for r in rows)
        return
    # the engine in C, run as a program on the host like on any device: 3 verdicts per tail
    assert len(rows) == 2 * 9
    assert all(ran["ran"] == "tb_hybrid_bench" and ran["device"] == "host" for r in rows for ran in r["evidence"])
    token = next(r for r in rows if r["oracle"] == "token" and r["params"]["past"] == 20)
    # the token at every chunk boundary: the past's calls (P=20 in C=16: 16, then 4) and the case's
    assert token["metrics"]["boundaries"] == [15, 19, 24] and token["metrics"]["calls"] == 3
    tail = next(r for r in rows if r["oracle"] == "tail_bytes")
    assert tail["metrics"]["bitexact"] and len(tail["evidence"]) == 3  # padded, exact, scalar


def test_oracle_mode_fails_when_refimpl_swaps_the_gdn_head_maps(results_dir, monkeypatch):
    """refimpl.gdn.key_heads giving the tiled map for `interleaved`: redecode and the chunk path both run
    the GDN layers through it and agree; only the naive float64 model (its own head map) can fail them."""
    from refimpl import gdn

    right = gdn.key_heads
    other = {"tiled": "interleaved", "interleaved": "tiled"}
    monkeypatch.setattr(gdn, "key_heads", lambda h_k, h_v, head_map="tiled": right(h_k, h_v, other[head_map]))
    assert cli.main(["run", "hybrid", "backend=refimpl", "mode=oracle", *SMALL]) == 1
    failed = [r for r in records(results_dir) if r["verdict"] != "pass"]
    assert {r["oracle"] for r in failed} == {"naive"}
    assert len(failed) == 2 * 2  # every chunk case of both forms
    assert all(r["metrics"]["nmse"] > r["config"]["threshold"] for r in failed)


def test_measurements_write_records_and_tables(results_dir, capsys):
    assert cli.main(["run", "hybrid", "backend=native", "mode=bench", *SMALL, *TINY_BENCH, "bench.contexts=[32,64]",
                     "bench.tails=[0,3,9]", "bench.drift_tokens=[40]"]) == 0
    rows = records(results_dir)
    cross = [r for r in rows if r["params"]["part"] == "crossover"]
    assert sorted((r["params"]["context"], r["params"]["model"]) for r in cross) == sorted(
        (L, m) for L in (32, 64) for m in hybrid.MODELS)
    for r in cross:
        fig = r["figures"]["tokens_per_s"]
        assert fig["reps"] == 1 and fig["min"] <= fig["median"] <= fig["max"] and r["work"]["flops"] > 0
    by_model = {r["params"]["model"]: r for r in cross if r["params"]["context"] == 64}
    assert by_model["dense"]["params"]["layer_types"] == "ffff"
    assert by_model["hybrid-serial"]["params"]["layer_types"] == "lllf"
    assert by_model["dense"]["work"]["flops"] > by_model["hybrid-serial"]["work"]["flops"]  # attention grows in L
    # seed 002's dense model: as deep as brings its weights closest to the hybrid's
    similar = by_model["dense-similar"]
    assert set(similar["params"]["layer_types"]) == {"f"}
    assert abs(similar["work"]["params"] - by_model["hybrid-serial"]["work"]["params"]) <= \
        abs(by_model["dense"]["work"]["params"] - by_model["hybrid-serial"]["work"]["params"])
    # the engine program computed every figure, with FTZ on, each from its own runs
    assert all(r["params"]["ftz"] and r["evidence"] and r["evidence"][0]["ran"] == "tb_hybrid_bench" for r in cross)
    assert by_model["hybrid-serial"]["metrics"]["median_log_decay"] == pytest.approx(-0.1, abs=0.08)
    tails = {(r["params"]["tail"], r["params"]["mode"]): r for r in rows if r["params"]["part"] == "tail"}
    assert set(tails) == {(t, m) for t in (0, 3, 9) for m in ("padded", "scalar")}
    # the padded tail computes a whole chunk where the scalar one computes 3 rows; tail 0 pads nothing
    assert tails[(3, "padded")]["work"]["flops"] > tails[(3, "scalar")]["work"]["flops"]
    assert tails[(0, "padded")]["work"]["flops"] == tails[(0, "scalar")]["work"]["flops"]
    drift = {r["params"]["precision"]: r["metrics"] for r in rows if r["params"]["part"] == "drift"}
    assert set(drift) == {"fp16-acc32", "fp16-acc16"}
    # fp16 rounding moves the logits, but far less than a wrong model would
    assert 0 < drift["fp16-acc32"]["nmse_logits"] < 1e-2 and drift["fp16-acc32"]["token_agreement"] > 0.9
    out = capsys.readouterr().out
    assert "chunkwise x serial" in out and "seed dense" in out and "dense-similar" in out
    assert "tokens per CPU s" in out and "decoder weights" in out
    assert "fitted crossover L" in out and "breakeven" in out and "NMSE logits" in out
    assert cli.main(["table", "hybrid"]) == 0
    assert "hybrid-chunkwise" in capsys.readouterr().out


def test_crossover_from_a_fit_of_seconds_per_token():
    """Dense: 1 ms + 1 us * L per token; hybrid: 3 ms flat. Crossover at L = 2000, beyond 512..1024."""
    rows = [{"context": L, "model": m, "tokens/s": 1 / s}
            for L in (512, 1024) for m, s in (("dense", 1e-3 + 1e-6 * L), ("hybrid-serial", 3e-3))]
    got = hybrid.crossover_context(pd.DataFrame(rows), "hybrid-serial")
    assert got == {"first measured L where faster": None, "fitted crossover L": 2000}


def test_sweep_over_gdn_chunk_and_context(results_dir, capsys):
    assert cli.main(["sweep", "experiment=hybrid", "backend=native", "mode=crossover", *TINY_BENCH,
                     "gdn_chunk=4,16", "bench.contexts=32,64"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()  # the sweep's table: a row per job (the one experiment said above it, to fit)
    ruled = next(i for i, line in enumerate(lines) if line.startswith("| -"))
    assert len(list(itertools.takewhile(lambda line: line.startswith("| "), lines[ruled + 1:]))) == 4, out
    assert "crossover with dense: hybrid-serial:" in out


@pytest.mark.parametrize("overrides, message", [
    (["backend=refimpl", "device=qemu-aarch64"], "backend=refimpl runs on the host; for device=qemu-aarch64 use "
                                                 "backend=native"),
    (["+model.foo=1"], "unknown key 'model.foo'"),
    # `+` on a key the experiment has is that key: the folder is read (no longer the synthetic model run)
    (["+model.checkpoint=/nowhere"], "checkpoint folder /nowhere has no config.json"),
    (["model.expected_token=999"], "model.expected_token=999 is not accepted; accepted: null or 0..255"),
    (["mode=crossover", "model.expected_token=3"], "mode=crossover runs no oracle"),
    (["model.checkpoint=/nowhere/qwen"], "/nowhere/qwen"),
    (["model.prompt='some words'"], "is text (not seed, nor a .json, .npy or .txt file) and the model has no tokenizer"),
    (["oracle.tails=[40]", "oracle.past=[0]", "oracle.tokens=[64]", "oracle.prompt_tokens=100"],
     "oracle.tails=[40] need prompts of chunk=64"),
    (["oracle.past=[0]", "oracle.tokens=[16,5]"], "oracle.past has 1 entries and oracle.tokens 2"),
    (["chunk=16", "oracle.tokens=[64,52,1,64]"], "oracle case P=0, n=64 does not fit chunk=16"),
    (["mode=tail", "chunk=16", "bench.tails=[20]"], "tail 20 is not shorter than chunk=16"),
    (["mode=fast"], "mode='fast' is not accepted"),
    (["bench.shape.heads=3"], None),
    (["backend=engine", "engine=llamacpp"], "mode=all is not run for backend=engine; accepted: mode=oracle"),
    (["backend=engine", "engine=llamacpp", "mode=oracle", "model.gguf=/nowhere/m.gguf"],
     "model.gguf='/nowhere/m.gguf' is not accepted; accepted: auto, or a qwen35 .gguf file on this host"),
])
def test_bad_input_is_refused_in_one_line(results_dir, capsys, overrides, message):
    if message is None:  # checked when the model is built: heads must divide by kv_heads
        assert cli.main(["run", "hybrid", "mode=crossover", "bench.contexts=[8]", *overrides]) != 0
        assert "heads (3) must be a multiple of kv_heads (2)" in capsys.readouterr().err
        return
    assert cli.main(["run", "hybrid", *overrides]) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def crossover_rows(chunkwise: float, spread: float, emulated: bool = False, own_chunkwise: float = 50.0):
    """Stored-record rows of one context: rates per model with each repetition within +-spread, and the
    recurrence's own CPU ms (the engine's timer; counted: the whole count stands for it)."""
    rates = {"dense": 900.0, "dense-similar": 700.0, "hybrid-serial": 650.0, "hybrid-chunkwise": chunkwise,
             "hybrid-no-recurrence": 800.0}
    field = "tokens_per_ginstr" if emulated else "tokens_per_cpu_s"
    own = {"hybrid-serial": 100.0, "hybrid-chunkwise": own_chunkwise, "hybrid-no-recurrence": 0.0}
    return pd.DataFrame([{"kind": "measure", "device": "qemu-arm32" if emulated else "host", "backend": "native",
                          "emulated": emulated, "params.part": "crossover", "params.context": 512, "params.model": m,
                          "params.ftz": True, f"figures.{field}.median": r, f"figures.{field}.min": r * (1 - spread),
                          f"figures.{field}.max": r * (1 + spread),
                          **({"figures.instructions.median": 1e9 * 512 / r} if emulated else
                             {"figures.gdn_cpu_time.median": own.get(m, np.nan), "figures.cpu_time.median": 1e3 * 512 / r})}
                         for m, r in rates.items()])


def test_each_row_where_chunkwise_is_not_faster_says_why():
    faster = hybrid.crossover_table(crossover_rows(700.0, 0.01))
    assert "why chunkwise is not faster" not in faster and faster.loc[0, "chunkwise x serial"] == 1.08
    assert faster.loc[0, "FTZ"] == "on"
    noisy = hybrid.crossover_table(crossover_rows(640.0, 0.05))
    # the recurrence's own timer: 100 ms serial, 50 chunkwise, of the serial hybrid's 787.7 ms
    assert noisy.loc[0, "recurrence alone: chunkwise x serial"] == 2.0 and noisy.loc[0, "GDN share"] == 0.127
    assert noisy.loc[0, "expected x serial"] == 1.07
    assert noisy.loc[0, "why chunkwise is not faster"] == (
        "the recurrence alone runs 2.00x faster chunkwise, but it is 13% of the serial hybrid's cost: the whole can "
        "gain 1.07x, inside the repetitions' spread (serial 617.5-682.5, chunkwise 608-672 tokens per CPU s): "
        "within noise")
    slower = hybrid.crossover_table(crossover_rows(600.0, 0.01, own_chunkwise=150.0))
    assert slower.loc[0, "why chunkwise is not faster"].startswith(
        "the chunkwise recurrence is 1.50x the serial one's cost here (13% of the serial hybrid)")
    counted = hybrid.crossover_table(crossover_rows(600.0, 0.01, emulated=True))
    # counted: each form's instructions minus the recurrence-free model's
    assert counted.loc[0, "rate"] == hybrid.RATE_COUNTS
    assert counted.loc[0, "recurrence alone: chunkwise x serial"] == round((1 / 650 - 1 / 800) / (1 / 600 - 1 / 800), 2)
    assert "the chunkwise recurrence is 1.44x the serial one's cost" in counted.loc[0, "why chunkwise is not faster"]
    # an emulated device's times alone are never a rate
    assert hybrid.crossover_table(crossover_rows(600.0, 0.01, emulated=True).rename(
        columns=lambda c: c.replace("tokens_per_ginstr", "tokens_per_cpu_s"))).empty


def test_the_default_crossover_has_the_repetitions_an_interval_needs():
    """At its default bench.reps the crossover is an interval or "undecided (need N more)", never "too few
    for an interval" (3 repetitions gave no interval)."""
    from testbed import config
    from testbed.measure import decisions

    assert config.load(["experiment=hybrid"]).cfg.bench.reps >= decisions.MIN_REPS


def test_a_gguf_testbeds_reader_refuses_stores_no_run(results_dir, capsys, tmp_path):
    """model.gguf is read (header and tensor table) before the run starts: a file that is no GGUF is one line,
    exit 2, and nothing in the store."""
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**62).to_bytes(8, "little") * 2)
    assert cli.main(["run", "hybrid", "backend=engine", "engine=llamacpp", "mode=oracle", f"model.gguf={bad}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err and "the header claims 4611686018427387904 key-value" in err
    assert not (results_dir / "records.jsonl").exists()
