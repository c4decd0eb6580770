"""The `tail` experiment through the CLI: bench records, sweep with breakeven, tables, bad input."""

import json

import pandas as pd
import pytest

from testbed import cli, config
from testbed.errors import UsageError
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


def test_a_sweep_over_tails_is_one_interleaved_job_then_table_reads_it(results_dir, capsys):
    assert cli.main(["sweep", "experiment=tail", *TINY, "tail=0,20,60", "reps=3", "warmup=0"]) == 0
    out = capsys.readouterr().out
    assert "1 runs" in out and "| [0,20,60] " in out  # the three tails in one job, its breakeven in the row
    assert "breakeven tail" in out
    rows = records(results_dir)
    assert len({r["run_id"] for r in rows}) == 1 and len(rows) == 6
    # each repetition ran every (N, mode) once: the positions of the six variants fill 0..5 per rep
    positions = [r["metrics"]["interleave.positions"] for r in rows]
    for rep in zip(*positions):
        assert sorted(rep) == list(range(6))
    assert len({tuple(p) for p in positions}) > 1 and all(r["params"]["order_seed"] == 0 for r in rows)
    for r in rows:  # CPU time beside wall time, each with its spread
        for name in ("ttft", "ttft_cpu"):
            fig = r["figures"][name]
            assert fig["reps"] == 3 and fig["min"] <= fig["median"] <= fig["max"]
    assert cli.main(["table", "tail", "--format", "json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert [r["N"] for r in table["rows"]] == [128, 148, 188]  # rows are rows; the breakevens are apart
    by_wall, by_cpu = table["breakevens"]
    assert (by_wall["clock"], by_cpu["clock"]) == ("wall", "cpu")
    assert by_wall["largest_tail"] == 60 and by_wall["tails"] == 3
    rc = config.load(["experiment=tail", *TINY, "threshold=measured"])
    if by_wall["tail"] is not None and by_wall["decided"]:  # padding won for good: the policy takes its threshold
        assert tail.policy_threshold(rc.cfg, "host") == by_wall["tail"] - 1 == by_wall["threshold"]
    elif by_wall["tail"] is not None:  # 3 repetitions: no interval, so no threshold from the median
        with pytest.raises(UsageError, match="undecided"):
            tail.policy_threshold(rc.cfg, "host")


def sweep_records(wall_tps: dict, cpu_tps: dict) -> pd.DataFrame:
    """Stored tail measurements of one run, padded tokens/s per tail by wall and by CPU time; scalar
    at 100 tokens/s on both clocks."""
    rows = []
    for t in wall_tps:
        for mode in ("padded", "scalar"):
            wall, cpu = (wall_tps[t], cpu_tps[t]) if mode == "padded" else (100.0, 100.0)
            rows.append({"kind": "measure", "time": "2026-01-01T00:00:00", "run_id": "r1", "params.source": "s",
                         "params.prompt_tokens": 128 + t, "params.tail": t, "params.mode": mode,
                         "figures.tokens_per_s.median": wall, "figures.ttft.median": 1e3 * (128 + t) / wall,
                         "figures.tokens_per_cpu_s.median": cpu, "figures.ttft_cpu.median": 1e3 * (128 + t) / cpu})
    return pd.DataFrame(rows)


def test_the_breakeven_by_cpu_time_reads_the_cpu_figures():
    # by wall time a waiting spell made padding lose at tail 16; by CPU time it wins from tail 8
    df = sweep_records({4: 90.0, 8: 120.0, 16: 95.0, 24: 130.0}, {4: 90.0, 8: 120.0, 16: 125.0, 24: 130.0})
    found = {b["clock"]: b["tail"] for b in tail.breakevens(df)}
    assert found == {"wall": 24, "cpu": 8}
    assert tail.sweep_row(df)["breakeven tail"] == 24 and tail.sweep_row(df)["breakeven tail (CPU time)"] == 8


def test_the_table_shows_each_sources_latest_run_whole(results_dir, capsys):
    assert cli.main(["run", "tail", *TINY, "tail=[0,20,60]", "reps=1", "warmup=0"]) == 0
    assert cli.main(["run", "tail", *TINY, "tail=[4,8]", "reps=1", "warmup=0"]) == 0
    capsys.readouterr()
    assert cli.main(["table", "tail", "--format", "json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert [r["N"] for r in table["rows"]] == [132, 136]  # not stitched with the first run's tails


def test_fixture_mode_prints_the_reviewers_table_and_breakeven_10(results_dir, capsys):
    assert cli.main(["run", "tail", "mode=fixture"]) == 0
    out = capsys.readouterr().out
    assert "scalar +2.5%" in out and "padded +123%" in out
    assert "breakeven (fixture:" in out and "padded from tail 10 (threshold 9)" in out


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


def stored_sweep(monkeypatch, label: str, padded: dict, scalar: list) -> None:
    """The store threshold=measured reads holds one sweep of `label`: padded tokens/s per tail, each a
    list of repetitions, and scalar at `scalar` repetitions at every tail."""
    import types

    import testbed.runner

    rows = []
    for t, reps in padded.items():
        for mode, xs in (("padded", reps), ("scalar", scalar)):
            median = float(pd.Series(xs).median())
            rows.append({"kind": "measure", "time": "2026-01-01T00:00:00", "run_id": "r1", "params.source": label,
                         "params.prompt_tokens": 128 + t, "params.tail": t, "params.mode": mode,
                         "figures.tokens_per_s.median": median, "figures.tokens_per_s.samples": list(xs),
                         "figures.ttft.median": 1e3 * (128 + t) / median})
    frame = pd.DataFrame(rows)
    monkeypatch.setattr(testbed.runner, "results_store", lambda rc: types.SimpleNamespace(frame=lambda name: frame))


def test_a_measured_threshold_is_refused_from_an_undecided_breakeven(monkeypatch):
    """By the medians padding wins from tail 8, but three repetitions whose spread covers scalar's at
    every tail do not decide it: no threshold is taken from the median (it was, as 7)."""
    rc = config.load(["experiment=tail", *TINY, "threshold=measured"])
    label = tail.source_label(rc.cfg, "host")
    noisy = [100.0, 60.0, 160.0]
    stored_sweep(monkeypatch, label, {4: [95.0, 60.0, 150.0], 8: [105.0, 55.0, 170.0], 16: [110.0, 50.0, 180.0],
                                      24: [110.0, 50.0, 180.0]}, noisy)
    with pytest.raises(UsageError, match=r"undecided .*no threshold is taken from its median tail 8"):
        tail.policy_threshold(rc.cfg, "host")


def test_a_measured_threshold_is_taken_from_a_decided_breakeven(monkeypatch):
    rc = config.load(["experiment=tail", *TINY, "threshold=measured"])
    label = tail.source_label(rc.cfg, "host")
    scalar = [100.0, 101.0, 99.0, 100.5, 99.5]
    stored_sweep(monkeypatch, label, {4: [80.0, 81.0, 79.0, 80.5, 79.5], 8: [150.0, 151.0, 149.0, 150.5, 149.5],
                                      16: [160.0, 161.0, 159.0, 160.5, 159.5]}, scalar)
    assert tail.policy_threshold(rc.cfg, "host") == 7


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
