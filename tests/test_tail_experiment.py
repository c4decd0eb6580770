"""The `tail` experiment through the CLI: bench records, sweep with breakeven, tables, bad input."""

import json

import pytest

from testbed import cli, config
from testbed.experiments import tail
from testbed.results import ResultsStore

TINY = ["shape.vocab=256", "shape.hidden=64", "shape.heads=4", "shape.head_dim=16", "shape.mlp=128"]


def records(results_dir):
    return ResultsStore(results_dir).records("tail")


def test_bench_records_one_per_length_and_mode(results_dir, capsys):
    assert cli.main(["run", "tail", *TINY, "prompt_tokens=[140,256]", "reps=2", "warmup=0"]) == 0
    rows = records(results_dir)
    assert sorted((r["params"]["prompt_tokens"], r["params"]["mode"]) for r in rows) == [
        (140, "padded"), (140, "scalar"), (256, "padded"), (256, "scalar")]
    by = {(r["params"]["prompt_tokens"], r["params"]["mode"]): r for r in rows}
    assert by[(140, "padded")]["metrics"]["telemetry.padding_tokens"] == 128 - 12
    assert by[(140, "scalar")]["metrics"]["telemetry.scalar_tail_tokens"] == 12
    assert by[(256, "padded")]["metrics"]["telemetry.tail_mode"] == "none"
    # The padded tail computes 128 rows where the scalar one computes 12; at N=256 both do the same.
    assert by[(140, "padded")]["work"]["flops"] > by[(140, "scalar")]["work"]["flops"]
    assert by[(256, "padded")]["work"]["flops"] == by[(256, "scalar")]["work"]["flops"]
    fig = by[(140, "scalar")]["figures"]["tokens_per_s"]
    assert fig["reps"] == 2 and fig["min"] <= fig["median"] <= fig["max"]
    out = capsys.readouterr().out
    assert "| 140 " in out and "winner" in out and "breakeven" not in out  # two tails: no sweep


def test_sweep_prints_rows_and_breakeven_then_table_reads_them(results_dir, capsys):
    assert cli.main(["sweep", "experiment=tail", *TINY, "tail=0,20,60", "reps=2", "warmup=0"]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("| tail ") for line in out.splitlines()) == 3  # one row per job
    assert "\nbreakeven: " in out
    assert cli.main(["table", "tail", "--format", "json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert [r["N"] for r in table] == [128, 148, 188, "breakeven"]
    if table[-1]["tail"] is not None:  # padding won for good: the policy can take its threshold
        rc = config.load(["experiment=tail", *TINY, "threshold=measured"])
        assert tail.policy_threshold(rc.cfg, "host") == table[-1]["tail"] - 1


def test_fixture_mode_prints_the_reviewers_table_and_breakeven_10(results_dir, capsys):
    assert cli.main(["run", "tail", "mode=fixture"]) == 0
    out = capsys.readouterr().out
    assert "scalar +2.5%" in out and "padded +123%" in out
    assert "| breakeven " in out and "padded from tail 10 (threshold 9)" in out


def test_oracle_mode_passes_on_the_host(results_dir, capsys):
    assert cli.main(["run", "tail", *TINY, "mode=oracle", "oracle.grid_windows=[16]", "oracle.grid_sinks=[0,3]"]) == 0
    rows = records(results_dir)
    oracles = {r["oracle"] for r in rows}
    assert oracles == {"cache_bytes", "first_token", "determinism", "telemetry", "exact_state", "naive"}
    assert all(r["verdict"] == "pass" for r in rows)
    lengths = sorted({r["params"]["prompt_tokens"] for r in rows if r["oracle"] == "telemetry"})
    chunk, threshold = rows[0]["config"]["chunk"], rows[0]["config"]["threshold"]
    assert {chunk + threshold, chunk + threshold + 1} <= set(lengths)  # either side of the padding decision
    naive = [r for r in rows if r["oracle"] == "naive"]
    assert [r["params"]["prompt_tokens"] for r in naive] == lengths[:1]  # the float64 model: the shortest only
    assert all(len(r["metrics"]["sha256"]) == 64 for r in rows if r["oracle"] == "cache_bytes")


def test_measured_threshold_needs_a_stored_sweep_of_the_same_source(results_dir, capsys):
    assert cli.main(["run", "tail", "mode=fixture"]) == 0  # another source: must not be used
    stored = len(records(results_dir))
    assert cli.main(["run", "tail", *TINY, "threshold=measured", "mode=oracle"]) == 2
    assert "no stored tail sweep" in capsys.readouterr().err
    assert len(records(results_dir)) == stored


@pytest.mark.parametrize("override,message", [
    ("tail=128", "tail=128 is out of range; accepted: integers from 0 to chunk - 1 = 127"),
    ("threshold=eight", "threshold='eight' is not an integer"),
    ("cache.dtype=bf16", "cache.dtype='bf16' is not accepted"),
    ("shape.heads=3", "shape: heads (3) must be a multiple of kv_heads (2)"),
    ("cache.sink=512", "cache.sink=512 is out of range"),
    ("prompt_tokens=[0]", "prompt_tokens=0 is out of range"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(results_dir, capsys, override, message):
    assert cli.main(["run", "tail", override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not (results_dir / "records.jsonl").exists()
