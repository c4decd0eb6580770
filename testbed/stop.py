"""Stopping on a signal: what every long wait checks, so SIGINT, SIGTERM and SIGHUP stop testbed
within about a second wherever it is waiting.

testbed.runner installs the handlers (`stop_on_signals`): a signal sets STOP and, in the main thread,
raises `Interrupted` at once, except while a record is being stored. Work in other threads (testbed
nightly's one worker per device) cannot be interrupted that way, so every long wait checks STOP
itself and raises `Interrupted` there:

  * a repetition loop (testbed.measure.timing: between any two timed calls);
  * a program testbed started (testbed.children: waited for POLL_S at a time, its session killed on a
    stop), a command on a remote device (testbed.devices.ssh: the channel is closed);
  * testbed nightly's main thread waits for its workers at most GRACE_S after a stop, then leaves
    the ones still inside one long call behind (daemon threads: the process exits without them; the
    run they were in reads back as never ended, never as passed).

This module imports nothing of testbed's, so the transports can use it without importing the runner.
"""

from __future__ import annotations

import signal
import threading

POLL_S = 0.1  # how often a wait for a program testbed started looks at STOP
GRACE_S = 1.5  # how long a stopped nightly waits for its workers to store the error record of their run


class Interrupted(BaseException):
    """A signal asked testbed to stop (SIGINT, SIGTERM, SIGHUP). A BaseException, as KeyboardInterrupt:
    no `except Exception` on the way may swallow it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


# Set when a signal arrives (testbed.runner.stop_on_signals), with the signal's number.
STOP = threading.Event()
STOP_SIGNAL: list[int] = []


def raise_if_stopped() -> None:
    if STOP.is_set():
        raise Interrupted(STOP_SIGNAL[0] if STOP_SIGNAL else signal.SIGTERM)
