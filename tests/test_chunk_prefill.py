"""Experiment chunk_prefill through the CLI: the sweep's verdicts and latency table, the seed's fixture
rendered by the same code, checkpoints from config, and bad input refused before anything runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from refimpl import gemma
from testbed import cli
from testbed.experiments import chunk_prefill as exp
from testbed.models import checkpoints
from testbed.results import ResultsStore

SMALL = ["cases=[{past:40,tokens:20}]", "bench.past=40", "bench.reps=2"]


def test_sweep_prints_both_verdicts_and_names_the_best_chunk(results_dir, capsys):
    assert cli.main(["sweep", "chunk=32,64"]) == 0  # the default experiment and the seed's cases
    out = capsys.readouterr().out
    assert "P=800,n=52,C=64:pass P=820,n=32,C=64:pass" in out
    assert "P=800,n=52,C=32:pass P=820,n=32,C=32:pass" in out
    assert "tiny on refimpl / host (measured)" in out and "seed 000 figures (mali-vulkan-valhall4" in out
    # the best C and chunked against token by token, each with its confidence: measured, then the seed's
    assert out.count("\nbest C by time: ") == 2 and out.count(" vs token by token by time: ") == 2
    records = ResultsStore(results_dir).records("chunk_prefill")
    oracles = [r for r in records if r["kind"] == "oracle"]
    assert len(oracles) == 16 and all(r["verdict"] == "pass" for r in oracles)  # 2 cases x 4 verdicts x 2 C
    timed = [r for r in records if r["params"].get("form") == "chunk_call"]
    assert sorted(r["params"]["chunk"] for r in timed) == [32, 64]
    assert all(r["figures"]["time"]["reps"] == 5 and r["work"]["flops"] > 0 for r in timed)
    assert len({r["artifacts"]["weights_sha256"] for r in records}) == 1


def test_seed_projection_is_reproduced_by_the_table_code():
    """The seed: at 0.26 s/token, a 15-token tool call projects to about 8.5 s (C=64) or 6.4 s (C=32)."""
    table, _ = exp.latency_table({32: 2.45, 64: 4.58}, 0.26, [15], None, 15)
    assert round(table.loc[0, "C=64 s"], 1) == 8.5 and round(table.loc[0, "C=32 s"], 1) == 6.4


def test_best_chunk_follows_the_length_distribution():
    times = {32: 2.45, 64: 4.58}
    assert exp.latency_table(times, 0.26, [60], None, 15)[1] == 64   # one call of 64 beats two of 32
    assert exp.latency_table(times, 0.26, [20], None, 15)[1] == 32
    table, best = exp.latency_table(times, 0.26, [20, 60], [1, 20], 15)
    assert best == 64 and table.iloc[-1]["utterance tokens"] == "expected"
    assert table.iloc[-1]["C=32 s"] == pytest.approx((table.loc[0, "C=32 s"] + 20 * table.loc[1, "C=32 s"]) / 21)


def test_fixture_is_rendered(results_dir):
    from testbed import config

    text = exp.render_fixture(config.load([], experiment="chunk_prefill").cfg)
    assert "C=32 2.45 s, C=64 4.58 s; decode 0.26 s/token" in text
    # the seed's figures are medians: they decide nothing, and say so
    assert "best C by time: undecided (medians only, no repetitions to resample, no confidence): 32 by the " \
           "medians alone" in text


def test_run_and_table(results_dir, capsys):
    assert cli.main(["run", "chunk_prefill", "chunk=16", *SMALL]) == 0
    assert "oracles 4 pass, 6 measurements" in capsys.readouterr().out
    assert cli.main(["table", "chunk_prefill", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["case"] for r in rows} >= {"P=40,n=20,C=16/token", "P=40,C=16/chunk_call", "n=52,C=16/projection"}


def test_pinned_token_is_checked_by_the_run(results_dir, capsys):
    base = ["run", "chunk_prefill", "mode=oracle", "chunk=16", *SMALL]
    assert cli.main(base) == 0
    token = [r for r in ResultsStore(results_dir).records() if r["oracle"] == "token"][0]["metrics"]["token_ref"]
    assert cli.main([*base, f"model.expected_token={token}"]) == 0
    wrong = (token + 1) % 256
    capsys.readouterr()
    assert cli.main([*base, f"model.expected_token={wrong}"]) == 1
    out = capsys.readouterr().out
    assert "FAIL P=40,n=20,C=16/token" in out and f"the config pins {wrong}" in out


def test_checkpoint_from_config(results_dir, tmp_path, capsys):
    cfg = gemma.tiny_config(layers=3, vocab=64, window=16)
    path = checkpoints.save_gguf(tmp_path / "m.gguf", cfg, gemma.init_weights(cfg, 5))
    np.save(tmp_path / "prompt.npy", np.arange(61) % 64)
    assert cli.main(["run", "chunk_prefill", "mode=oracle", "chunk=8", "cases=[{past:40,tokens:20}]",
                     f"model.checkpoint={path}", f"model.prompt={tmp_path / 'prompt.npy'}"]) == 0
    assert "oracles 4 pass" in capsys.readouterr().out


@pytest.mark.parametrize("override, message", [
    ("chunk=0", "chunk=0 is out of range"),
    ("backend=nope", "backend='nope' is not accepted; accepted: "),
    ("cases=[{past:0,tokens:3}]", "cases[0].past=0 is not accepted"),
    ("cases=[{past:5}]", "cases[0]={'past': 5} is not accepted"),
    ("model.expected_token=999", "model.expected_token=999 is not accepted; accepted: null or 0..255"),
    ("+model.overrides.windw=3", "model.overrides.windw is not a model field"),
    ("latency.weights=[1]", "latency.weights=[1] is not accepted"),
    ("cases=5", "cases=5 is not accepted; accepted: a non-empty list"),
    ("model.expected_token=3 cases=[{past:5,tokens:3},{past:5,tokens:4}]", "cases end at positions 7, 8"),
    ("model.prompt=missing.json", "prompt file"),
    ("model.checkpoint=missing.gguf", "checkpoint"),
    ("model=huge", "unknown model 'huge'"),
])
def test_bad_input_is_one_line_and_writes_nothing(results_dir, capsys, override, message):
    assert cli.main(["run", "chunk_prefill", *override.split()]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not results_dir.exists()
