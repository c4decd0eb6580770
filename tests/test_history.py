"""Regression detection over a figure's history (testbed.measure.history): no false alarms from a noisy machine,
a real step flagged once per measured quantity.

The noise is simulated, seeded, never timed: a run times REPS repetitions, each drawn from a lognormal
distribution (sigma 0.15) with an occasional repetition taking twice as long (another process took the
core), and its figures are what the experiments compute from them (testbed.results.Figure): the time
in ms, and tokens/s and GFLOP/s from the same repetitions.
"""

from __future__ import annotations

import numpy as np
import pytest

from testbed.measure import history
from testbed.results import Figure, Record, RunInfo

REPS = 20
SIGMA = 0.15
OUTLIER_RATE, OUTLIER_FACTOR = 0.05, 2.0
TOKENS, FLOPS = 512, 3.1e9
SLOWDOWN = 1.15


def repetitions(rng: np.random.Generator, slower: float = 1.0) -> np.ndarray:
    """One run's timed repetitions (seconds)."""
    t = 0.02 * slower * rng.lognormal(0.0, SIGMA, REPS)
    t[rng.random(REPS) < OUTLIER_RATE] *= OUTLIER_FACTOR
    return t


def nightly_medians(rng: np.random.Generator, runs: int, slow_runs: int = 0) -> list[float]:
    return [float(np.median(repetitions(rng, SLOWDOWN if i >= runs - slow_runs else 1.0))) for i in range(runs)]


def stored_run(night: int, seconds: np.ndarray, cpu_seconds: np.ndarray) -> dict:
    """One run's bench record in its stored form (RunInfo.stamp), as gdn writes it."""
    info = RunInfo("gdn", "host", "native", {"chunk": 64}, {}, run_id=f"run{night:02d}", git_commit=f"c{night:02d}",
                   started=f"2026-01-{night + 1:02d}T02:00:00+00:00")
    t = Figure.of(seconds, "s")
    return info.stamp(Record("gdn", "H=4,hs=64,T=512/chunkwise", "measure", figures={
        "time": t.scaled(1e3, "ms"), "tokens_per_s": t.rate(TOKENS, "tokens/s"),
        "gflops": t.rate(FLOPS / 1e9, "GFLOP/s"),
        "cpu_time": Figure.of(cpu_seconds, "s").scaled(1e3, "ms")}))


def stored_history(seed: int, runs: int, slow_runs: int = 0) -> list[dict]:
    """`runs` nights of one commit; the wall time (not the CPU time) of the last `slow_runs` is slower."""
    rng = np.random.default_rng(seed)
    return [stored_run(i, repetitions(rng, SLOWDOWN if i >= runs - slow_runs else 1.0), repetitions(rng))
            for i in range(runs)]


def flags_each_night(records: list[dict]) -> list[history.Flag]:
    """What a nightly judges after each night, as it goes."""
    return [f for n in range(1, len(records) + 1) for f in history.figure_regressions(records[:n], 30, 5)]


# --- the records: one flag per measured quantity ---------------------------------------------------------


def test_twenty_reruns_of_one_commit_raise_no_flag():
    assert flags_each_night(stored_history(seed=1, runs=20)) == []


def test_a_planted_slowdown_is_flagged_once_naming_its_derived_figures():
    records = stored_history(seed=2, runs=20, slow_runs=4)
    (flag,) = history.figure_regressions(records, 30, 5)
    assert (flag.what, flag.derived) == ("time", ["tokens_per_s", "gflops"])  # cpu_time did not move
    assert flag.since == records[16]["started"] and flag.since_commit == "c16"
    # the change of levels: the median of the slow runs' medians over the median of the ones before
    medians = [r["figures"]["time"]["median"] for r in records]
    assert flag.change == f"{np.median(medians[16:]) / np.median(medians[:16]) - 1:+.1%}"
    assert "tokens_per_s, gflops" in flag.line()


def test_independent_timings_are_separate_quantities_and_rates_join_their_timing():
    groups = dict(history.quantities(stored_history(seed=3, runs=6)))
    assert groups == {"time": ["tokens_per_s", "gflops"], "cpu_time": []}


def test_a_figure_equal_in_every_run_is_not_taken_for_a_derived_one():
    records = stored_history(seed=4, runs=6)
    for r in records:  # a constant, e.g. a fixture's figure: proportional to anything, so proof of nothing
        r["figures"]["fixture_rate"] = {"median": 9.0, "min": 9.0, "max": 9.0, "reps": 1, "unit": "tokens/s"}
    assert ("fixture_rate", []) in history.quantities(records)


def test_emulated_runs_are_not_judged():
    records = stored_history(seed=2, runs=20, slow_runs=4)
    for r in records:
        r["emulated"] = True
    assert history.figure_regressions(records, 30, 5) == []


# --- the detector: a plain function of per-run medians ------------------------------------------------------


def test_a_noisy_night_just_past_the_envelope_is_within_noise():
    rng = np.random.default_rng(5)
    earlier = nightly_medians(rng, 12)
    noise = history.judge_step(earlier + [max(earlier)] * 2, True).noise
    for nights in (1, 2):  # one night, and a second that confirms it: both just past the envelope
        verdict = history.judge_step(earlier + [max(earlier) * 1.01] * nights, True)
        assert not verdict.regressed, verdict.reason
    # the same nights further out, beyond noise and beyond the least change that counts, are flagged
    far = max(earlier) * (1 + 6 * noise)
    assert history.judge_step(earlier + [far] * 2, True).regressed


def test_a_single_slow_night_waits_for_confirmation():
    earlier = nightly_medians(np.random.default_rng(6), 10)
    one = history.judge_step(earlier + [2 * max(earlier)], True)
    assert not one.regressed and one.reason.startswith("not yet")
    assert history.judge_step(earlier + [2 * max(earlier)] * 2, True).regressed


def test_fewer_than_five_earlier_runs_are_not_judged_and_say_so():
    earlier = nightly_medians(np.random.default_rng(7), 6)
    slow = [2 * max(earlier)] * 2
    short = history.judge_step(earlier[:3] + slow, True)
    assert not short.regressed and short.reason == "not judged: 4 earlier runs, 5 needed"
    begun_early = history.judge_step(earlier[:4] + slow, True)  # 5 earlier runs, but the step after 4
    assert not begun_early.regressed and begun_early.reason.startswith("not judged: the latest level began after 4")
    assert history.judge_step(earlier[:5] + slow, True).regressed


def test_rates_regress_downwards_and_improvements_are_not_flagged():
    rng = np.random.default_rng(8)
    earlier = nightly_medians(rng, 12)
    slower = [2 * max(earlier)] * 3
    assert history.judge_step(earlier + slower, lower_is_better=True).regressed
    rates = [1 / m for m in earlier + slower]
    assert history.judge_step(rates, lower_is_better=False).regressed
    improved = history.judge_step(earlier + [0.5 * min(earlier)] * 3, lower_is_better=True)
    assert not improved.regressed and improved.reason.startswith("improved")


def test_a_fixed_slowdown_is_history_not_a_regression():
    rng = np.random.default_rng(9)
    medians = nightly_medians(rng, 8) + [2 * m for m in nightly_medians(rng, 4)] + nightly_medians(rng, 6)
    verdict = history.judge_step(medians, True)
    assert not verdict.regressed, verdict.reason


def test_the_fit_finds_the_step_where_it_was_planted():
    assert history.fit_levels([1.0] * 7 + [2.0] * 3, penalty=0.5) == [0, 7]
    assert history.fit_levels([1.0, 1.1, 0.9, 1.0, 1.05], penalty=0.5) == [0]


def test_false_alarms_and_detections_over_many_seeded_histories():
    """Each history: 20 reruns of one commit, judged after every night as a nightly does. And the same
    noise with the last 4 runs 15% slower, judged once. The counts are the detector's operating point:
    they are printed (pytest -s) and bounded."""
    histories = 200
    alarms = detections = 0
    for seed in range(histories):
        medians = nightly_medians(np.random.default_rng(seed), 20)
        alarms += any(history.judge_step(medians[:n], True).regressed for n in range(6, 21))
        slowed = nightly_medians(np.random.default_rng(10_000 + seed), 20, slow_runs=4)
        detections += history.judge_step(slowed, True).regressed
    print(f"false alarms: {alarms}/{histories} histories of 20 reruns; 15% slowdowns over the last 4 runs found: "
          f"{detections}/{histories}")
    assert alarms <= 0.05 * histories and detections >= 0.75 * histories


# --- the rules by what a figure is: every judge planted so that it must fail -------------------------------


def count_run(night: int, count: float, commit: str | None = None, emulated: bool = False,
              device: str = "qemu-aarch64", seconds: float | None = None) -> dict:
    """One run's record of an exact instruction count (and, where given, its time) for one kernel and shape."""
    info = RunInfo("native_bench", device, "native", {"threads": 1}, {}, emulated=emulated,
                   run_id=f"count{night:02d}", git_commit=commit or f"k{night:02d}" * 5,
                   started=f"2026-03-{night + 1:02d}T02:00:00+00:00")
    figures = {"instructions": Figure(count, count, count, 1, history.INSTRUCTIONS)}
    if seconds is not None:
        figures["time"] = Figure.of([seconds * f for f in (0.98, 1.0, 1.03)], "s").scaled(1e3, "ms")
    return info.stamp(Record("native_bench", "attention/keys=512", "measure", figures=figures))


def count_flags_each_night(records: list[dict], rise: float = history.INSTRUCTION_RISE) -> list[list[history.Flag]]:
    return [[f for f in history.figure_regressions(records[:n], 30, 5, instruction_rise=rise)
             if f.run_id == records[n - 1]["run_id"]] for n in range(1, len(records) + 1)]


def test_an_instruction_rise_of_1_5_percent_is_flagged_on_its_first_night_once_with_both_counts():
    counts = [1_000_000] * 3 + [1_015_000] * 4  # +1.5% from night 3 on; exact, emulated
    records = [count_run(i, c, emulated=True) for i, c in enumerate(counts)]
    nightly = count_flags_each_night(records)
    assert [len(f) for f in nightly] == [0, 0, 0, 1, 0, 0, 0]  # the first night at the new count, once
    (flag,) = nightly[3]
    assert (flag.kind, flag.what, flag.before_level, flag.after_level) == ("instructions", "instructions",
                                                                          1_000_000, 1_015_000)
    assert flag.now == "1,015,000 instructions" and flag.before == "1,000,000 instructions"
    assert flag.change == "+1.50%" and flag.unit == "instructions"
    # the commit range: the last commit with the old count .. the first with the new
    assert (flag.last_clean_commit, flag.since_commit) == (records[2]["git_commit"], records[3]["git_commit"])
    assert flag.commit_range() == f"{records[2]['git_commit'][:8]}..{records[3]['git_commit'][:8]}"
    assert "1,015,000 instructions vs 1,000,000 instructions" in flag.line()
    data = history.flag_data(flag)
    assert data["commit_range"] == flag.commit_range() and data["before_level"] == 1_000_000


def test_an_instruction_rise_of_half_a_percent_is_reported_not_flagged_and_a_fall_is_an_improvement():
    counts = [2_000_000, 2_000_000, 2_010_000, 2_010_000, 1_900_000]  # +0.5%, then -5.5%
    records = [count_run(i, c) for i, c in enumerate(counts)]
    assert count_flags_each_night(records) == [[]] * 5
    changes = history.count_changes(records)
    assert [(c.before, c.after, c.verdict) for c in changes] == [
        (2_000_000, 2_010_000, "changed (within the rise that counts)"), (2_010_000, 1_900_000, "improvement")]
    assert (changes[0].old["git_commit"], changes[0].new["git_commit"]) == (records[1]["git_commit"],
                                                                         records[2]["git_commit"])
    # the fraction is a setting: at 0.25% the same +0.5% is a regression
    assert [len(f) for f in count_flags_each_night(records, rise=0.0025)] == [0, 0, 1, 0, 0]


def test_a_reverted_instruction_rise_clears_the_first_night_it_is_measured_back():
    counts = [500_000] * 4 + [520_000, 500_000, 500_000]  # +4% on night 4, reverted on night 5
    records = [count_run(i, c) for i, c in enumerate(counts)]
    assert [len(f) for f in count_flags_each_night(records)] == [0, 0, 0, 0, 1, 0, 0]
    assert [c.verdict for c in history.count_changes(records)] == ["regression", "improvement"]


def test_counts_are_never_judged_by_the_step_detector_nor_grouped_with_times():
    # a count that rises by 0.5% a night: a step detector would flag its slow drift, the count judge does not
    records = [count_run(i, 1_000_000 * 1.005 ** i, device="host", seconds=0.010) for i in range(12)]
    assert all(j.what != "instructions" for j in history.judge_figures(records, 30, 5))
    assert dict(history.quantities(records)) == {"instructions": [], "time": []}
    assert count_flags_each_night(records) == [[]] * 12


def test_emulated_counts_are_judged_and_emulated_times_are_not():
    counts = [1_000_000] * 6 + [1_100_000] * 2
    times = [0.010] * 6 + [0.020] * 2  # twice as slow under emulation: not a speed
    records = [count_run(i, c, emulated=True, seconds=t) for i, (c, t) in enumerate(zip(counts, times))]
    flags = history.figure_regressions(records[:7], 30, 5)
    assert [f.kind for f in flags] == ["instructions"]
    assert history.figure_regressions(records, 30, 5) == []  # the next night: named once; times never judged
    from testbed.measure import emulation
    kept, apart = emulation.split(records)
    assert all(set(r["figures"]) == {"instructions"} for r in kept)
    assert all(set(r["figures"]) == {"time"} for r in apart)
    # the same for a table's flattened frame (testbed table): the counts stay, the times are emptied
    import pandas as pd
    kept, apart = emulation.split_frame(pd.json_normalize(records, sep="."))
    assert len(kept) == len(records) == len(apart)
    assert kept["figures.instructions.median"].notna().all() and kept["figures.time.median"].isna().all()


# the machine probe --------------------------------------------------------------------------------------


def probe_night(night: int, kernel_slower: float, machine_slower: float, rng: np.random.Generator,
                commit: str | None = None) -> list[dict]:
    """One gdn run as it is stored now: the kernel's bench record, and the run's machine probe (numpy's
    sgemm) once, in a record of its own marked role machine_probe."""
    info = RunInfo("gdn", "host", "native", {"chunk": 64}, {}, run_id=f"probe{night:02d}",
                   git_commit=commit or f"p{night:02d}" * 5, started=f"2026-04-{night + 1:02d}T02:00:00+00:00")
    t = Figure.of(repetitions(rng, kernel_slower * machine_slower) * 0.3, "s")  # a quiet kernel: 5% noise
    sgemm = Figure.of(0.004 * machine_slower * rng.lognormal(0.0, 0.05, REPS), "s").rate(2 * 512**3 / 1e9, "GFLOP/s")
    return [info.stamp(Record("gdn", "H=4,hs=64,T=512/chunkwise", "measure", figures={
                "time": t.scaled(1e3, "ms"), "tokens_per_s": t.rate(TOKENS, "tokens/s")})),
            info.stamp(Record("gdn", "machine_probe/sgemm,threads=1", "measure", figures={"sgemm": sgemm.as_probe()},
                              params={"role": "machine_probe"}))]


def test_a_slower_machine_never_flags_its_probe_nor_a_kernel_it_explains():
    rng = np.random.default_rng(40)
    nights = [probe_night(i, 1.0, 1.3 if i >= 8 else 1.0, rng) for i in range(10)]  # the machine 30% slower
    records = [r for night in nights for r in night]
    assert all(r["figures"].get("sgemm", {}).get("role") == "machine_probe" for r in records if "sgemm" in r["figures"])
    assert history.figure_regressions(records, 30, 5) == []  # not the probe, not the kernel
    (judged,) = [j for j in history.judge_figures(records, 30, 5) if j.what == "time"]
    assert judged.verdict.reason.startswith("the machine's: machine slowed by ") and judged.machine > 0.2


def test_a_kernel_slower_than_its_machine_is_flagged_with_the_machine_beside_it():
    rng = np.random.default_rng(41)
    nights = [probe_night(i, 1.3 if i >= 8 else 1.0, 1.1 if i >= 8 else 1.0, rng) for i in range(10)]
    (flag,) = history.figure_regressions([r for night in nights for r in night], 30, 5)
    assert flag.what == "time" and flag.machine.startswith("machine slowed by ")
    assert "slower beside the machine" in flag.line()


def test_the_legacy_sgemm_figure_stored_in_two_records_is_never_flagged():
    """Records written before the probe had its own record: the sgemm rate in both forms' records."""
    rng = np.random.default_rng(42)
    records = []
    for night in range(10):
        info = RunInfo("gdn", "host", "native", {"chunk": 64}, {}, run_id=f"old{night:02d}",
                       git_commit=f"o{night:02d}" * 5, started=f"2026-05-{night + 1:02d}T02:00:00+00:00")
        sgemm = Figure.of(0.004 * (2.0 if night >= 8 else 1.0) * rng.lognormal(0, 0.03, REPS), "s").rate(0.27, "GFLOP/s")
        for form in ("serial", "chunkwise"):
            t = Figure.of(repetitions(rng) * 0.3, "s")
            records.append(info.stamp(Record("gdn", f"H=4,hs=64,T=512/{form}", "measure", figures={
                "time": t.scaled(1e3, "ms"), "sgemm": sgemm})))
    assert history.is_probe(records[0], "sgemm") and not history.is_probe(records[0], "time")
    assert history.figure_regressions(records, 30, 5) == []


# A/B ratios --------------------------------------------------------------------------------------------


def ab_run(night: int, ratios: dict[str, tuple[float, float]]) -> dict:
    """One A/B job's record: per figure (median ratio B/A, the paired test's p), as the A/B command writes."""
    info = RunInfo("native_bench", "host", "native", {"ab": True}, {}, run_id=f"ab{night:02d}",
                   git_commit="b" * 40, started=f"2026-06-{night + 1:02d}T02:00:00+00:00")
    figures = {}
    for name, (ratio, p) in ratios.items():
        figures[name] = Figure(ratio, ratio * 0.97, ratio * 1.04, 20, "ratio",
                               ab={"a_commit": "a" * 40, "b_commit": "b" * 40, "p": p, "pairs": 20,
                                   "test": "wilcoxon", "verdict": "slower" if p < 0.05 and ratio > 1 else "no change"})
    return info.stamp(Record("native_bench", "ab/attention keys=512", "measure", figures=figures))


def test_an_ab_night_with_b_slower_beyond_noise_is_flagged_that_night():
    records = [ab_run(0, {"ab_ratio_cpu": (1.02, 0.4), "ab_ratio_wall": (1.01, 0.6)}),
               ab_run(1, {"ab_ratio_cpu": (1.08, 0.001), "ab_ratio_wall": (1.09, 0.002)})]
    assert history.figure_regressions(records[:1], 30, 5) == []
    flags = history.figure_regressions(records, 30, 5)
    assert sorted(f.what for f in flags) == ["ab_ratio_cpu", "ab_ratio_wall"]
    flag = next(f for f in flags if f.what == "ab_ratio_cpu")
    assert flag.kind == "ab" and flag.run_id == "ab01" and flag.change == "+8.0%"
    assert (flag.last_clean_commit, flag.since_commit) == ("a" * 40, "b" * 40)
    # Holm over the night's two A/B figures: the smaller p times 2
    assert flag.ab["p"] == 0.001 and flag.ab["p_corrected"] == pytest.approx(0.002)
    assert flag.ab["pairs"] == 20 and flag.ab["test"] == "wilcoxon" and "A/B: 20 pairs" in flag.line()


def test_ab_pairs_within_noise_after_correction_or_below_5_percent_or_faster_are_not_flagged():
    assert history.figure_regressions([ab_run(0, {"ab_ratio_cpu": (1.08, 0.04), "ab_ratio_wall": (1.08, 0.045)})],
                                      30, 5) == []  # Holm: 0.08 and 0.08
    assert history.figure_regressions([ab_run(1, {"ab_ratio_cpu": (1.03, 1e-6)})], 30, 5) == []  # below 5%
    assert history.figure_regressions([ab_run(2, {"ab_ratio_cpu": (0.85, 1e-6)})], 30, 5) == []  # B faster
    assert history.judge_figures([ab_run(3, {"ab_ratio_cpu": (1.5, 1e-6)})], 30, 5) == []  # not the step detector


def test_holm_by_hand():
    assert history.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert history.holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert history.holm([]) == []


# the step detector: reverts and the commit it names ------------------------------------------------------


def test_a_reverted_step_is_not_flagged_the_night_it_is_measured_back():
    rng = np.random.default_rng(43)
    for seed in range(20):
        rng = np.random.default_rng(1000 + seed)
        medians = nightly_medians(rng, 10) + [1.25 * m for m in nightly_medians(rng, 2)]
        flagged = history.judge_step(medians, True)
        back = history.judge_step(medians + nightly_medians(rng, 1), True)
        if flagged.regressed:  # the step is flagged; the night after the revert it is not
            assert not back.regressed, (seed, back.reason)
    # one history by hand: two nights 25% slower, then one at the old level
    medians = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0, 1.01, 0.99, 1.25, 1.26]
    assert history.judge_step(medians, True).regressed
    reverted = history.judge_step(medians + [1.0], True)
    assert not reverted.regressed and reverted.reason.startswith(("back", "improved", "not yet")), reverted.reason


def test_since_names_the_first_commit_at_the_new_level_never_a_clean_one():
    medians = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0, 1.01, 0.99, 1.3, 1.31, 1.29]
    commits = ["c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7", "c8", "c9", "c10"]
    v = history.judge_step(medians, True, commits=commits)
    assert v.regressed and commits[v.start] == "c8" and commits[v.last_before] == "c7"
    # c8 was also measured at the old level (two runs on the night it landed): clean, so the level starts
    # with the first commit never measured at the old level
    commits = ["c0", "c1", "c2", "c3", "c4", "c5", "c6", "c8", "c8", "c9", "c10"]
    v = history.judge_step(medians, True, commits=commits)
    assert commits[v.start] == "c9" and v.regressed
    # every run at the new level is of a commit measured at the old one: the machine's, never a flag
    commits = ["c0"] * 11
    v = history.judge_step(medians, True, commits=commits)
    assert not v.regressed and v.reason.startswith("the machine's")


def test_a_noisy_clean_night_just_before_the_step_is_not_named():
    # night 7 (clean) was slow by noise, nearer the old level than the new one; night 8 brought the step
    medians = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0, 1.01, 1.12, 1.3, 1.31, 1.29]
    v = history.judge_step(medians, True, commits=[f"c{i}" for i in range(11)])
    assert v.regressed and v.start == 8 and v.last_before == 7


def test_the_step_named_by_the_records_flag_carries_its_range_and_levels():
    records = stored_history(seed=2, runs=20, slow_runs=4)
    (flag,) = history.figure_regressions(records, 30, 5)
    assert (flag.last_clean_commit, flag.since_commit) == ("c15", "c16") and flag.commit_range() == "c15..c16"
    assert flag.before_level < flag.after_level and flag.unit == "ms"


def test_a_profiles_sizes_for_other_experiments_do_not_split_a_series():
    """device.sizes holds every experiment's sizes on the device; what ran is in the experiment's keys."""
    base = {"matrix": "tbo", "bench.tokens": [128], "device.name": "qemu-arm32"}
    before = {"config": {**base, "device.sizes.gdn.matrix": "tbo", "device.sizes.hybrid.bench.reps": 1}}
    after = {"config": {**base, "device.sizes.gdn.matrix": "tbo", "device.sizes.hybrid.bench.reps": 2}}
    assert history.config_key(before) == history.config_key(after)
    bigger = {"config": {**base, "bench.tokens": [512], "device.sizes.gdn.matrix": "tbo"}}
    assert history.config_key(bigger) != history.config_key(before)
    renamed = {"config": {**base, "device.sizes_x": 1}}  # only the mapping itself is left out, not a prefix
    assert history.config_key(renamed) != history.config_key({"config": base})
