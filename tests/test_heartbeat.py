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


class Lines:
    """A stream a ProgressLine writes to: its lines, and an event when one matching `wanted` has been
    written `times` times (what a test waits for instead of a timer)."""

    def __init__(self, wanted: str = r"\[\d+ s\] still ", times: int = 3):
        self.text, self.wanted, self.times = "", re.compile(wanted), times
        self.seen = threading.Event()

    def write(self, text):
        self.text += text
        if len([line for line in self.lines() if self.wanted.match(line)]) >= self.times:
            self.seen.set()

    def flush(self):
        pass

    def isatty(self):
        return False

    def lines(self) -> list[str]:
        return self.text.splitlines()


def announce(monkeypatch, times: list[float], messages) -> list[str]:
    """What a ProgressLine prints for `messages` announced at `times` (its clock starting at 0)."""
    from testbed import heartbeat

    clock = iter([0.0, *times])
    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: next(clock))
    out = Lines()
    line = heartbeat.ProgressLine(out, every=3600)
    for msg in messages:
        line(msg)
    line.close()
    return out.lines()


def test_the_time_left_fits_a_cost_per_step_and_per_unit_of_work(monkeypatch):
    """GDN's oracle cases run from 1 to 300 tokens, each with a fixed cost (a program started) beside its
    work: steps of 1 and 100 units took 1 s and 10 s, so a step costs 0.91 s plus 0.091 s a unit, and the
    300-unit step left about 0.91 + 27.3 = 28 s (by steps alone: 5.5 s; by work alone: 33 s)."""
    from testbed.heartbeat import steps

    said = steps(["gdn oracle 1/3 T=1", "gdn oracle 2/3 T=100", "gdn oracle 3/3 T=300"], [1, 100, 300])
    lines = announce(monkeypatch, [0.0, 1.0, 11.0], said)
    assert lines == ["[0 s] gdn oracle 1/3 T=1", "[1 s] gdn oracle 2/3 T=100",
                     "[11 s] gdn oracle 3/3 T=300 (about 28 s left)"], lines


def test_no_time_is_promised_that_the_work_done_cannot_support(monkeypatch):
    """Before two steps are done there is no pace; and two steps of 1 unit say nothing of how a step of
    300 costs (a fixed cost would give 10 s, a cost per unit 50 min): no estimate, where an earlier
    version promised '50 min'. Steps all of one size are paced by the steps (plain counted messages)."""
    from testbed.heartbeat import steps

    said = steps(["gdn oracle 1/3 T=1", "gdn oracle 2/3 T=1", "gdn oracle 3/3 T=300"], [1, 1, 300])
    assert announce(monkeypatch, [0.0, 10.0, 20.0], said)[-1] == "[20 s] gdn oracle 3/3 T=300"
    plain = announce(monkeypatch, [0.0, 10.0, 20.0, 30.0], ["case 1/6", "case 2/6", "case 3/6", "case 4/6"])
    assert plain == ["[0 s] case 1/6", "[10 s] case 2/6", "[20 s] case 3/6 (about 40 s left)",
                     "[30 s] case 4/6 (about 30 s left)"], plain


def test_a_slow_silent_step_is_said_still_running_and_ticks_say_how_far_it_is(monkeypatch):
    """A step that says nothing for longer than the interval (here the test's own 0.05 s, as
    TESTBED_HEARTBEAT_S sets it; 25 s by default) gets "still STEP (N s)" lines until it ends; a Tick
    inside it (a bench's call 3/10) prints no line of its own but is what the next heartbeat says."""
    from testbed.heartbeat import ProgressLine, Tick

    monkeypatch.setenv("TESTBED_HEARTBEAT_S", "0.05")
    out = Lines(times=2)
    line = ProgressLine(out)
    line("building testbed's programs for hexagon")
    assert out.seen.wait(600), out.lines()  # the fake build: silent until two heartbeats are out
    out.seen.clear()
    out.times = 4
    line(Tick("tail bench: call 3/10"))
    assert out.seen.wait(600), out.lines()
    line.close()
    lines = [re.sub(r"^\[\d+ s\] ", "", text) for text in out.lines()]
    assert lines[0] == "building testbed's programs for hexagon"
    assert all(re.fullmatch(r"still building testbed's programs for hexagon \(\d+ s\)", x) for x in lines[1:3]), lines
    assert all(re.fullmatch(r"still tail bench: call 3/10 \(\d+ s\)", x) for x in lines[3:]), lines
    assert len(lines) >= 5 and not any(t.name == "progress heartbeat" for t in threading.enumerate())


def test_a_run_says_each_verdict_the_moment_it_is_decided_and_a_stopped_run_keeps_them(results_dir, monkeypatch):
    """`run hybrid` decides its oracles in seconds, then benches for minutes: each verdict is a line of
    its own (engine and device named) as soon as it is stored, before the bench; the bench's silence gets
    heartbeats; stopped there (Ctrl-C), the run says the verdicts it had reached."""
    from testbed import config, runner
    from testbed.heartbeat import ProgressLine
    from testbed.results import Record

    monkeypatch.setenv("TESTBED_HEARTBEAT_S", "0.05")
    out = Lines(times=2)
    rc = config.load(["backend=refimpl"], experiment="gdn")

    def produce(cfg, ctx):
        yield Record("gdn", "T=64/chunkwise", "oracle", "nmse", "pass", 0.8660254037844386, {})
        yield Record("gdn", "T=65/chunkwise", "oracle", "nmse", "fail", -0.5, {},
                     detail="NMSE 3e-3\nover the threshold 1e-7")
        ctx.progress("hybrid crossover 1/4 L=64")  # the long bench after the verdicts: silent until stopped
        assert out.seen.wait(600), out.lines()
        raise runner.Interrupted(2)

    progress = ProgressLine(out)
    with pytest.raises(runner.Interrupted):
        runner.execute(rc, progress=progress, produce=produce)
    progress.close()
    lines = [re.sub(r"^\[\d+ s\] ", "", text) for text in out.lines()]
    assert lines.pop(0) == "gdn on host (refimpl): starting"
    assert lines[:3] == ["PASS gdn T=64/chunkwise nmse on host (refimpl), margin 0.866",
                         "FAIL gdn T=65/chunkwise nmse on host (refimpl), margin -0.5: NMSE 3e-3 over the "
                         "threshold 1e-7",
                         "hybrid crossover 1/4 L=64"], lines
    assert all(re.fullmatch(r"still hybrid crossover 1/4 L=64 \(\d+ s\)", x) for x in lines[3:]) and len(lines) >= 5
    assert "(what it measured is kept; its verdicts so far: 1 pass, 1 fail)" in runner.stored_so_far()


def test_on_a_terminal_the_step_is_rewritten_and_a_verdict_stays_above_it():
    from testbed.heartbeat import Lasting, ProgressLine

    class Terminal(Lines):
        def isatty(self):
            return True

    out = Terminal()
    line = ProgressLine(out, every=3600)
    line("hybrid oracle 1/6 serial P=0 n=64")
    line(Lasting("PASS hybrid P=0,n=64,C=64/serial token on qemu-aarch64 (native), margin 0.4589"))
    line.close()
    assert out.text == ("\r\033[Khybrid oracle 1/6 serial P=0 n=64"
                        "\r\033[KPASS hybrid P=0,n=64,C=64/serial token on qemu-aarch64 (native), margin 0.4589\n"
                        "\r\033[Khybrid oracle 1/6 serial P=0 n=64\r\033[K")


def test_a_build_deep_in_a_backend_says_itself_through_the_running_command():
    """A build starts where no progress is handed (testbed.backends.native.build): `say` reaches the run's
    progress inside `saying`, so a heartbeat names the build, and nothing outside a run."""
    from testbed.heartbeat import say, saying

    heard = []
    say("building testbed's programs for hexagon")  # no run: nobody to tell
    with saying(heard.append):
        say("building testbed's programs for hexagon")
    say("after the run")
    assert heard == ["building testbed's programs for hexagon"]
