"""Every printed decision carries its interval (issue 33): the best chunk size, the breakeven tail and
the hybrid's crossover, from the repetitions, "undecided" where the noise cannot separate them, and by
instructions apart from time on a device that counts."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from testbed import PROJECT_ROOT, config
from testbed.experiments import chunk_prefill, gdn, hybrid, tail
from testbed.measure import breakeven, decisions

LENGTHS, REPLY, DECODE_S = [16, 36, 44, 52], 15, 0.26


def noisy(medians, reps: int, spread: float, seed: int) -> list[list[float]]:
    """Per median, `reps` repetitions scattered log-normally by `spread` (a loaded machine)."""
    rng = np.random.default_rng(seed)
    return [list(m * np.exp(rng.normal(0, spread, reps))) for m in medians]


# --- best C -------------------------------------------------------------------------------------------


def test_one_noisy_repetition_no_longer_names_the_wrong_chunk():
    # C=32 is the true best: 0.20 s a call, 1.75 calls per utterance at these lengths, against one
    # call of 0.40 s. Two of five C=32 repetitions ran 5x slower under load (the C=32 call at
    # load 33), another a little slow, so the medians favour 64
    samples = {32: [0.20, 1.00, 0.21, 0.24, 0.95], 64: [0.40, 0.39, 0.41, 0.40, 0.41]}
    medians = {c: float(np.median(v)) for c, v in samples.items()}
    assert chunk_prefill.latency_table(medians, DECODE_S, LENGTHS, None, REPLY)[1] == 64  # the old point rule
    found = chunk_prefill.best_chunk(samples, DECODE_S, LENGTHS, None, REPLY)
    assert not found["decided"] and 32 in found["candidates"]
    assert found["says"].startswith("undecided at this noise")


@pytest.mark.parametrize("truth", [32, 64])
def test_clean_repetitions_decide_the_true_best_chunk(truth):
    # the true best is whichever has the cheaper expected utterance (1.75 calls of C=32 per utterance
    # at these lengths, one of C=64); the decision follows it
    rng = np.random.default_rng(truth)
    per_call = {32: 0.10, 64: 0.30} if truth == 32 else {32: 0.20, 64: 0.25}
    samples = {c: list(t * np.exp(rng.normal(0, 0.02, 5))) for c, t in per_call.items()}
    found = chunk_prefill.best_chunk(samples, DECODE_S, LENGTHS, None, REPLY)
    assert found["decided"] and found["candidates"] == [truth]
    assert found["says"].startswith(f"{truth} (95% confidence by time")


def test_undecided_says_about_how_many_more_repetitions_would_separate_them():
    # b is 3% slower than a, each repetition scattered by 5%. Independently of the bootstrap: a median
    # of n repetitions scatters by 1.2533 sd / sqrt(n), so separating the pair at 95 % four times out
    # of five takes n = 2 (2.80 * 1.2533 * 0.05 / 0.03)^2 = 68 repetitions each
    theory = 2 * (2.80 * 1.2533 * 0.05 / 0.03) ** 2
    totals = []
    for seed in range(5):  # five pilot runs of 5 repetitions each
        rng = np.random.default_rng(seed)
        pilot = decisions.best_of({"a": list(np.exp(rng.normal(0, 0.05, 5))),
                                   "b": list(1.03 * np.exp(rng.normal(0, 0.05, 5)))})
        assert not pilot["decided"] and f"need about {pilot['more_reps']} more repetitions" in pilot["says"]
        totals.append(5 + pilot["more_reps"])
    assert theory / 3 < np.median(totals) < theory * 3  # 'about': a pilot's estimate of a scaling law
    # medians that are equal cannot be separated by any number of repetitions
    equal = decisions.best_of({"a": [1.0, 1.2, 0.8, 0.9, 1.1], "b": [0.9, 1.0, 1.1, 1.2, 0.8]})
    assert equal["more_reps"] is None
    assert "undecided at this noise (the closest are too near for even 10000 more repetitions to separate)" \
        in equal["says"]


def test_interleaved_repetitions_are_compared_paired():
    # load rose over the repetitions and fell on both variants alike: b is 5% slower in every one
    load = np.array([1.0, 1.6, 2.3, 1.2, 3.0, 1.9])
    samples = {"a": list(load), "b": list(1.05 * load)}
    assert decisions.best_of(samples, paired=True)["candidates"] == ["a"]
    assert not decisions.best_of(samples, paired=False)["decided"]  # separate jobs could not tell


def test_exact_instructions_decide_apart_from_time():
    found = decisions.best_of({32: [1000.0], 64: [900.0]}, by="instructions")
    assert found["decided"] and found["best"] == 64 and found["says"] == "64 (by instructions, exact)"
    # one timed repetition each is a point, never a decision
    timed = decisions.best_of({32: [1.0], 64: [0.9]})
    assert not timed["decided"] and "no confidence" in timed["says"]


def test_the_sweep_footer_decides_by_instructions_on_a_counting_device_and_not_by_emulated_time():
    cfg = config.load([], experiment="chunk_prefill").cfg
    jobs = [SimpleNamespace(cfg=cfg, device="qemu-aarch64")] * 2
    # emulated time would pick 64; the exact counts pick 32 (1.75 calls of 2e6 against one of 5e6)
    rows = pd.DataFrame([{"chunk": c, "chunk_call s": t, "decode_step s": 0.01, "emulated": True,
                          "samples": {"time": [t, t, t], "instructions": [n]}}
                         for c, t, n in ((32, 0.5, 2e6), (64, 0.1, 5e6))])
    text = chunk_prefill.sweep_footer(rows, jobs).split("\n\nseed 000")[0]
    assert "best C by instructions: 32 (by instructions, exact)" in text
    assert "\nbest C = " not in text and "\nbest C by time" not in text and "the device is emulated" in text


def test_the_gdn_sweep_names_the_best_chunk_per_length_by_time_and_by_instructions():
    def rows(emulated: bool) -> pd.DataFrame:
        # by time chunk 64 is clearly faster at T=512; by instructions 16 does less work
        times = {16: noisy([2.0], 5, 0.02, 1)[0], 64: noisy([1.0], 5, 0.02, 2)[0]}
        return pd.DataFrame([{"chunk": c, "emulated": emulated,
                              "samples": {"T=512 time": times[c], "T=512 instructions": [n] * 5}}
                             for c, n in ((16, 4e6), (64, 5e6))])

    host = [SimpleNamespace(cfg=SimpleNamespace(backend="native"), device="host")] * 2
    text = gdn.sweep_footer(rows(False), host)
    assert "T=512 on native / host, by time: 64 (95% confidence by time" in text
    assert "T=512 on native / host, by instructions: 16 (by instructions, exact)" in text
    emulated = [SimpleNamespace(cfg=SimpleNamespace(backend="native"), device="qemu-aarch64")] * 2
    text = gdn.sweep_footer(rows(True), emulated)
    assert "by time:" not in text and "by instructions: 16" in text and "the device is emulated" in text


# --- breakeven tail -----------------------------------------------------------------------------------


def fixture_sweep() -> pd.DataFrame:
    return breakeven.read_sweep_csv(PROJECT_ROOT / "fixtures" / "tail_sweep_m4pro_gemma4_e2b.csv")


def with_repetitions(df: pd.DataFrame, reps: int, spread: float, seed: int) -> pd.DataFrame:
    return df.assign(padded_tps_samples=noisy(df["padded_tps"], reps, spread, seed),
                     scalar_tps_samples=noisy(df["scalar_tps"], reps, spread, seed + 1))


def test_the_seeds_breakeven_interval_holds_tail_8_to_10():
    # medians only (the seed published no repetitions): the grid bounds it, and it says no confidence
    found = breakeven.breakeven_interval(fixture_sweep())
    assert (found["lo"], found["hi"], found["point"]) == (8, 10, 10)
    assert not found["decided"] and "no confidence" in found["says"]


def test_a_quiet_sweep_pins_the_breakeven_between_8_and_10():
    found = breakeven.breakeven_interval(with_repetitions(fixture_sweep(), 8, 0.01, 3))
    assert found["decided"] and (found["lo"], found["hi"]) == (8, 10)
    assert found["says"].startswith("between 8 and 10 (95% confidence by time")


def test_a_noisy_sweep_leaves_the_breakeven_undecided_and_its_interval_holds_the_truth():
    # a loaded machine: every repetition scattered by 30 %; a point rule still names one tail
    found = breakeven.breakeven_interval(with_repetitions(fixture_sweep(), 5, 0.3, 0))
    assert found["point"] is not None  # what the medians alone would have printed as the answer
    assert not found["decided"] and found["says"].startswith("undecided at this noise")
    assert (found["lo"] is None or found["lo"] <= 8) and (found["hi"] is None or found["hi"] >= 10)


def test_three_repetitions_are_too_few_for_an_interval():
    # the run: 3 repetitions. Resampled, three values only reproduce their own order
    found = breakeven.breakeven_interval(with_repetitions(fixture_sweep(), 3, 0.3, 1))
    assert not found["decided"] and found["more_reps"] == 2
    assert "3 repetitions: too few for an interval, need 2 more, no confidence" in found["says"]


def test_the_tables_breakevens_carry_the_interval():
    # stored records as the sweep writes them: every figure's repetitions in the store
    rows = []
    for t, p, s in zip((4, 8, 16, 24), noisy([90, 120, 125, 130], 6, 0.01, 7), noisy([100] * 4, 6, 0.01, 8)):
        for mode, reps in (("padded", p), ("scalar", s)):
            rows.append({"kind": "measure", "time": "2026-01-01T00:00:00", "run_id": "r1", "params.source": "s",
                         "params.prompt_tokens": 128 + t, "params.tail": t, "params.mode": mode,
                         "figures.tokens_per_s.median": float(np.median(reps)), "figures.tokens_per_s.samples": reps,
                         "figures.ttft.median": 1.0})
    (found,) = tail.breakevens(pd.DataFrame(rows))
    assert tail.breakevens(pd.DataFrame(rows).assign(emulated=True)) == []  # emulated times decide nothing
    assert (found["tail"], found["lo"], found["hi"], found["level"], found["reps"]) == (8, 4, 8, 0.95, 6)
    assert found["decided"] and found["method"] == "bootstrap over repetitions (paired, interleaved)"
    assert "breakeven tail between 4 and 8 (95% confidence" in found["says"]


# --- hybrid crossover ---------------------------------------------------------------------------------


def crossover_frame(hybrid_rate: dict, spread: float, reps: int = 6) -> pd.DataFrame:
    """Rates per context as crossover_summary reads them: dense slows with L, the hybrid as given."""
    dense = {L: 1e4 / (1 + L / 1000) for L in hybrid_rate}
    rows = []
    for i, L in enumerate(hybrid_rate):
        for model, rate in (("dense", dense[L]), ("hybrid-serial", hybrid_rate[L])):
            (samples,) = noisy([rate], reps, spread, 10 * i + (model == "dense"))
            rows.append({"context": L, "model": model, "rate": float(np.median(samples)), "rate_samples": samples})
    return pd.DataFrame(rows)


def test_the_crossover_is_an_interval_decided_when_quiet_and_undecided_when_noisy():
    # the dense model's rate: 8000 at L=256, 6667 at 512, 4950 at 1024, 3289 at 2048; the hybrid's 5500
    flat = {256: 5500.0, 512: 5500.0, 1024: 5500.0, 2048: 5500.0}
    quiet = hybrid.crossover_context(crossover_frame(flat, 0.01), "hybrid-serial")
    assert quiet["first measured L where faster"] == 1024
    assert (quiet["crossover lo"], quiet["crossover hi"]) == (512, 1024)
    assert quiet["crossover"].startswith("between 512 and 1024 (95% confidence by CPU time")
    noisy_run = hybrid.crossover_context(crossover_frame(flat, 0.4), "hybrid-serial")
    assert noisy_run["crossover"].startswith("undecided at this noise")
    never = hybrid.crossover_context(crossover_frame({L: 3000.0 for L in flat}, 0.01), "hybrid-serial")
    assert never["first measured L where faster"] is None and never["crossover"].startswith("beyond 2048")


def test_the_hybrid_tail_breakeven_carries_its_interval():
    sweep = with_repetitions(fixture_sweep(), 8, 0.01, 3)
    rows = [{"kind": "measure", "params.part": "tail", "time": "2026-01-01T00:00:00", "device": "host",
             "params.prompt_tokens": r.prompt_tokens, "params.tail": r.tail, "params.mode": mode,
             "figures.tokens_per_cpu_s.median": getattr(r, f"{mode}_tps"),
             "figures.tokens_per_cpu_s.samples": getattr(r, f"{mode}_tps_samples"),
             "figures.cpu_time.median": 1.0}
            for r in sweep.itertuples() for mode in ("padded", "scalar")]
    (found,) = hybrid.tail_breakevens(pd.DataFrame(rows).assign(backend="native"))
    assert found["says"] == ("padded from tail 10; breakeven tail between 8 and 10 "
                             "(95% confidence by CPU time, bootstrap over 8 repetitions)")
    assert (found["lo"], found["hi"], found["decided"], found["by"]) == (8, 10, True, "CPU time")
    assert "breakeven" not in set(hybrid.tail_table(pd.DataFrame(rows))["N"].astype(str))  # rows are rows


def test_a_sweep_over_contexts_prints_the_crossover_interval():
    frame = crossover_frame({256: 5500.0, 512: 5500.0, 1024: 5500.0, 2048: 5500.0}, 0.01)
    rows = pd.DataFrame([{f"L={L} {r.model}": r.rate for r in g.itertuples()} | {
        "rate": hybrid.RATE_CPU, "samples": {f"L={L} {r.model}": r.rate_samples for r in g.itertuples()}}
        for L, g in frame.groupby("context")])  # one job per context
    text = hybrid.sweep_footer(rows, jobs=None)
    assert "hybrid-serial: first measured L where faster 1024, crossover between 512 and 1024 (95% confidence by " \
           "CPU time, bootstrap over 6 repetitions)" in text


def test_the_hybrid_table_carries_each_crossover_with_its_interval():
    frame = crossover_frame({256: 5500.0, 512: 5500.0, 1024: 5500.0, 2048: 5500.0}, 0.01)
    records = pd.DataFrame([{"kind": "measure", "params.part": "crossover", "time": "2026-01-01T00:00:00",
                             "device": "host", "backend": "native", "params.context": r.context,
                             "params.model": r.model, "figures.tokens_per_cpu_s.median": r.rate,
                             "figures.tokens_per_cpu_s.min": min(r.rate_samples),
                             "figures.tokens_per_cpu_s.max": max(r.rate_samples),
                             "figures.tokens_per_cpu_s.samples": r.rate_samples} for r in frame.itertuples()])
    (found,) = hybrid.breakevens(records)
    assert found["source"] == "host/native: hybrid-serial overtakes dense"
    assert (found["point"], found["lo"], found["hi"], found["level"], found["reps"]) == (1024, 512, 1024, 0.95, 6)
    assert found["decided"] and found["says"].startswith("crossover context between 512 and 1024 (95% confidence")


# --- ties, chunked against token by token, and every place a choice is printed (issue 46) -----------------


def test_equal_exact_counts_are_a_tie_that_names_every_tied_size():
    found = decisions.best_of({32: [5e6], 64: [4_280_474.0], 128: [4_280_474.0]}, by="instructions")
    assert found["decided"] and found["tie"] and found["candidates"] == [64, 128]
    assert found["says"] == "a tie: 64 and 128 (by instructions, exact: 4,280,474 each)"
    assert decisions.label(found) == "64 = 128 (tie)"


def test_too_few_repetitions_leave_every_size_a_candidate_and_say_undecided():
    found = decisions.best_of({16: [1.0, 1.1, 0.9], 32: [2.0, 2.1, 1.9]})
    assert not found["decided"] and found["candidates"] == [16, 32]
    assert found["says"].startswith("undecided (3 repetitions: too few for an interval, need 2 more, no confidence)")
    assert decisions.label(found) == "undecided: 16, 32"


def test_chunked_against_token_by_token_carries_its_interval():
    """Token by token twice as fast as chunked, each repetition scattered by 5%: decided, with the factor's
    interval around 2; at a 40% scatter the same medians are undecided, the interval holding both sides
    of 1 (the issue's run flipped between 'chunking 23% faster' and 'token by token 43-53% faster')."""
    chunked, token = noisy([0.50, 0.25], 8, 0.05, 3)
    quiet = decisions.ratio(chunked, token, "chunked (C=64)", "token by token", paired=True)
    assert quiet["decided"] and quiet["faster"] == "token by token" and quiet["lo"] < 0.5 < quiet["hi"]
    assert quiet["says"].startswith("token by token is 2.0") and "x faster than chunked (C=64) (" in quiet["says"]
    assert "95% confidence by time, bootstrap over 8 repetitions, paired" in quiet["says"]
    chunked, token = noisy([0.50, 0.40], 5, 0.4, 4)
    loud = decisions.ratio(chunked, token, "chunked (C=64)", "token by token")
    assert not loud["decided"] and loud["faster"] is None and loud["lo"] < 1 < loud["hi"]
    assert loud["says"].startswith("undecided at this noise")
    exact = decisions.ratio([3e6], [3e6], "chunked (C=64)", "token by token", by="instructions")
    assert exact["decided"] and exact["says"] == "a tie: chunked (C=64) and token by token (by instructions, exact: " \
                                                 "3,000,000 each)"


def test_the_report_never_marks_a_best_size_that_token_by_token_beats():
    """The report marked C=64 '<- best' while token by token beside it was twice as fast: the marks are the
    decisions' now, token by token's row included."""
    from testbed.report import build

    lengths = [16, 36, 44, 52]
    calls = dict(zip((32, 64), noisy([0.10, 0.30], 8, 0.02, 5)))  # 1.75 calls of C=32 per utterance: 0.175 s
    decode = {c: list(np.full(8, 0.002)) for c in calls}  # 37 tokens on average: 0.074 s token by token
    measured = chunk_prefill.ChunkMeasures(calls, decode)
    choices = chunk_prefill.choices(measured, lengths, None, 0)
    table = build.chunk_choice_table(measured, lengths, None, 0, choices)
    marks = dict(zip(table["C"], table["choice"]))
    assert marks[32] == "<- best (95% confidence); token by token is faster" and marks[64] == ""
    assert marks["token by token"] == "<- faster than C=32"


def test_an_undecided_best_chunk_reads_undecided_in_the_terminal_the_table_and_the_report(results_dir, capsys,
                                                                                         tmp_path):
    """Issue 46: the report marked '<- best' where the same sweep's terminal said undecided. Three
    repetitions give no interval: the sweep, `testbed table --format json` and the report all say so."""
    import json

    from testbed.cli import main

    assert main(["sweep", "experiment=chunk_prefill", "chunk=16,32", "mode=bench", "bench.reps=3",
                 "bench.past=40"]) == 0
    out = capsys.readouterr().out
    assert "\nbest C by time: undecided (3 repetitions: too few for an interval, need 2 more, no confidence): " in out
    assert main(["table", "chunk_prefill", "--format", "json"]) == 0
    (best,) = [c for c in json.loads(capsys.readouterr().out)["choices"] if c["decision"] == "best C"]
    assert best["decided"] is False and best["label"].startswith("undecided: ")
    assert sorted(best["candidates"]) == [16, 32]
    assert best["says"].startswith("undecided (3 repetitions")
    main(["report", "--out", str(tmp_path / "report")])
    content = json.loads((tmp_path / "report" / "report.json").read_text())
    chunk = next(s for s in content["sections"] if s["id"] == "chunk")
    (table,) = [t for t in chunk["tables"] if t["caption"].startswith("host / refimpl")]
    marks = [row["choice"] for row in table["rows"] if row["C"] in (16, 32)]
    assert all(m.startswith("undecided") for m in marks) and not any("<- best" in m for m in marks), marks
    assert [c["label"] for c in content["choices"] if c["decision"] == "best C"] == [best["label"]]
    assert "best C by time: undecided (3 repetitions" in (tmp_path / "report" / "report.md").read_text()


def test_a_tie_of_exact_counts_prints_both_sizes_in_the_sweep_and_the_table(results_dir, capsys):
    """Issue 46: `sweep experiment=gdn ... device=qemu-aarch64 chunk=64,128` printed '64 (by instructions,
    exact)' when both counted the same. At T=48 both chunks run one chunk of 48 rows: the same count."""
    import json

    from testbed.cli import main

    assert main(["sweep", "experiment=gdn", "backend=native", "device=qemu-aarch64", "chunk=64,128", "mode=bench",
                 "bench.tokens=[48]", "bench.heads=2", "bench.head_size=32"]) == 0
    out = capsys.readouterr().out
    said = " ".join(out.split())  # the line wraps at 120 columns
    assert "best chunk, chunkwise, T=48 on native / qemu-aarch64, by instructions: a tie: 64 and 128 (by " \
           "instructions, exact: " in said and "no best chunk by time on native / qemu-aarch64" in said
    assert main(["table", "gdn", "--format", "json"]) == 0
    (tie,) = json.loads(capsys.readouterr().out)["choices"]
    assert tie["label"] == "64 = 128 (tie)" and tie["tie"] and tie["candidates"] == [64, 128]


def test_tail_on_a_counting_device_decides_the_breakeven_by_instructions(results_dir, capsys):
    """Issue 46: `testbed run tail device=qemu-aarch64` printed no breakeven although its records hold
    exact counts, and a 'winner' column drawn from emulated times. Now: the counts' table and breakeven."""
    import json
    import re

    from testbed.cli import main

    assert main(["run", "tail", "device=qemu-aarch64"]) == 0
    out = capsys.readouterr().out
    said = " ".join(out.split())
    assert re.search(r"breakeven \(qemu-aarch64/native [^)]*\): (padded from tail \d+ \(threshold \d+\)|none: padding "
                     r"does not win at tail \d+), by instructions; breakeven tail ", said), out
    assert "fewer instructions" in out and "winner" not in out and "tok/s" not in out  # no time decides here
    assert all(len(line) <= 120 for line in out.splitlines()), [line for line in out.splitlines() if len(line) > 120]
    assert main(["table", "tail", "--format", "json"]) == 0
    (found,) = json.loads(capsys.readouterr().out)["breakevens"]
    assert found["by"] == "instructions" and found["decided"] and found["method"].startswith("exact counts")
