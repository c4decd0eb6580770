"""`testbed records verify | rm | export` (issue 13, item 21)."""

from __future__ import annotations

import fcntl
import json
import os
import threading

import pytest

from testbed.cli import main
from testbed.results import Record, ResultsStore, RunInfo


def run_rows(n, verdict="pass", experiment="gdn", chunk=64):
    info = RunInfo(experiment, "host", "refimpl", {"chunk": chunk}, {"abi": "x86_64"})
    return info, [info.mark("started"),
                  *(info.stamp(Record(experiment, f"case{i}", "oracle", "nmse", verdict, 1.0)) for i in range(n)),
                  info.mark("ended", "complete")]


@pytest.mark.quick
def test_verify_names_every_kind_of_damage_and_exits_1(results_dir, capsys):
    store = ResultsStore(results_dir)
    _, good = run_rows(3)
    store.append(good)
    assert main(["records", "verify"]) == 0
    assert "3 records in 1 runs; no problems" in capsys.readouterr().out
    killed, rows = run_rows(2)
    store.append(rows[:2])  # started, one record, then a kill
    store.append([good[1]])  # a record stored twice
    with open(store.path, "ab") as f:
        f.write(b'{"batch": "cut", "record_id": "x"}\n{"torn')  # a batch without its commit, then a torn line
    assert main(["records", "verify"]) == 1
    out = capsys.readouterr().out
    assert "1 unusable lines" in out and "1 batches never committed (1 rows" in out
    assert "1 records stored more than once" in out
    assert f"1 runs never ended (killed, or still running): {killed.run_id}" in out


def test_rm_by_run_with_a_dry_run_first(results_dir, capsys):
    store = ResultsStore(results_dir)
    keep, kept_rows = run_rows(3)
    gone, _ = run_rows(2, "fail")
    store.append(kept_rows)
    store.append(_)
    before = store.path.read_bytes()
    assert main(["records", "rm", "--run", gone.run_id, "--dry-run"]) == 0
    assert "would remove 2 records of 1 runs (and 2 run marks)" in capsys.readouterr().out
    assert store.path.read_bytes() == before
    assert main(["records", "rm", "--run", gone.run_id]) == 0
    assert "removed 2 records of 1 runs (and 2 run marks)" in capsys.readouterr().out
    assert {r["run_id"] for r in store.records()} == {keep.run_id}
    assert [p.name.startswith("records.jsonl.before-") for p in results_dir.iterdir()].count(True) == 1
    assert main(["records", "verify"]) == 0


def test_rm_by_filter_keeps_a_broken_run_broken(results_dir, capsys):
    import subprocess
    import sys

    store = ResultsStore(results_dir)
    _, a = run_rows(2, chunk=32)
    b, b_rows = run_rows(3, chunk=64)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    store.append(a)
    store.append([{**b_rows[0], "pid": int(dead.stdout)}, *b_rows[1:3]])  # run b never ended (killed)
    assert main(["records", "rm", "--where", "config.chunk=64", "--where", "case=case0", "--force"]) == 0
    stored = store.records()
    assert [r["case"] for r in stored if r["run_id"] == b.run_id] == ["case1", "run"]  # its error record stays
    assert main(["records", "rm"]) == 2
    assert "needs a selector" in capsys.readouterr().err
    assert main(["records", "rm", "--where", "nonsense"]) == 2


def test_rm_a_night_removes_its_runs_and_its_log_entries(results_dir, capsys):
    store = ResultsStore(results_dir)
    night_run, rows = run_rows(2)
    other, other_rows = run_rows(1)
    store.append(rows)
    store.append(other_rows)
    ResultsStore(results_dir / "nights").append([{"night": "N1", "suite": "s", "started": "2026-01-01T00:00:00",
                                                   "devices": {"host": {"status": "ok", "reason": "",
                                                                        "runs": [night_run.run_id]}}}])
    assert main(["records", "rm", "--night", "N2"]) == 2
    assert main(["records", "rm", "--night", "N1"]) == 0
    assert {r["run_id"] for r in store.records()} == {other.run_id}
    assert ResultsStore(results_dir / "nights").rows() == []


def test_export_shows_what_the_reader_sees(results_dir, capsys):
    store = ResultsStore(results_dir)
    _, rows = run_rows(2, "fail")
    store.append(rows[:3])  # never ended
    assert main(["records", "export", "--where", "verdict=error"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["incomplete"] is True
    assert main(["records", "export", "--format", "csv"]) == 0
    assert capsys.readouterr().out.count("\n") == 4  # header and three records


def test_a_writer_waiting_during_a_rewrite_lands_in_the_new_file(tmp_path):
    store = ResultsStore(tmp_path)
    _, rows = run_rows(1)
    store.append(rows)
    fd = os.open(store.path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # stands in for `records rm` holding the lock
    _, late = run_rows(1)
    writer = threading.Thread(target=store.append, args=(late,))
    writer.start()
    writer.join(0.5)
    assert writer.is_alive()  # waiting for the lock
    fresh = tmp_path / "fresh"
    fresh.write_bytes(store.path.read_bytes())
    os.replace(fresh, store.path)
    os.close(fd)
    writer.join(30)
    assert len(store.records()) == 2


def test_table_says_which_runs_did_not_end_complete(results_dir, capsys):
    from testbed import config, runner

    runner.execute(config.load(["mode=oracle", "matrix=awkward"], experiment="gdn"))
    killed, rows = run_rows(2)
    ResultsStore(results_dir).append(rows[:3])  # never ended
    capsys.readouterr()
    assert main(["table", "gdn"]) == 0
    err = capsys.readouterr().err
    assert f"note: 1 run(s) did not end complete ({killed.run_id})" in err


def test_rm_refuses_a_run_without_an_end_mark_unless_forced_once_its_process_is_gone(results_dir, capsys):
    """Issue 24, item 1: `rm --run` of a run still going took its start mark away, and when the run was
    then killed its later records read as passed."""
    import subprocess
    import sys

    store = ResultsStore(results_dir)
    live, rows = run_rows(2)
    store.append(rows[:2])  # started (by this very process, still running), one record
    before = store.path.read_bytes()
    for force in ([], ["--force"]):
        assert main(["records", "rm", "--run", live.run_id, *force]) == 2
        err = capsys.readouterr().err
        assert f"run {live.run_id}: the run has no end mark and process {os.getpid()}" in err
        assert "still running" in err
    assert store.path.read_bytes() == before
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed, rows = run_rows(2)
    store.append([{**rows[0], "pid": int(dead.stdout)}, rows[1]])  # started, one record, then killed
    assert main(["records", "rm", "--run", killed.run_id]) == 2
    assert "or --force once process" in capsys.readouterr().err
    assert main(["records", "rm", "--run", killed.run_id, "--force"]) == 0
    assert "removed 1 records of 1 runs (and 1 run marks)" in capsys.readouterr().out
    assert killed.run_id not in {r["run_id"] for r in store.records()}


def test_records_of_a_run_without_marks_read_incomplete(results_dir, capsys):
    """Issue 24, item 1: the start mark gone (removed while the run went on), and the run killed: its
    records must not read as passed, and `records verify` must say so."""
    from testbed.results import passed

    store = ResultsStore(results_dir)
    run, rows = run_rows(3)
    store.append(rows[1:3])  # two records, neither mark
    stored = store.records()
    assert not any(passed(r) for r in stored) and all(r["incomplete"] for r in stored)
    (error,) = [r for r in stored if r["verdict"] == "error"]
    assert error["run_id"] == run.run_id and "no start or end mark" in error["detail"]
    assert main(["records", "verify"]) == 1
    assert f"1 runs have records but no start or end mark (read as incomplete): {run.run_id}" in \
        capsys.readouterr().out
    store.append([rows[-1]])  # its end mark: "ended complete"
    assert all(passed(r) for r in store.records())


def test_rm_of_a_run_not_in_the_store_changes_nothing(results_dir, capsys):
    """Issue 24, item 21: `rm --run WRONG` exited 0 and rewrote the store, dropping the torn lines that
    `verify` reported (the evidence of what happened)."""
    store = ResultsStore(results_dir)
    _, rows = run_rows(2)
    store.append(rows)
    with open(store.path, "ab") as f:
        f.write(b'{"torn')
    before = store.path.read_bytes()
    assert main(["records", "rm", "--run", "nosuchrun"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--run 'nosuchrun' is not a run in" in err and "nothing changed" in err
    assert main(["records", "rm", "--where", "experiment=nosuch"]) == 0
    assert "matches; nothing changed" in capsys.readouterr().out
    assert store.path.read_bytes() == before and not list(results_dir.glob("records.jsonl.before-*"))


def test_rm_keeps_a_symlinked_store_a_symlink(results_dir, tmp_path, capsys):
    """Issue 24, item 21: the rewrite replaced the link with a regular file, so the store it pointed at
    kept every removed record and the link's folder held a copy."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    real = ResultsStore(elsewhere)
    gone, rows = run_rows(2)
    kept, more = run_rows(1)
    real.append(rows)
    real.append(more)
    results_dir.mkdir()
    (results_dir / "records.jsonl").symlink_to(real.path)
    assert main(["records", "rm", "--run", gone.run_id]) == 0
    assert (results_dir / "records.jsonl").is_symlink()
    assert {r["run_id"] for r in real.records()} == {kept.run_id}
    assert list(elsewhere.glob("records.jsonl.before-*"))


def test_export_csv_quotes_cells_a_spreadsheet_would_run(results_dir, capsys):
    """Issue 24, item 21: device text like =HYPERLINK(...) went into CSV cells as it was."""
    import csv
    import io

    info = RunInfo("gdn", "host", "refimpl", {"chunk": 64}, {"model": "=HYPERLINK(\"http://x\",\"y\")"})
    ResultsStore(results_dir).append([info.mark("started"), info.stamp(Record("gdn", "+cmd|' /C calc'!A0", "oracle",
                                                                              "nmse", "fail", -1.0, detail="@SUM(1)")),
                                      info.mark("ended", "complete")])
    assert main(["records", "export", "--format", "csv"]) == 0
    (row,) = csv.DictReader(io.StringIO(capsys.readouterr().out))
    assert row["fingerprint.model"] == "'=HYPERLINK(\"http://x\",\"y\")"
    assert row["case"] == "'+cmd|' /C calc'!A0" and row["detail"] == "'@SUM(1)"
    assert row["margin"] == "-1.0" and row["verdict"] == "fail"  # numbers stay numbers


def test_a_start_mark_testbed_never_wrote_still_leaves_its_run_broken(results_dir):
    """A bare start mark (no run context) of a run whose records are whole: the run's error record takes
    its context from the first record, so the run still reads as broken, and nothing crashes."""
    import warnings

    from testbed.results import passed

    store = ResultsStore(results_dir)
    run, rows = run_rows(2)
    store.append([{"run_mark": "started", "run_id": run.run_id}, *rows[1:3]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is set aside: the records are whole
        stored = store.records()
    assert not any(passed(r) for r in stored)
    (error,) = [r for r in stored if r["verdict"] == "error"]
    assert error["run_id"] == run.run_id and error["device"] == "host" and "never ended" in error["detail"]


def test_rm_of_a_failed_verdict_marks_its_run_edited_never_passed(results_dir, capsys):
    """Issue 34, Records: `rm --where verdict=fail` turned a failed run into a complete run of passes,
    green in the report and `records verify` silent."""
    from testbed.results import passed  # what the report's colours count (report.build.counts_as_passed)

    store = ResultsStore(results_dir)
    info = RunInfo("gdn", "host", "refimpl", {"chunk": 64}, {"abi": "x86_64"})
    verdicts = ["pass", "fail", "pass"]
    store.append([info.mark("started"),
                  *(info.stamp(Record("gdn", f"case{i}", "oracle", "nmse", v, 1.0)) for i, v in enumerate(verdicts)),
                  info.mark("ended", "complete")])
    untouched, rows = run_rows(2)
    store.append(rows)
    assert main(["records", "rm", "--where", "verdict=fail"]) == 0
    assert "1 runs that lost records keep their marks, marked edited" in capsys.readouterr().out
    kept = [r for r in store.records() if r["run_id"] == info.run_id]
    assert [r["verdict"] for r in kept] == ["pass", "pass"] and not any(passed(r) for r in kept)
    assert all(passed(r) for r in store.records() if r["run_id"] == untouched.run_id)
    (end,) = [r for r in store.rows() if r.get("run_mark") == "ended" and r["run_id"] == info.run_id]
    assert end["outcome"] == "edited" and end["ended_as"] == "complete" and "--where verdict=fail" in end["edits"][0]
    assert main(["records", "verify"]) == 1
    assert f"1 runs had records removed by `records rm` (their verdicts no longer count as passed): {info.run_id}" \
        in capsys.readouterr().out
    broke, rows = run_rows(2)
    store.append([*rows[:3], {**rows[3], "outcome": "broke"}])
    assert main(["records", "rm", "--where", "case=case1", "--where", f"run_id={broke.run_id}"]) == 0
    assert main(["records", "verify"]) == 1  # edited, and still broke: how it ended is kept
    out = capsys.readouterr().out
    assert "2 runs had records removed" in out and f"1 runs broke (each has its error record): {broke.run_id}" in out


def test_rm_where_refuses_a_run_without_an_end_mark(results_dir, capsys):
    """Issue 34, Records: `rm --where run_id=ID` removed a running run's records (the live-run refusal
    covered only --run and --night)."""
    store = ResultsStore(results_dir)
    live, rows = run_rows(2)
    store.append(rows[:3])  # started by this very process, still running
    before = store.path.read_bytes()
    for where in (f"run_id={live.run_id}", "verdict=pass"):
        assert main(["records", "rm", "--where", where, "--force"]) == 2
        assert f"run {live.run_id}: the run has no end mark and process {os.getpid()}" in capsys.readouterr().err
    assert store.path.read_bytes() == before


def test_verify_names_figures_that_are_not_numbers_and_the_reader_sets_them_aside(results_dir, capsys):
    """Issue 34: a stored instruction count that is not a number crashed compare and report, and
    `records verify` did not flag it."""
    import warnings

    from testbed.results import Figure

    store = ResultsStore(results_dir)
    info = RunInfo("gdn", "host", "native", {"chunk": 64}, {"abi": "x86_64"})
    record = info.stamp(Record("gdn", "c", "measure", figures={"instructions": Figure.of([100], "instructions"),
                                                                   "time": Figure.of([1.0, 2.0], "s")}))
    store.append([info.mark("started"), record, info.mark("ended", "complete")])
    assert main(["records", "verify"]) == 0
    capsys.readouterr()
    for bad in ("lots", float("nan"), [1], True):
        broken = {**record, "figures": {**record["figures"],
                                        "instructions": {**record["figures"]["instructions"], "median": bad}}}
        store.rewrite(lambda row: True)
        store.path.write_text("".join(json.dumps(r) + "\n" for r in
                                      [info.mark("started"), broken, info.mark("ended", "complete")]))
        assert main(["records", "verify"]) == 1
        out = capsys.readouterr().out
        assert "1 figures that are not finite numbers" in out
        assert f"run {info.run_id} record {record['record_id']}: figures.instructions.median is" in out
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (read,) = store.records()
        assert list(read["figures"]) == ["time"]  # the bad figure set aside, the record and its other figures kept
        assert "set aside 1 figures" in str(caught[0].message)
        assert main(["report"]) == 0  # the report's data path too (a text count was a TypeError)
