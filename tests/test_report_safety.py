"""The report never destroys what is not a report, shows every kind of record the project writes,
escapes everything it shows, and cleans up after a killed build (issue 13, items 1, 6, 8, 18)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from testbed import PROJECT_ROOT
from testbed.cli import main
from testbed.errors import UsageError
from testbed.lab import nightly
from testbed.report import build as report
from testbed.results import Figure, Record, ResultsStore, RunInfo
from tests.test_report import FIXTURES

HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>|]](javascript:alert(1))\n# heading'


def hostile_records() -> list[dict]:
    info = RunInfo("gdn", HOSTILE, HOSTILE, {"chunk": HOSTILE, HOSTILE: 1}, {"model": HOSTILE},
                   run_id="r" + HOSTILE[:11], git_commit=HOSTILE)
    return [info.stamp(Record("gdn", HOSTILE, "oracle", HOSTILE, "fail", -1.0, {HOSTILE: HOSTILE},
                              params={"op": HOSTILE}, detail=HOSTILE)),
            info.stamp(Record("gdn", HOSTILE, "measure", figures={HOSTILE: Figure(1.0, 0.5, 2.0, 3, HOSTILE)},
                              params={"op": HOSTILE}, detail=HOSTILE))]


@pytest.mark.quick
def test_every_field_that_reaches_the_page_is_escaped(tmp_path):
    nights = [{"night": HOSTILE, "suite": HOSTILE, "started": "2026-01-01T00:00:00+00:00", "finished": HOSTILE,
               "tools": {HOSTILE: HOSTILE}, "devices": {HOSTILE: {"status": HOSTILE, "reason": HOSTILE}},
               "exit_status": 1}]
    content = report.build(hostile_records(), tmp_path / "report", FIXTURES, report.settings(), nights)
    html = (tmp_path / "report" / "report.html").read_text()
    md = (tmp_path / "report" / "report.md").read_text()
    assert "<script" not in html and "<img src=x" not in html and "&lt;script&gt;" in html
    assert "<script" not in md and "<img" not in md and not re.search(r"(?<!\\)\]\(javascript", md)
    assert all(line.startswith("|") for line in md.splitlines() if "alert" in line and "|" in line[:2])
    # every hostile field made it onto the page, as text
    assert html.count("&lt;script&gt;") >= 10 and content["summary"]["oracles_passed"] == 0


def test_out_refuses_a_folder_that_is_not_a_report(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    store = ResultsStore(results)
    store.append(hostile_records())
    monkeypatch.setenv("TESTBED_RESULTS", str(results))
    keep = results / "records.jsonl"
    before = keep.read_bytes()
    for out in (results, tmp_path, keep):
        assert main(["report", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert "is not a testbed report" in err and "\n" not in err
    assert keep.read_bytes() == before
    # a previous report is replaced
    assert main(["report", "--out", str(tmp_path / "rep")]) == 1  # the hostile oracle fails
    assert main(["report", "--out", str(tmp_path / "rep")]) == 1
    assert (tmp_path / "rep" / "report.html").exists()


def test_a_report_written_before_the_marker_is_still_replaced(tmp_path):
    old = tmp_path / "report"
    old.mkdir()
    for name in ("report.html", "report.md", "report.json", "tail-host.png"):
        (old / name).write_text("old")
    report.build([], old, FIXTURES, report.settings())
    assert (old / report.MARKER).is_file() and (old / "report.html").read_text() != "old"
    (old / report.MARKER).unlink()
    (old / "records.jsonl").write_text("{}\n")  # not only a report's files: refused
    with pytest.raises(UsageError, match="is not a testbed report"):
        report.build([], old, FIXTURES, report.settings())


def test_reports_and_nights_take_ingested_perf_records(results_dir, seed_fixtures, tmp_path, monkeypatch, capsys):
    tbo = seed_fixtures / "test-backend-ops"
    assert main(["ingest", str(tbo / "perf_b_CPU.stdout")]) == 0
    assert main(["ingest", str(tbo / "test_mode_b_CPU.csv")]) == 0
    assert main(["run", "gdn", "matrix=awkward", "bench.tokens=[64]", "bench.heads=4", "bench.head_size=32",
                 "bench.reps=2"]) == 0
    assert main(["report", "--out", str(tmp_path / "rep")]) == 0
    content = json.loads((tmp_path / "rep" / "report.json").read_text())
    other = next(s for s in content["sections"] if s["id"] == "measurements")
    rows = other["tables"][0]["rows"]
    # time and bandwidth of each perf row, and the gdn run's machine probe (its sgemm), named as such
    assert len(rows) == 12 * 2 + 1
    (probe,) = [r for r in rows if r["case"].startswith("machine_probe/")]
    assert probe["figure"] == "sgemm" and probe["unit"] == "GFLOP/s"
    assert "sgemm (machine probe)" in (tmp_path / "rep" / "report.md").read_text()
    assert any(s["id"] == "gdn" for s in content["sections"])


def test_the_night_log_says_the_exit_status_the_process_returns(tmp_path, results_dir, monkeypatch):
    suite = nightly.Suite("s", ["host"], {"host": []}, tmp_path / "locks", 0, tmp_path / "rep")

    def broken(*args, **kwargs):
        raise KeyError("chunk")

    monkeypatch.setattr(report, "write", broken)
    status, summary = nightly.run_night(suite, ResultsStore(results_dir), log=lambda d, m: None)
    assert status == 1 and "report: not written: KeyError" in summary
    (night,) = report.night_log(results_dir)
    assert night["exit_status"] == 1 and "not written" in night["report"]


def test_a_killed_night_is_in_the_log(tmp_path, results_dir):
    store = ResultsStore(results_dir / "nights")
    store.append([{"night": "n1", "suite": "s", "started": "2026-01-01T00:00:00+00:00", "tools": {}}])
    (night,) = report.night_log(results_dir)
    content = report.build([], tmp_path / "rep", FIXTURES, report.settings(), [night])
    table = next(s for s in content["sections"] if s["id"] == "nights")["tables"][0]
    assert table["rows"][0]["finished"] is None  # data: no time, not a sentence
    assert "never: the night was killed" in (tmp_path / "rep" / "report.html").read_text()


def test_a_killed_build_leaves_nothing_the_next_one_does_not_clean(tmp_path):
    out = tmp_path / "rep"
    code = ("import os, sys; from pathlib import Path; from testbed.report import build as report\n"
            "from tests.test_report import FIXTURES\n"
            "def die(inp): os._exit(9)\n"
            "report.SECTIONS = [die]\n"
            f"report.build([], Path({str(out)!r}), FIXTURES, report.settings())\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, timeout=120, capture_output=True, text=True)
    assert p.returncode == 9, p.stderr
    assert [q.name for q in tmp_path.iterdir() if q.name.startswith(".rep.staging-")]  # the kill left one
    report.build([], out, FIXTURES, report.settings())
    assert sorted(q.name for q in tmp_path.iterdir()) == ["rep"]


def test_a_build_killed_mid_swap_puts_the_previous_report_back(tmp_path):
    out = tmp_path / "rep"
    report.build([], out, FIXTURES, report.settings())
    out.rename(tmp_path / ".rep.old")  # killed after moving the previous report aside
    report.tidy(out)
    assert (out / "report.html").exists() and not (tmp_path / ".rep.old").exists()


def test_a_night_stopped_by_a_signal_says_so_in_the_log(tmp_path, results_dir, monkeypatch):
    import signal

    from testbed import runner

    def stopped(*args, **kwargs):
        raise runner.Interrupted(signal.SIGTERM)

    monkeypatch.setattr(nightly, "work", stopped)
    suite = nightly.Suite("s", ["host"], {"host": []}, tmp_path / "locks", 0, tmp_path / "rep")
    with pytest.raises(runner.Interrupted):
        nightly.run_night(suite, ResultsStore(results_dir), log=lambda d, m: None)
    (night,) = report.night_log(results_dir)
    assert night["exit_status"] == 128 + signal.SIGTERM and "interrupted by SIGTERM" in night["report"]
