"""Progress a reader can trust: what a command is doing, how long it has to go where that can be
estimated, the verdicts the moment they are decided, and a line at least every HEARTBEAT_S seconds
while a step runs without a word of its own (a compiler that prints nothing for minutes, a bench, a
device that takes a minute to start), so that a log shows the command is alive and what it waits for.

`ProgressLine` is a command's progress on stderr (run, sweep, ab). Messages are plain strings, or:

  Step     a counted step ("gdn oracle 12/36 CASE") that also says how much work its series holds
           (GDN's cases run from 1 to 300 tokens)
  Tick     progress inside a step ("repetition 4/10"): it updates what the next heartbeat says, and
           the terminal's line, without a log line of its own
  Lasting  a line that stays, also on a terminal: an oracle's verdict the moment it is decided

Off a terminal (a pipe, a CI log, nohup) each message is a line "[N s] MESSAGE"; on one, the step's
line is rewritten in place and a Lasting line is printed above it. Whenever nothing has been said for
the interval (TESTBED_HEARTBEAT_S, default HEARTBEAT_S), a timer thread says "still STEP (N s)".

Time left, "(about N s left)", is said only where the work done so far supports it: a counted
series' completed steps are fitted as a fixed cost per step plus a cost per unit of work (least
squares, neither negative), and the rest of the series is that fit applied to the work left. Before
two steps have completed, or where the steps done were all of one size and the ones left are not
(nothing tells how their cost grows), no time is promised. A heartbeat carries the estimate made at
its step's start, less the time since, while it lasts.

    with heartbeat("compiling gdn for aarch64", progress):
        subprocess.run(...)

is the same for a caller without a ProgressLine: "still compiling gdn for aarch64 (25 s)" through
`progress` every interval until the step ends.

Code deep below a run that is handed no progress (a build a backend starts when it first needs a
program) says what it starts with `say(...)`: the running command's progress (`saying`, which
testbed.runner holds around a run), or nothing outside one; so a heartbeat names the build it waits
for, not the step before it.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

import numpy as np

from testbed.errors import UsageError
from testbed.report.tables import printable

HEARTBEAT_ENV = "TESTBED_HEARTBEAT_S"
HEARTBEAT_S = 25.0
LINE_WIDTH = 120  # a terminal's progress line is cut to this (testbed.report.tables.WIDTH)


def interval() -> float:
    """The seconds between two heartbeats: TESTBED_HEARTBEAT_S, else HEARTBEAT_S."""
    value = os.environ.get(HEARTBEAT_ENV)
    if not value:
        return HEARTBEAT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise UsageError(f"{HEARTBEAT_ENV}={value!r} is not accepted; accepted: a number of seconds > 0")
    return seconds


@contextmanager
def heartbeat(step: str, say: Callable[[str], None], every: float | None = None) -> Iterator[None]:
    """While the block runs, `say("still STEP (N s)")` every `every` seconds (default: interval())."""
    every = every or interval()
    began, done = time.monotonic(), threading.Event()

    def beat():
        while not done.wait(every):
            say(f"still {step} ({time.monotonic() - began:.0f} s)")

    beating = threading.Thread(target=beat, name=f"heartbeat: {step}", daemon=True)
    beating.start()
    try:
        yield
    finally:
        done.set()
        beating.join()


_SAY: ContextVar[Callable[[str], None] | None] = ContextVar("testbed progress", default=None)


@contextmanager
def saying(progress: Callable[[str], None]) -> Iterator[None]:
    """Within the block (in this thread), `say` speaks through `progress`."""
    token = _SAY.set(progress)
    try:
        yield
    finally:
        _SAY.reset(token)


def say(msg: str) -> None:
    """A step starting, through the running command's progress (`saying`); nothing outside a run."""
    progress = _SAY.get()
    if progress is not None:
        progress(msg)


class Step(str):
    """A counted step's progress message that also carries the work of its series: `done`, the work of
    the steps before it, of `total`, in any one unit (a GDN case: tokens x heads x head size^2). To any
    other reader of progress it is the plain message."""

    done: float
    total: float

    def __new__(cls, text: str, done: float, total: float) -> "Step":
        step = super().__new__(cls, text)
        step.done, step.total = float(done), float(total)
        return step


def steps(texts: list[str], sizes: list[float]) -> list[Step]:
    """Each of a series' messages as a Step weighted by its step's size."""
    total, before, out = float(sum(sizes)), 0.0, []
    for text, size in zip(texts, sizes):
        out.append(Step(text, before, total))
        before += size
    return out


class Tick(str):
    """Progress inside a step ("tail bench: repetition 4/10"): what the next heartbeat says, with the
    time left of its series; no log line of its own (a bench's repetitions would flood a log)."""


class Lasting(str):
    """A line that stays on a terminal too: an oracle's verdict as it is decided."""


def about(seconds: float | None) -> str:
    """" (about N s left)", " (about N min left)"; nothing where no estimate is given."""
    if seconds is None:
        return ""
    return f" (about {seconds / 60:.0f} min left)" if seconds >= 120 else f" (about {max(seconds, 1):.0f} s left)"


def time_left(elapsed: float, done: int, total: int) -> str:
    """" (about N s left)" for `total` like units of work of which `done` took `elapsed` seconds: the
    rest at the mean pace of those done; nothing before two are done (one unit's time, often a cold
    build's, is no pace)."""
    return about(elapsed / done * (total - done)) if done >= 2 else ""


def fit_cost(durations: list[float], sizes: list[float]) -> tuple[float, float] | None:
    """(cost per step, cost per unit of work) fitted to completed steps by least squares, neither
    negative; None before two steps are done. Steps all of one size give a cost per step alone."""
    if len(durations) < 2:
        return None
    d, w = np.asarray(durations, float), np.asarray(sizes, float)
    if np.ptp(w) == 0:
        return float(d.mean()), 0.0
    (a, b), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(w), w]), d, rcond=None)
    if a < 0:
        return 0.0, float(d.sum() / w.sum())
    if b < 0:
        return float(d.mean()), 0.0
    return float(a), float(b)


class _Series:
    """A counted series' announcements: when each step began and the work before it."""

    def __init__(self):
        self.began: list[float] = []
        self.work: list[float] = []

    def left(self, now: float, step: int, total: int, msg: str) -> float | None:
        """Seconds left for the steps from this one (announced now) to the last, or None."""
        done_before = msg.done if isinstance(msg, Step) else float(step - 1)
        total_work = msg.total if isinstance(msg, Step) else float(total)
        self.began.append(now)
        self.work.append(done_before)
        durations = list(np.diff(self.began))
        sizes = list(np.diff(self.work))
        fit = fit_cost(durations, sizes)
        if fit is None:
            return None
        steps_left, work_left = total - step + 1, total_work - done_before
        if np.ptp(sizes) == 0 and abs(work_left - steps_left * sizes[0]) > 1e-9 * max(work_left, 1.0):
            return None  # the steps left are of other sizes than any done: nothing tells their cost
        per_step, per_work = fit
        return per_step * steps_left + per_work * work_left


class ProgressLine:
    """A command's progress messages on stderr (the module's docstring says how they read)."""

    COUNT = re.compile(r"\b(\d+)/(\d+)\b")

    def __init__(self, stream=None, every: float | None = None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = every or interval()
        self.began = time.monotonic()
        self.lock = threading.RLock()
        self.series: dict[tuple[str, int], tuple[int, _Series]] = {}  # (text before the count, total) -> last step
        self.step: tuple[str, float, float | None] | None = None  # what runs now: text, since, expected end
        self.said = self.began  # when the last line was written
        self.stopped = threading.Event()
        self.watch: threading.Thread | None = None

    def __call__(self, msg: str) -> None:
        now = time.monotonic()
        with self.lock:
            if isinstance(msg, Lasting):
                self._write(str(msg), now, lasting=True)
                if self.tty and self.step:  # the step's line again, under the lasting one
                    self._write(self.step[0], now)
                return
            left = self._left(msg, now)
            if isinstance(msg, Tick) and self.step is not None:
                began = self.step[1]  # a tick is inside the step: the step's time runs on
            else:
                began = now
            self.step = (str(msg), began, None if left is None else now + left)
            if self.tty or not isinstance(msg, Tick):
                self._write(str(msg) + about(left), now)
            self._watch()

    def _left(self, msg: str, now: float) -> float | None:
        count = self.COUNT.search(msg)
        if not count:
            return None
        step, total = int(count[1]), int(count[2])
        key = (msg[:count.start()], total)
        last, series = self.series.get(key, (None, None))
        if series is None or step <= last:
            series = _Series()
        self.series[key] = (step, series)
        return series.left(now, step, total, msg)

    def _write(self, text: str, now: float, lasting: bool = False) -> None:
        """One line of at most LINE_WIDTH columns (the records and the summary keep what is cut)."""
        text = printable(text)  # a case's name, a build tool's or an engine's line: never a control sequence
        line = text if self.tty else f"[{now - self.began:.0f} s] {text}"
        line = line if len(line) <= LINE_WIDTH else line[:LINE_WIDTH - 3] + "..."
        self.stream.write(("\r\033[K" + line + ("\n" if lasting else "")) if self.tty else line + "\n")
        self.stream.flush()
        self.said = now

    def _watch(self) -> None:
        if self.watch is None:
            self.watch = threading.Thread(target=self._beat, name="progress heartbeat", daemon=True)
            self.watch.start()

    def _beat(self) -> None:
        # wake often enough that a line follows the last within the interval and a little
        while not self.stopped.wait(self.every / 5):
            with self.lock:
                now = time.monotonic()
                if self.step is None or now - self.said < self.every:
                    continue
                text, began, end = self.step
                left = about(end - now) if end is not None and end > now else ""
                self._write(f"still {text} ({now - began:.0f} s){left}", now)

    def close(self) -> None:
        """Stop the heartbeat and clear a terminal's line (before the command prints its results)."""
        self.stopped.set()
        if self.watch is not None:
            self.watch.join()
            self.watch = None
        self.stopped.clear()
        with self.lock:
            self.step = None
            if self.tty:
                self.stream.write("\r\033[K")
                self.stream.flush()

    clear = close
