"""Progress that says how long is left, and heartbeats: a line at least every HEARTBEAT_S seconds while a long step runs without a word of its own
(a compiler that prints nothing for minutes, a device that takes a minute to start), so that a log
shows the command is alive and what it is waiting for.

    with heartbeat("compiling gdn for aarch64", progress):
        subprocess.run(...)

says "still compiling gdn for aarch64 (25 s)" through `progress` (a run's progress line: one line each
off a terminal, rewritten in place on one) every interval from a timer thread, until the step ends.
TESTBED_HEARTBEAT_S sets the interval (a test's short one; the default keeps a line within 30 s).

A counted step ("gdn oracle 12/36 CASE") may also say how much work its series holds (`Step`): where
steps differ in size (GDN's cases run from 1 to 300 tokens, a hybrid oracle from 64 to 600 positions)
the time left is then the work left at the pace of the work done, not the steps left at the pace of
the steps done.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from testbed.errors import UsageError

HEARTBEAT_ENV = "TESTBED_HEARTBEAT_S"
HEARTBEAT_S = 25.0


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
