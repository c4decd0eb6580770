"""`testbed compare A B`: records written through the real store, the command run through the CLI.

Runs are simulated with the noise of tests/test_history.py (seeded lognormal repetitions with 2x
outliers, never timed) and stored the way a run stores them: run marks around its records.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from testbed.cli import main
from testbed.lab import compare
from testbed.results import Figure, Record, ResultsStore, RunInfo
from tests.test_history import SLOWDOWN, TOKENS, repetitions

CASE = "H=4,hs=64,T=512/chunkwise"


def store_run(store: ResultsStore, commit: str, night: int, seconds: np.ndarray, cpu_seconds: np.ndarray,
              verdict: str = "pass", emulated: bool = False, chunk: int = 64, source: str | None = None) -> str:
    """One run of gdn on the host: its bench figures and one oracle verdict, stored between run marks."""
    config = {"chunk": chunk, "results_dir": str(store.root), **({"llamacpp.source": source} if source else {})}
    info = RunInfo("gdn", "host", "native", config, {}, emulated=emulated,
                   git_commit=commit, started=f"2026-02-{night + 1:02d}T02:00:00+00:00")
    t = Figure.of(seconds, "s")
    bench = Record("gdn", CASE, "measure", figures={
        "time": t.scaled(1e3, "ms"), "tokens_per_s": t.rate(TOKENS, "tokens/s"),
        "cpu_time": Figure.of(cpu_seconds, "s").scaled(1e3, "ms")})
    oracle = Record("gdn", "H=4,hs=64,T=64", "oracle", "nmse", verdict, 1.0 if verdict == "pass" else -2.0)
    store.append([info.mark("started"), info.stamp(bench), info.stamp(oracle), info.mark("ended", "complete")])
    return info.run_id


def store_runs(store: ResultsStore, commit: str, seed: int, runs: int, first_night: int = 0, slower: float = 1.0,
               **kw) -> list[str]:
    rng = np.random.default_rng(seed)
    return [store_run(store, commit, first_night + i, repetitions(rng, slower), repetitions(rng), **kw)
            for i in range(runs)]


def compare_cli(capsys, *args) -> tuple[int, str, str]:
    status = main(["compare", *args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def results(tmp_path, monkeypatch) -> ResultsStore:
    monkeypatch.setenv("TESTBED_RESULTS", str(tmp_path / "results"))
    return ResultsStore(tmp_path / "results")


def rows_by_quantity(out: str) -> dict[str, dict]:
    return {r["quantity"]: r for r in json.loads(out)["rows"]}


def test_a_planted_slowdown_between_commits_is_slower_beyond_noise(results, capsys):
    store_runs(results, "aaaa1111" * 5, seed=1, runs=6)
    store_runs(results, "bbbb2222" * 5, seed=2, runs=6, first_night=6, slower=SLOWDOWN)
    status, out, err = compare_cli(capsys, "aaaa", "bbbb22", "--format", "json")
    assert status == 1, err  # B is slower
    rows = rows_by_quantity(out)
    time, cpu = rows["time"], rows["cpu_time"]
    assert time["verdict"] == "slower" and time["derived"] == "tokens_per_s" and "tokens_per_s" not in rows
    assert cpu["verdict"] == "within noise"  # the CPU time was not slowed
    medians = {side: [r["figures"]["time"]["median"] for r in results.records()
                      if r["kind"] == "measure" and r["git_commit"].startswith(side)] for side in ("aaaa", "bbbb")}
    assert time["change_pct"] == pytest.approx(100 * (np.median(medians["bbbb"]) / np.median(medians["aaaa"]) - 1))
    assert [time["a_runs"], time["b_runs"]] == [6, 6] and type(time["a_runs"]) is int and time["p"] < compare.ALPHA
    assert time["a_min"] == min(r["figures"]["time"]["min"] for r in results.records()
                                if r["kind"] == "measure" and r["git_commit"].startswith("aaaa"))
    assert rows["nmse"]["verdict"] == "pass" and rows["nmse"]["b_verdict"] == "6 pass"
    assert "Mann-Whitney" in err  # the rule is stated; stdout holds the data alone


def test_the_same_distribution_twice_is_within_noise(results, capsys):
    store_runs(results, "aaaa1111" * 5, seed=3, runs=6)
    store_runs(results, "cccc3333" * 5, seed=4, runs=6, first_night=6)
    status, out, _ = compare_cli(capsys, "aaaa", "cccc", "--format", "json")
    assert status == 0
    assert {r["quantity"]: r["verdict"] for r in json.loads(out)["rows"]} == {
        "time": "within noise", "cpu_time": "within noise", "nmse": "pass"}


def test_stores_as_sides_and_the_table_for_people(tmp_path, results, capsys):
    before, after = ResultsStore(tmp_path / "before"), ResultsStore(tmp_path / "after")
    store_runs(before, "aaaa1111" * 5, seed=5, runs=5)
    store_runs(after, "aaaa1111" * 5, seed=6, runs=5, slower=SLOWDOWN)  # the same commit, a slower machine
    status, out, _ = compare_cli(capsys, str(before.root), str(after.root))
    assert status == 1
    line = next(row for row in out.splitlines() if "time (and tokens_per_s)" in row)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:4] == ["gdn", "host", "native", CASE] and cells[-1] == "slower"
    assert cells[5].endswith("ms, 5 runs") and "[" in cells[5] and cells[7].startswith("+")
    assert f"A: store {before.root} (5 runs)" in out


def test_two_configs_of_one_case_are_two_rows_told_apart_by_their_config(results, capsys):
    for chunk, seed in ((32, 22), (64, 23)):
        store_runs(results, "aaaa1111" * 5, seed=seed, runs=4, chunk=chunk)
        store_runs(results, "bbbb2222" * 5, seed=seed + 10, runs=4, first_night=4, chunk=chunk)
    status, out, _ = compare_cli(capsys, "aaaa", "bbbb")
    header = next(line for line in out.splitlines() if line.startswith("| experiment"))
    time_rows = [line for line in out.splitlines() if "time (and tokens_per_s)" in line]
    assert [c.strip() for c in header.split("|")][4] == "config" and len(time_rows) == 2
    assert time_rows[0].split("|")[4] != time_rows[1].split("|")[4]


def test_nights_as_sides(results, capsys):
    nights = ResultsStore(results.root / "nights")
    for night, seed, slower in (("2026-02-01T020000Z-aaaaaa", 7, 1.0), ("2026-02-09T020000Z-bbbbbb", 8, 2.0)):
        runs = store_runs(results, "dddd4444" * 5, seed=seed, runs=5, slower=slower)
        nights.append([{"night": night, "suite": "default", "started": night,
                        "devices": {"host": {"status": "ok", "reason": "", "runs": runs}}}])
    status, out, _ = compare_cli(capsys, "2026-02-01T020000Z-aaaaaa", "2026-02-09T020000Z-bbbbbb", "--format", "csv")
    assert status == 1 and out.splitlines()[0].startswith("experiment,device,backend,config,case,quantity")
    assert any(line.startswith("gdn,host,native,") and ",time," in line and line.endswith(",slower")
               for line in out.splitlines())


def test_an_oracle_that_passed_and_now_fails_is_said_loudly(results, capsys):
    store_runs(results, "aaaa1111" * 5, seed=9, runs=4)
    store_runs(results, "eeee5555" * 5, seed=10, runs=4, first_night=4, verdict="fail")
    status, out, err = compare_cli(capsys, "aaaa", "eeee")
    assert status == 1
    assert "PASS -> FAIL" in next(row for row in out.splitlines() if "nmse" in row)
    assert "PASS -> FAIL: gdn on host (native) H=4,hs=64,T=64 nmse: 4 pass in A, 4 fail in B" in err


def test_too_few_runs_are_said_not_guessed(results, capsys):
    store_runs(results, "aaaa1111" * 5, seed=11, runs=2)
    store_runs(results, "ffff6666" * 5, seed=12, runs=2, first_night=2, slower=2.0)
    status, out, _ = compare_cli(capsys, "aaaa", "ffff", "--format", "json")
    assert rows_by_quantity(out)["time"]["verdict"] == "too few runs to tell (2 vs 2)" and status == 0


def test_emulated_figures_are_not_compared_for_speed(results, capsys):
    store_runs(results, "aaaa1111" * 5, seed=13, runs=5, emulated=True)
    store_runs(results, "abab7777" * 5, seed=14, runs=5, first_night=5, slower=2.0, emulated=True)
    status, out, _ = compare_cli(capsys, "aaaa", "abab", "--format", "json")
    assert [r["quantity"] for r in json.loads(out)["rows"]] == ["nmse"] and status == 0


@pytest.mark.parametrize("make, spec, says", [
    (lambda tmp: None, "0123abcd", "'0123abcd' matches nothing; accepted: a results store folder"),
    (lambda tmp: (tmp / "empty").mkdir(), "{tmp}/empty", "is a folder without records.jsonl; accepted:"),
    (lambda tmp: None, "abcd", "commit prefix 'abcd' names 2 commits (abcd1111abcd, abcd2222abcd); accepted:"),
])
def test_a_side_that_matches_nothing_is_one_line_and_exit_2(tmp_path, results, capsys, make, spec, says):
    store_runs(results, "abcd1111" * 5, seed=15, runs=1)
    store_runs(results, "abcd2222" * 5, seed=16, runs=1, first_night=1)
    make(tmp_path)
    before = results.path.read_bytes()
    status, out, err = compare_cli(capsys, "abcd1111", spec.format(tmp=tmp_path))
    assert status == 2 and out == "" and says in err and len(err.strip().splitlines()) == 1
    assert results.path.read_bytes() == before  # nothing written


def test_a_whole_commit_is_not_confused_with_its_dirty_tree(results, capsys):
    clean = "abcd1111" * 5
    store_runs(results, clean, seed=18, runs=5)  # 4 a side cannot reach p < 0.05 over 2 quantities (Holm)
    store_runs(results, clean + "-dirty", seed=19, runs=5, first_night=5, slower=2.0)
    status, out, err = compare_cli(capsys, clean, clean + "-dirty", "--format", "json")
    assert status == 1 and rows_by_quantity(out)["time"]["verdict"] == "slower"
    assert f"A: commit {clean[:12]} (5 runs)" in err


def test_a_zero_median_gets_no_change_rather_than_an_infinite_one():
    """A time that can be 0 (native_bench's extra time of a padded append, clipped at 0)."""
    assert compare.judge_change([0.0] * 4, [1.0, 2.0, 1.5, 1.2], "ms") == (
        None, None, "no change to state: A's median is not above 0")


def test_the_exact_mann_whitney_p_by_hand():
    """Three against three fully apart: 2 of the C(6, 3) = 20 orderings are as extreme, p = 0.1; four
    against four: 2/70. Identical samples: U sits at its centre, p = 1."""
    assert compare.mann_whitney_p([1, 2, 3], [4, 5, 6]) == pytest.approx(0.1)
    assert compare.mann_whitney_p([1, 2, 3, 4], [5, 6, 7, 8]) == pytest.approx(2 / 70)
    assert compare.mann_whitney_p([1, 2, 3], [1, 2, 3]) == 1.0
    # one ordering away from the extreme: U = 1, counted twice as often (U = 0 and U = 1), p = 4/70
    assert compare.mann_whitney_p([1, 2, 3, 5], [4, 6, 7, 8]) == pytest.approx(4 / 70)
    assert not compare.reachable(3, 3, compare.ALPHA) and compare.reachable(4, 4, compare.ALPHA) \
        and compare.reachable(3, 5, compare.ALPHA)


def test_the_normal_limit_agrees_with_the_exact_count_just_past_where_it_takes_over():
    from scipy import stats

    n = compare.EXACT_UP_TO + 1
    rng = np.random.default_rng(17)
    a, b = list(rng.normal(0, 1, n)), list(rng.normal(0.6, 1, n))
    exact = stats.mannwhitneyu(a, b, alternative="two-sided", method="exact").pvalue
    assert 1e-3 < exact < 0.5 and compare.mann_whitney_p(a, b) == pytest.approx(exact, rel=0.05)


def test_ties_get_their_exact_permutation_p_counted_by_hand():
    """Tied run medians (a timer's resolution, a count): every split of the 8 values into 4 and 4 is
    counted, U with ties as halves; the p is the share of splits at least as far from the centre."""
    from itertools import combinations

    a, b = [1.0, 1.0, 2.0, 3.0], [3.0, 4.0, 4.0, 5.0]
    values = a + b

    def u(x, y):
        return sum((p > q) + 0.5 * (p == q) for p in x for q in y)

    centre, observed = len(a) * len(b) / 2, abs(u(a, b) - len(a) * len(b) / 2)
    splits = [(list(c), [values[i] for i in range(8) if i not in c]) for c in combinations(range(8), 4)]
    by_hand = sum(abs(u([values[i] for i in x], y) - centre) >= observed - 1e-9 for x, y in splits) / len(splits)
    assert compare.mann_whitney_p(a, b) == pytest.approx(by_hand)


def test_two_sources_swept_into_one_store_are_compared_by_their_setting(results, capsys):
    """Seed 002's "93 -> 98: neutral or not?": upstream and a patched fork, swept on one commit."""
    store_runs(results, "aaaa1111" * 5, seed=31, runs=5, source="/src/upstream")
    store_runs(results, "aaaa1111" * 5, seed=32, runs=5, first_night=5, source="/src/fork", slower=SLOWDOWN,
               verdict="fail")
    status, out, err = compare_cli(capsys, "llamacpp.source=/src/upstream", "llamacpp.source=/src/fork",
                                   "--format", "json")
    rows = rows_by_quantity(out)
    assert rows["time"]["verdict"] == "slower" and rows["nmse"]["verdict"] == "PASS -> FAIL"
    assert status == 1 and "PASS -> FAIL" in err


def test_a_setting_no_run_has_is_refused_naming_the_values_stored(results, capsys):
    store_runs(results, "aaaa1111" * 5, seed=33, runs=1, source="/src/upstream")
    status, _, err = compare_cli(capsys, "llamacpp.source=/src/upstream", "llamacpp.source=/src/typo")
    assert status == 2
    assert "setting 'llamacpp.source=/src/typo' matches no record" in err and "/src/upstream" in err


# --- one commit on a drifting machine: nights 1-6 against nights 7-12 ---------------------------------------

QUANTITIES = 16


def drifting_nights(seed: int, nights: int = 12, drift: float = 0.012) -> list[dict]:
    """`nights` runs of ONE commit on a machine that gets `drift` slower every night (thermal paste, a
    neighbour's job): 16 kernels' bench records and the run's machine probe, all slowed alike."""
    rng = np.random.default_rng(seed)
    records = []
    for night in range(nights):
        machine = 1 + drift * night
        info = RunInfo("native_bench", "host", "native", {"threads": 1}, {}, git_commit="c0ffee" * 6 + "c0ff",
                       started=f"2026-07-{night + 1:02d}T02:00:00+00:00")
        for q in range(QUANTITIES):
            t = Figure.of(repetitions(rng, machine) * (1 + q / 4), "s")
            records.append(info.stamp(Record("native_bench", f"kernel{q:02d}", "measure",
                                             figures={"time": t.scaled(1e3, "ms")})))
        sgemm = Figure.of(0.004 * machine * rng.lognormal(0.0, 0.05, 20), "s").rate(2 * 512**3 / 1e9, "GFLOP/s")
        records.append(info.stamp(Record("native_bench", "machine_probe/sgemm", "measure",
                                         figures={"sgemm": sgemm.as_probe()})))
    return records


def halves(records: list[dict]) -> tuple[list[dict], list[dict]]:
    first = {r["run_id"] for r in records if r["started"] < "2026-07-07"}
    return [r for r in records if r["run_id"] in first], [r for r in records if r["run_id"] not in first]


def test_one_commit_on_a_drifting_machine_is_not_called_slower():
    """Seeded comparisons of nights 1-6 against 7-12 of one commit, the machine 1.2% slower each night
    (about 7% between the halves' medians). Uncorrected and without the probe, most kernels read slower;
    beside the machine and with Holm's correction, at most the expected false positives remain: the
    family-wise rate is ALPHA, so over 20 comparisons about 1 may call anything slower."""
    comparisons, raw_slower, slower, any_slower = 20, [], [], 0
    for seed in range(comparisons):
        a, b = halves(drifting_nights(seed))
        without_probe = compare.frame(*(([r for r in side if "sgemm" not in r["figures"]]) for side in (a, b)))
        raw = without_probe[without_probe["unit"] == "ms"]
        raw_slower.append(int(((raw["p"] < compare.ALPHA) & (raw["change_pct"] >= 5)).sum()))
        df = compare.frame(a, b)
        kernels = df[df["unit"] == "ms"]
        assert len(kernels) == QUANTITIES and kernels["machine_pct"].between(3, 12).all()
        assert kernels["p_adjusted"].ge(kernels["p"]).all()  # the corrected p is shown beside the raw one
        assert df[df["quantity"] == "sgemm"]["verdict"].str.startswith("machine probe").all()
        slower.append(int((kernels["verdict"] == "slower").sum()))
        any_slower += slower[-1] > 0
    print(f"of {QUANTITIES} kernels, called slower: uncorrected, without the probe {raw_slower} (mean "
          f"{np.mean(raw_slower):.1f}); beside the machine, Holm {slower}; comparisons with any: {any_slower}/"
          f"{comparisons}")
    assert np.mean(raw_slower) >= QUANTITIES / 4  # the drift is real: the old rule called many slower
    assert max(slower) <= 1 and any_slower <= 3  # expected: 0.05 x 20 = 1 comparison


def test_holm_keeps_the_false_alarms_of_many_quantities_at_alpha():
    """No drift, no probe: 16 kernels of one commit, 6 runs against 6. Uncorrected, a comparison calls
    some kernel slower or faster by chance far more often than 5% of the time; corrected, about 5%."""
    comparisons, uncorrected, corrected = 40, 0, 0
    for seed in range(comparisons):
        a, b = halves([r for r in drifting_nights(100 + seed, drift=0.0) if "sgemm" not in r["figures"]])
        kernels = compare.frame(a, b)
        kernels = kernels[kernels["unit"] == "ms"]
        uncorrected += bool(((kernels["p"] < compare.ALPHA) & (kernels["change_pct"].abs() >= 5)).any())
        corrected += bool(kernels["verdict"].isin(["slower", "faster"]).any())
    print(f"comparisons calling any of {QUANTITIES} kernels changed: uncorrected {uncorrected}/{comparisons}, "
          f"Holm {corrected}/{comparisons}")
    assert corrected <= 4 and corrected <= uncorrected


def test_a_real_slowdown_beside_the_machine_is_still_slower(results, capsys):
    a, b = halves(drifting_nights(7))
    for r in b:  # kernel03 got 25% slower in B (the code), beside the machine's drift
        if r["case"] == "kernel03":
            fig = r["figures"]["time"]
            fig.update(median=fig["median"] * 1.25, min=fig["min"] * 1.25, max=fig["max"] * 1.25)
    df = compare.frame(a, b)
    assert df.set_index("case").loc["kernel03", "verdict"] == "slower"
    assert (df[df["case"] != "kernel03"]["verdict"] != "slower").all()


def test_instruction_counts_are_exact_and_in_their_own_table(results, capsys):
    for commit, count, first in (("aaaa1111" * 5, 1_000_000, 0), ("bbbb2222" * 5, 1_020_000, 3)):
        for night in range(first, first + 3):
            info = RunInfo("native_bench", "qemu-aarch64", "native", {"threads": 1, "results_dir": str(results.root)},
                           {}, emulated=True, git_commit=commit, started=f"2026-08-{night + 1:02d}T02:00:00+00:00")
            rec = Record("native_bench", "attention/keys=512", "measure", figures={
                "instructions": Figure(count, count, count, 1, "instructions"),
                "time": Figure.of([9.0, 9.5, 10.0], "ms")})  # emulated: never a speed
            results.append([info.mark("started"), info.stamp(rec), info.mark("ended", "complete")])
    status, out, _ = compare_cli(capsys, "aaaa", "bbbb")
    assert status == 1  # +2% instructions: beyond the 1% that counts
    times_table, counts_table = out.split("instruction counts (exact):")
    assert "instructions" not in times_table.split("\n\n", 1)[1] and "more instructions" in counts_table
    status, out, _ = compare_cli(capsys, "aaaa", "bbbb", "--format", "json")
    (row,) = json.loads(out)["rows"]  # the emulated time is not compared at all
    assert row["quantity"] == "instructions" and row["change_pct"] == pytest.approx(2.0)


def test_an_internal_error_has_its_own_exit_status(results, capsys, monkeypatch):
    store_runs(results, "aaaa1111" * 5, seed=1, runs=5)
    store_runs(results, "bbbb2222" * 5, seed=2, runs=5, first_night=5)

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(compare, "figure_rows", broken)
    status, out, err = compare_cli(capsys, "aaaa", "bbbb")
    assert status == 6 and status != 1 and "internal error" in err and "KeyError" in err


def test_a_count_that_is_not_a_number_is_set_aside_with_a_note(results, capsys):
    """Issue 34: an instruction count stored as text crashed compare (a traceback, exit 6)."""
    for commit, first in (("aaaa1111" * 5, 0), ("bbbb2222" * 5, 3)):
        for night in range(first, first + 3):
            info = RunInfo("native_bench", "qemu-aarch64", "native", {"threads": 1}, {}, emulated=True,
                           git_commit=commit, started=f"2026-08-{night + 1:02d}T02:00:00+00:00")
            rec = info.stamp(Record("native_bench", "attention/keys=512", "measure", figures={
                "instructions": Figure(1e6, 1e6, 1e6, 1, "instructions")}))
            if night == 4:  # a damaged store: the count as text
                rec["figures"]["instructions"]["median"] = "1e6 or so"
            results.append([info.mark("started"), rec, info.mark("ended", "complete")])
    with pytest.warns(UserWarning, match="set aside 1 figures .* figures.instructions.median is a str"):
        status, out, err = compare_cli(capsys, "aaaa", "bbbb", "--format", "json")
    assert status == 0 and "Traceback" not in err
    (row,) = json.loads(out)["rows"]
    assert row["verdict"] == "same count" and (row["a_runs"], row["b_runs"]) == (3, 2)


def test_each_row_says_the_smallest_change_it_could_detect_and_it_shrinks_with_more_runs(tmp_path, results, capsys):
    """Issue 33: with 4 vs 4 runs every row said "too few runs" and nothing of what the comparison
    could have seen. The same noise at 4, 8 and 16 runs a side (each side's first runs shared)."""
    def stores(runs: int) -> tuple[str, str]:
        sides = []
        for name, seed, first in (("a", 21, 0), ("b", 22, 10)):
            folder = tmp_path / f"{name}{runs}"
            store_runs(ResultsStore(folder), "aaaa1111" * 5, seed=seed, runs=runs, first_night=first)
            sides.append(str(folder))
        return sides[0], sides[1]

    detectable = {}
    for runs in (4, 8, 16):
        status, out, _ = compare_cli(capsys, *stores(runs), "--format", "json")
        time = rows_by_quantity(out)["time"]
        detectable[runs] = time["detectable_pct"]
        if runs == 4:  # these runs can see nothing after the correction: said, with the runs that could
            assert time["verdict"].startswith("too few runs to tell") and time["detectable_at"] == "5 vs 5"
        else:
            assert time["detectable_at"] == f"{runs} vs {runs}" and time["verdict"] == "within noise"
    assert detectable[4] > detectable[8] > detectable[16] >= 100 * compare.history.MIN_CHANGE

    # a real slowdown half again above what 8 vs 8 runs can detect is detected
    slower = tmp_path / "slower8"
    store_runs(ResultsStore(slower), "bbbb2222" * 5, seed=22, runs=8, first_night=10,
               slower=1 + 1.5 * detectable[8] / 100)
    status, out, _ = compare_cli(capsys, str(tmp_path / "a8"), str(slower), "--format", "json")
    assert status == 1 and rows_by_quantity(out)["time"]["verdict"] == "slower"
    status, out, _ = compare_cli(capsys, str(tmp_path / "a8"), str(slower))
    assert f"{detectable[8]:.1f} (8 vs 8 runs)" in out


def test_the_detectable_change_is_where_the_test_finds_a_change_four_times_in_five():
    """The simulated power by hand: at the figure the exact test's power is POWER, a little below it
    less; with too few runs for p < alpha, no figure."""
    effect = compare.detectable_effect(8, 8, compare.ALPHA)
    assert compare.power(8, 8, effect, compare.ALPHA) >= compare.POWER
    assert compare.power(8, 8, effect - 2 * compare.EFFECT_PRECISION, compare.ALPHA) < compare.POWER
    assert compare.detectable_effect(3, 3, compare.ALPHA) is None and compare.runs_needed(3, 3, compare.ALPHA) == 4
    # a t-test needs about 1.4 standard deviations at 8 a side for 80% power; Mann-Whitney a little more
    assert 1.3 < effect < 1.8
