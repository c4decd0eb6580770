"""Stopping on a signal: what every long wait checks, so SIGINT, SIGTERM and SIGHUP stop testbed
within about a second wherever it is waiting.

testbed.runner installs the handlers (`stop_on_signals`): a signal sets STOP and, in the main thread,
raises `Interrupted` at once, except while a record is being stored. Work in other threads (testbed
nightly's one worker per device) cannot be interrupted that way, so every long wait checks STOP
itself and raises `Interrupted` there:

  * a repetition loop (testbed.measure.timing: between any two timed calls);
  * a command on a device (testbed.devices.local: the program is waited for POLL_S at a time and its
    process group killed on a stop; testbed.devices.ssh: the channel is closed);
  * testbed nightly's main thread waits for its workers at most GRACE_S after a stop, then leaves
    the ones still inside one long call behind (daemon threads: the process exits without them; the
    run they were in reads back as never ended, never as passed).

This module imports nothing of testbed's, so the transports can use it without importing the runner.
"""

from __future__ import annotations

import signal
import subprocess
import threading

POLL_S = 0.1  # how often a wait for a device command looks at STOP
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


def communicate(proc: subprocess.Popen, timeout: float, kill) -> tuple[str, str]:
    """proc.communicate(timeout), looking at STOP every POLL_S: on a stop, `kill()` then Interrupted.
    Raises subprocess.TimeoutExpired past `timeout` (the caller kills). Any exception on the way (a
    signal's Interrupted raised in this thread included) kills the process first: nothing is left
    running on a stopped run's behalf."""
    import time

    deadline = time.monotonic() + timeout
    try:
        while True:
            raise_if_stopped()
            left = deadline - time.monotonic()
            try:
                return proc.communicate(timeout=max(0.0, min(POLL_S, left)))
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    raise
    except subprocess.TimeoutExpired:
        raise
    except BaseException:
        kill()
        raise
