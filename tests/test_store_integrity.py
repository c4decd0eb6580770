"""The store under damage: torn and NUL-padded lines, failed and cut batches, bad lines, newer schemas,
runs that never end, and a store that cannot be written (issue 13, items 2-4, 13, 14)."""

import errno
import os

import pytest

from testbed import config, runner
from testbed.errors import StoreError
from testbed.experiments import gdn
from testbed.results import Record, ResultsStore, RunInfo, passed
from tests.mounts import tmpfs
from tests.store_support import as_runs


def rows(n, verdict="pass", info=None, marks=True):
    info = info or RunInfo("gdn", "host", "refimpl", {"chunk": 64}, {"abi": "x86_64"})
    records = [info.stamp(Record("gdn", f"case{i}", "oracle", "nmse", verdict, 1.0)) for i in range(n)]
    return as_runs(records) if marks else records


@pytest.mark.parametrize("damage", [b'{"schema": 2, "experi', b"\x00" * 4096, b'{"experiment": "gdn"\x00\x00\x00'],
                         ids=["torn", "nul-padding", "torn-and-nul-padded"])
def test_a_torn_or_nul_padded_last_line_never_swallows_the_next_batch(tmp_path, damage):
    store = ResultsStore(tmp_path)
    store.append(rows(2))
    with open(store.path, "ab") as f:
        f.write(damage)  # a kill -9 or power loss in the middle of a write
    store.append(rows(1, "fail"))  # the next batch, e.g. a FAIL verdict
    with pytest.warns(UserWarning) if damage.strip(b"\x00") else _no_warning():
        got = store.records()
    assert [r["verdict"] for r in got] == ["pass", "pass", "fail"]


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.quick
def test_a_batch_that_fails_midway_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    store = ResultsStore(tmp_path)
    store.append(rows(3))
    before = store.path.read_bytes()
    real_write, calls = os.write, []

    def disk_full_after_some_bytes(fd, data):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, bytes(data[:100]))

    monkeypatch.setattr(os, "write", disk_full_after_some_bytes)
    with pytest.raises(StoreError, match="38 records not stored: No space left on device"):
        store.append(rows(38, marks=False))
    monkeypatch.setattr(os, "write", real_write)
    assert store.path.read_bytes() == before
    assert len(store.records()) == 3


def test_a_batch_cut_short_by_a_kill_is_never_read(tmp_path):
    """kill -9 in the middle of a large write: whole lines of the batch are on disk, its commit is not."""
    store = ResultsStore(tmp_path)
    store.append(rows(3, "fail"))
    half = ResultsStore(tmp_path / "other")
    half.append(rows(38))
    lines = half.path.read_bytes().splitlines(keepends=True)
    with open(store.path, "ab") as f:
        f.writelines(lines[:20])  # 20 of the 38 rows, no commit line
    got = store.records()
    assert len(got) == 3 and {r["verdict"] for r in got} == {"fail"}
    assert list(store.scan().uncommitted.values()) == [20]


def test_lines_that_are_not_utf8_or_not_objects_are_skipped_with_one_warning(tmp_path):
    store = ResultsStore(tmp_path)
    store.append(rows(2))
    with open(store.path, "ab") as f:
        f.write(b'{"bad": "\xff\xfe"}\n[1, 2]\n"text"\n')
    store.append(rows(1))
    with pytest.warns(UserWarning, match="skipped 3 unusable lines") as caught:
        assert len(store.records()) == 3
    assert len(caught) == 1


def test_a_record_without_the_fields_every_record_has_is_skipped(tmp_path):
    store = ResultsStore(tmp_path)
    store.append(rows(1))
    store.append([{"record_id": "x", "experiment": "gdn", "verdict": "pass"}])
    with pytest.warns(UserWarning, match="skipped 1 records without the fields"):
        assert len(store.records()) == 1


def test_a_record_of_a_newer_schema_is_skipped_not_crashed_on(tmp_path):
    store = ResultsStore(tmp_path)
    store.append(rows(1))
    store.append([{"schema": 99, "record_id": "x", "whatever": "a future layout"}])
    with pytest.warns(UserWarning, match="schema 99, newer than"):
        assert len(store.records()) == 1


@pytest.mark.quick
def test_records_are_stored_as_the_run_goes_and_a_killed_run_reads_as_incomplete(results_dir, monkeypatch):
    """A crash hours into a run keeps what was measured; nothing of it counts as passed."""
    real = gdn.oracle_records
    seen = []

    def killed_after_five(cfg, ctx, be):
        for n, rec in enumerate(real(cfg, ctx, be)):
            if n == 5:
                seen.extend(ResultsStore(results_dir).records())  # stored before the run ends
                raise SystemExit("kill -9 stand-in: the run stops with no end mark")
            yield rec

    monkeypatch.setattr(gdn, "oracle_records", killed_after_five)
    # a kill leaves no chance to write; stand in for it by failing every write after the fifth record
    real_append = ResultsStore.append
    monkeypatch.setattr(ResultsStore, "append",
                        lambda self, batch: real_append(self, batch) if len(seen) == 0 else None)
    with pytest.raises(SystemExit):
        runner.execute(config.load(["mode=oracle", "matrix=awkward"], experiment="gdn"))
    assert len(seen) == 6  # five records and the unfinished-run error record
    stored = ResultsStore(results_dir).records()
    assert sum(r["case"] != "run" for r in stored) == 5
    assert all(r["incomplete"] for r in stored) and not any(passed(r) for r in stored)
    (error,) = [r for r in stored if r["verdict"] == "error"]
    assert "never ended" in error["detail"] and error["metrics"]["records_kept"] == 5


def test_a_read_only_store_is_found_before_the_run(tmp_path, monkeypatch, capsys):
    from testbed.cli import main

    with tmpfs(tmp_path / "ro", "64k", read_only=True) as store:
        monkeypatch.setenv("TESTBED_RESULTS", str(store))
        monkeypatch.setattr(gdn, "run", lambda cfg, ctx: pytest.fail("the run started"))
        assert main(["run", "gdn"]) == 5
    err = capsys.readouterr().err.strip()
    assert "cannot be written: Read-only file system" in err and "\n" not in err


def test_a_report_on_a_read_only_store_is_one_line_and_exit_5(tmp_path, monkeypatch, capsys):
    """Issue 24: `testbed report` on a read-only store printed an OSError traceback and exited 1."""
    import subprocess

    from testbed.cli import main

    with tmpfs(tmp_path / "store", "4m") as store:
        ResultsStore(store).append(as_runs(rows(3)))
        subprocess.run(["mount", "-o", "remount,ro", str(store)], check=True, capture_output=True, timeout=30)
        monkeypatch.setenv("TESTBED_RESULTS", str(store))
        assert main(["report"]) == 5
        err = capsys.readouterr().err.strip()
        assert "the report cannot be written: Read-only file system" in err and "\n" not in err
        assert main(["report", "--out", str(tmp_path / "elsewhere")]) in (0, 1)  # a writable --out is taken


def test_a_full_store_is_found_before_the_run(results_dir, monkeypatch, capsys):
    from testbed.cli import main

    class Full:
        f_bavail, f_frsize = 3, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Full)
    monkeypatch.setattr(gdn, "run", lambda cfg, ctx: pytest.fail("the run started"))
    assert main(["run", "gdn"]) == 5
    err = capsys.readouterr().err.strip()
    assert "only 12288 bytes free" in err and "\n" not in err


def test_a_signal_keeps_a_batch_written_whole_and_takes_back_a_partial_one(tmp_path, monkeypatch):
    """Readers may have seen a batch whose every byte is written: a Ctrl-C during its fsync keeps it.
    One during the write takes it back."""
    store = ResultsStore(tmp_path)

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.append(rows(2))
    monkeypatch.undo()
    assert len(store.records()) == 2
    real_write = os.write

    def cut(fd, data):
        monkeypatch.setattr(os, "write", lambda fd, data: (_ for _ in ()).throw(KeyboardInterrupt()))
        return real_write(fd, bytes(data[:50]))

    monkeypatch.setattr(os, "write", cut)
    with pytest.raises(KeyboardInterrupt):
        store.append(rows(3))
    monkeypatch.undo()
    assert len(store.records()) == 2 and store.scan().problems == []
