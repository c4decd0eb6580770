"""The results store: atomic batches, torn lines, and runs that break never read as passed."""

import json

import pytest

from testbed import config, runner
from testbed.experiments import gdn
from testbed.results import Figure, Record, ResultsStore, RunInfo, passed
from tests.store_support import as_runs


def rows(n, verdict="pass"):
    info = RunInfo("gdn", "host", "refimpl", {"chunk": 64}, {"abi": "x86_64"})
    return as_runs([info.stamp(Record("gdn", f"case{i}", "oracle", "nmse", verdict, 1.0)) for i in range(n)])


def test_append_and_read_back(tmp_path):
    store = ResultsStore(tmp_path)
    store.append(rows(3))
    store.append(rows(2, "fail"))
    got = store.records("gdn")
    assert [r["verdict"] for r in got] == ["pass"] * 3 + ["fail"] * 2
    assert len({r["run_id"] for r in got}) == 2
    frame = store.frame("gdn")
    assert {"config.chunk", "fingerprint.abi", "git_commit"} <= set(frame.columns)


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path):
    store = ResultsStore(tmp_path)
    store.append(rows(2))
    with open(store.path, "a") as f:
        f.write(json.dumps(rows(1)[1])[:40])  # a crash in the middle of a write
    with pytest.warns(UserWarning, match="torn line"):
        assert len(store.records()) == 2


def test_figures_keep_their_spread():
    f = Figure.of([3.0, 1.0, 2.0], "s")
    assert (f.median, f.min, f.max, f.reps) == (2.0, 1.0, 3.0, 3)
    r = f.rate(6.0, "tokens/s")
    assert (r.median, r.min, r.max) == (3.0, 2.0, 6.0)


def test_an_interrupted_run_keeps_its_records_as_incomplete_with_one_error_record(results_dir, monkeypatch):
    """Ctrl-C in the middle of the oracle matrix: what ran is kept, marked incomplete, and one "error"
    record says what happened; nothing of the run counts as passed."""
    real = gdn.oracle_records

    def interrupted(cfg, ctx, be):
        for n, rec in enumerate(real(cfg, ctx, be)):
            if n == 5:
                raise KeyboardInterrupt
            yield rec

    monkeypatch.setattr(gdn, "oracle_records", interrupted)
    rc = config.load(["mode=oracle", "matrix=awkward"], experiment="gdn")
    with pytest.raises(KeyboardInterrupt):
        runner.execute(rc)
    stored = ResultsStore(results_dir).records()
    assert len(stored) == 6 and all(r["incomplete"] for r in stored) and not any(passed(r) for r in stored)
    (error,) = [r for r in stored if r["verdict"] == "error"]
    assert error["detail"] == "interrupted" and error["metrics"]["records_before_error"] == 5


def test_a_crashing_run_says_what_broke(results_dir, monkeypatch):
    def broken(cfg, ctx, be):
        raise RuntimeError("kernel returned garbage")
        yield

    monkeypatch.setattr(gdn, "oracle_records", broken)
    with pytest.raises(RuntimeError):
        runner.execute(config.load(["mode=oracle"], experiment="gdn"))
    (stored,) = ResultsStore(results_dir).records()
    assert stored["verdict"] == "error" and "kernel returned garbage" in stored["detail"]


def test_under_umask_000_the_store_and_the_adb_key_are_not_writable_by_others(tmp_path, monkeypatch):
    """Issue 24, item 22: the results folder came out 0777 and adbkey.pub 0666."""
    import os
    import stat

    from testbed.devices.adb import ensure_adb_key

    old = os.umask(0)
    try:
        store = ResultsStore(tmp_path / "new" / "results")
        store.check_writable()
        store.append(rows(1))
        key = ensure_adb_key(str(tmp_path / "android" / "adbkey"))
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(tmp_path / "new") == mode(store.root) == 0o755 and mode(store.path) == 0o644
    assert mode(key) == 0o600 and mode(f"{key}.pub") == 0o644 and mode(key.parent) == 0o700
