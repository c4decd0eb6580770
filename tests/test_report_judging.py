"""The report's side of the judges (testbed.measure.history): the banner names every flag, the flags table
carries levels, commit range, the machine's reading and the A/B evidence, instruction counts have their
own section, and each flagged timing is plotted as judged (a baseline band, flag marks, commit labels).

Records are planted, seeded, never timed: ten nights of one kernel benchmark on the host, each of its own
commit, with the run's machine probe beside it.
"""

from __future__ import annotations

import numpy as np
import pytest

from testbed.measure import history
from testbed.report import build as report, plots
from testbed.results import Figure, Record, RunInfo
from tests.test_report import FIXTURES

NIGHTS = 10


def commit(night: int) -> str:
    return f"{night:02d}abcdef" * 5


def planted(slow_cases: set[str], count_rise: float = 0.02, ab: bool = True) -> list[dict]:
    """Ten nights: kernels k1, k2, k3 (the ones in `slow_cases` 30% slower on the last two nights), an
    instruction count that rises by `count_rise` on the last night, the machine probe (unchanged), and
    on the last night an A/B job saying B is 12% slower."""
    rng = np.random.default_rng(3)
    records = []
    for night in range(NIGHTS):
        info = RunInfo("native_bench", "host", "native", {"threads": 1}, {}, git_commit=commit(night),
                       started=f"2026-10-{night + 1:02d}T02:00:00+00:00",
                       host_load={"cores": 2, "load_1m_before": 0.2, "load_1m_after": 0.3, "noisy": False})
        for case in ("k1", "k2", "k3"):
            slower = 1.3 if case in slow_cases and night >= NIGHTS - 2 else 1.0
            t = Figure.of(10.0 * slower * rng.lognormal(0.0, 0.02, 9), "ms")
            records.append(info.stamp(Record("native_bench", case, "measure", figures={"time": t})))
        count = round(1_000_000 * (1 + count_rise)) if night == NIGHTS - 1 else 1_000_000
        records.append(info.stamp(Record("native_bench", "attention/keys=512", "measure", figures={
            "instructions": Figure(count, count, count, 1, "instructions"),
            "time": Figure.of(20.0 * rng.lognormal(0.0, 0.02, 9), "ms")})))
        sgemm = Figure.of(4.0 * rng.lognormal(0.0, 0.02, 9), "ms").rate(2 * 512**3 / 1e6, "GFLOP/s")
        records.append(info.stamp(Record("gdn", "machine_probe/sgemm,threads=1", "measure",
                                         figures={"sgemm": sgemm.as_probe()})))
        if ab and night == NIGHTS - 1:
            records.append(info.stamp(Record("native_bench", "ab/k1", "measure", figures={
                "ab_ratio_cpu": Figure(1.12, 1.08, 1.2, 16, "ratio", ab={
                    "a_commit": commit(night - 1), "b_commit": commit(night), "p": 0.0004, "pairs": 16,
                    "test": "wilcoxon", "verdict": "slower"})})))
    return records


def test_the_banner_names_every_flag_and_the_table_says_levels_range_machine_and_evidence(tmp_path):
    content = report.build(planted({"k1", "k2"}), tmp_path / "report", FIXTURES, report.settings())
    flags = content["flags"]
    assert sorted((f["kind"], f["case"]) for f in flags) == [
        ("ab", "ab/k1"), ("figure", "k1"), ("figure", "k2"), ("instructions", "attention/keys=512")]
    (verdict,) = content["summary"]["verdicts"]
    assert verdict["colour"] == "amber" and "4 regression flags: (1) " in verdict["reason"]
    for f in flags:  # every one, not only the first
        assert f["line"] in verdict["reason"]
    page = (tmp_path / "report" / "report.html").read_text()
    assert all(f["case"] in page for f in flags)

    section = next(s for s in content["sections"] if s["id"] == "regressions")
    rows = {(r["kind"], r["case"]): r for r in section["tables"][0]["rows"]}
    k1 = rows[("figure", "k1")]
    assert k1["commits (last old .. first new)"] == f"{commit(NIGHTS - 3)[:8]}..{commit(NIGHTS - 2)[:8]}"
    assert k1["machine"].startswith("machine ") and "beside the machine" in k1["machine"]
    assert k1["before (level)"].endswith(" ms") and k1["change"].startswith("+")
    ab = rows[("ab", "ab/k1")]["A/B evidence"]
    assert ab["pairs"] == 16 and ab["p"] == 0.0004 and ab["test"] == "wilcoxon" and ab["p_corrected"] == 0.0004
    count = rows[("instructions", "attention/keys=512")]
    assert (count["now"], count["before (level)"], count["change"]) == (
        "1,020,000 instructions", "1,000,000 instructions", "+2.00%")


def test_instruction_counts_have_their_own_section_with_the_time_beside(tmp_path):
    content = report.build(planted(set(), count_rise=0.005, ab=False), tmp_path / "report", FIXTURES,
                           report.settings())
    assert content["flags"] == []  # +0.5%: reported, not flagged
    section = next(s for s in content["sections"] if s["id"] == "instructions")
    latest, changes = section["tables"]
    (row,) = latest["rows"]
    assert row["instructions"] == 1_005_000 and row["run before"] == 1_000_000
    assert row["change"] == pytest.approx(0.5) and row["time unit"] == "ms" and row["time (median)"] > 0
    (change,) = changes["rows"]
    assert change["verdict"] == "changed (within the rise that counts)"
    assert change["commits"] == f"{commit(NIGHTS - 2)[:10]}..{commit(NIGHTS - 1)[:10]}"
    # never in a table of times
    other = next(s for s in content["sections"] if s["id"] == "measurements")
    assert all(r["unit"] != "instructions" for t in other["tables"] for r in t["rows"])


def drawn_plots(monkeypatch) -> list[dict]:
    """What each plot the report saves shows: its file name, legend, x tick labels, filled bands."""
    drawn = []
    real_save = plots._save

    def save(fig, out, name):
        ax = fig.axes[0]
        drawn.append({"name": name, "labels": [t.get_text() for t in ax.get_legend().get_texts()],
                      "ticks": [t.get_text() for t in ax.get_xticklabels()], "bands": len(ax.collections)})
        return real_save(fig, out, name)

    monkeypatch.setattr(plots, "_save", save)
    return drawn


def test_each_flagged_timing_is_plotted_as_judged(tmp_path, monkeypatch):
    drawn = drawn_plots(monkeypatch)
    content = report.build(planted({"k1"}, ab=False), tmp_path / "report", FIXTURES, report.settings())
    judged = next(d for d in drawn if d["name"].startswith("judged-"))  # the flagged one first
    assert "k1" in judged["name"] and judged["bands"] >= 1
    assert any(label.startswith("baseline: level before") for label in judged["labels"])
    assert "flagged" in judged["labels"] and any(label.startswith("new level (+") for label in judged["labels"])
    assert judged["ticks"][0] == f"{commit(0)[:7]}\n2026-10-01"  # each run by its commit and night
    images = next(s for s in content["sections"] if s["id"] == "history")["images"]
    assert images[0]["file"] == judged["name"] and "regressed" in images[0]["caption"]


def test_a_step_the_machine_explains_is_plotted_not_flagged(tmp_path):
    records = planted({"k1", "k2", "k3"}, count_rise=0.0, ab=False)
    for r in records:  # the machine, not the code: its probe slowed as much as every kernel
        if r["case"].startswith("machine_probe") and r["started"] >= f"2026-10-{NIGHTS - 1:02d}":
            fig = r["figures"]["sgemm"]
            fig.update(median=fig["median"] / 1.3, min=fig["min"] / 1.3, max=fig["max"] / 1.3)
    content = report.build(records, tmp_path / "report", FIXTURES, report.settings())
    assert content["flags"] == []
    lines = next(s for s in content["sections"] if s["id"] == "regressions")["lines"]
    assert sum(line.startswith("Not flagged: time of native_bench k") and "the machine's" in line
               for line in lines) == 3
    assert history.is_probe(records[-1], "sgemm")


def test_every_judged_timing_has_its_history_plot_without_a_flag(tmp_path, monkeypatch):
    """asv draws every benchmark's history, not only a flagged one's: ten quiet nights, no flag, and each
    kernel's timing is plotted over its commits."""
    drawn = drawn_plots(monkeypatch)
    content = report.build(planted(set(), count_rise=0.0, ab=False), tmp_path / "report", FIXTURES,
                           report.settings())
    assert content["flags"] == []
    judged = {d["name"]: d for d in drawn if d["name"].startswith("judged-")}
    for case in ("k1", "k2", "k3"):
        (plot,) = [d for name, d in judged.items() if f"-{case}-time" in name]
        assert plot["ticks"][0] == f"{commit(0)[:7]}\n2026-10-01" and "flagged" not in plot["labels"]
