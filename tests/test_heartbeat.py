"""Long silent steps say they are alive (testbed.heartbeat): a line at least every interval while the step
runs, from a timer thread, and none after it ends. Each test's step waits until the heartbeat has spoken
(no test leans on a timer being fast); the interval is the test's own (TESTBED_HEARTBEAT_S)."""

import re
import threading

import pytest

from testbed.errors import UsageError
from testbed.heartbeat import heartbeat, interval


def test_a_step_that_outlasts_the_interval_says_it_is_still_running():
    said, spoke = [], threading.Event()

    def say(msg):
        said.append(msg)
        if len(said) >= 2:
            spoke.set()

    with heartbeat("compiling gdn for aarch64", say, every=0.01):
        assert spoke.wait(600), said
    assert all(re.fullmatch(r"still compiling gdn for aarch64 \(\d+ s\)", line) for line in said), said
    assert not any(t.name.startswith("heartbeat: ") for t in threading.enumerate())  # stopped with the step


def test_iree_compilation_beats_while_the_compiler_is_silent(tmp_path):
    """iree-compile prints nothing for minutes: the step runs the compiler with a heartbeat through the
    run's progress. Here the 'compiler' waits, silent, until the heartbeat has spoken."""
    from testbed.backends.iree import artifacts

    flag = tmp_path / "spoke"
    said = []

    def progress(msg):
        said.append(msg)
        if msg.startswith("still "):
            flag.touch()

    with pytest.MonkeyPatch.context() as m:
        m.setenv("TESTBED_HEARTBEAT_S", "0.01")
        artifacts._run_compiler(["sh", "-c", f'while [ ! -e "{flag}" ]; do sleep 0.01; done'], tmp_path,
                                "compiling gdn for host", progress)
    assert said[0] == "compiling gdn for host ..." and said[-1].startswith("compiling gdn for host: done in ")
    assert any(re.fullmatch(r"still compiling gdn for host \(\d+ s\)", line) for line in said), said


def test_doctor_beats_while_it_checks(monkeypatch, capsys):
    from testbed.cli import main

    monkeypatch.setenv("TESTBED_HEARTBEAT_S", "0.001")  # doctor starts processes: far longer than this
    assert main(["doctor", "host"]) == 0
    assert re.search(r"^still checking host \(\d+ s\)$", capsys.readouterr().err, re.M)


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
def test_a_bad_interval_is_one_line(value, monkeypatch):
    monkeypatch.setenv("TESTBED_HEARTBEAT_S", value)
    with pytest.raises(UsageError, match=rf"^TESTBED_HEARTBEAT_S='{value}' is not accepted; accepted: a number of "
                                         r"seconds > 0$"):
        interval()
    monkeypatch.delenv("TESTBED_HEARTBEAT_S")
    assert 0 < interval() < 30  # a line within the 30 s a log may stay silent


def test_the_time_left_is_weighted_by_the_work_of_the_steps(monkeypatch):
    """GDN's oracle cases run from 1 to 300 tokens: after two small steps the time left is the big step's
    work at the pace of the work done, not one step at the pace of the steps done (issue 34)."""
    import io

    from testbed import cli
    from testbed.heartbeat import Step, steps

    clock = iter([0.0, 0.0, 10.0, 20.0])  # ProgressLine's start, then the three steps' announcements
    monkeypatch.setattr(cli.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    line = cli.ProgressLine(out)
    said = steps(["gdn oracle 1/3 T=1", "gdn oracle 2/3 T=1", "gdn oracle 3/3 T=300"], [1, 1, 300])
    assert isinstance(said[2], Step) and (said[2].done, said[2].total) == (2, 302)
    for step in said:
        line(step)
    last = out.getvalue().splitlines()[-1]
    # by steps: 20 s for 2 steps, 1 to go, "about 10 s left"; by work: 20 s for 2 of 302, "about 50 min left"
    assert last == "[20 s] gdn oracle 3/3 T=300 (about 50 min left)", last
