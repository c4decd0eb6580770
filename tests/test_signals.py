"""SIGTERM and SIGHUP (a timeout, systemd, a cancelled CI job) stop a run the way Ctrl-C does: what
it measured is kept, one error record says which signal, nothing counts as passed (issue 13, item 12)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from testbed import PROJECT_ROOT
from testbed.results import ResultsStore, passed

# Oracle records come within a second or two; the bench after them runs for a minute: a signal
# sent once records are stored lands mid-run.
LONG_RUN = ["run", "gdn", "mode=all", "matrix=awkward", "bench.tokens=[2048]", "bench.reps=50"]


def stored_lines(path) -> int:
    try:
        return path.read_bytes().count(b'"record_id"')
    except FileNotFoundError:
        return 0


def start_and_wait_for_records(results, argv, at_least=5, within_s=120):
    proc = subprocess.Popen([sys.executable, "-m", "testbed", *argv], cwd=PROJECT_ROOT,
                            env={**os.environ, "TESTBED_RESULTS": str(results)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + within_s
    while stored_lines(results / "records.jsonl") < at_least:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run stored no records within {within_s} s: {proc.communicate()}")
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_mid_run_leaves_an_error_record_and_no_pass(sig, tmp_path):
    results = tmp_path / "results"
    proc = start_and_wait_for_records(results, LONG_RUN)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    stored = ResultsStore(results).records()
    (error,) = [r for r in stored if r["verdict"] == "error"]
    assert err.strip() == (f"testbed: interrupted by {sig.name}; run {error['run_id']} was recorded as broken "
                           "(what it measured is kept)")
    assert error["detail"] == f"interrupted by {sig.name}" and error["metrics"]["records_before_error"] >= 5
    assert len(stored) > 5 and all(r["incomplete"] for r in stored) and not any(passed(r) for r in stored)


def test_a_signal_during_start_up_does_not_claim_a_run_was_broken(tmp_path, monkeypatch, capsys):
    """Issue 24, item 23: SIGINT before any run started said "a run in progress was recorded as broken"."""
    from testbed import config
    from testbed.cli import main

    monkeypatch.setenv("TESTBED_RESULTS", str(tmp_path / "results"))

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(config, "load", interrupted)  # Ctrl-C while the configuration is read
    assert main(["run", "gdn", "mode=oracle"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "testbed: interrupted; no run had started; nothing was stored"
    assert not (tmp_path / "results" / "records.jsonl").exists()

