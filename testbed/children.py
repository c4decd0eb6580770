"""Every program testbed starts, and how none of them outlives it.

An engine, a device program, a build step, an emulator, a loopback peer: each is started here (`run`
for one that testbed waits for, `start` for one that lives beside it) as the leader of a session of
its own (setsid), so that a signal meant for testbed's terminal or process group never half-reaches
it, and so that testbed can end it whole: every process of that session, whatever process groups they
made inside it (GNU `timeout` and a shell's jobs each make one). testbed ends it on every way out:

  * the program returned: what it left running in its process group is killed (`run`);
  * a timeout, a stop (testbed.stop: SIGINT, SIGTERM, SIGHUP, in any thread) or any exception while
    testbed waits for it: its session is killed, then the exception goes on;
  * testbed's interpreter exits (a command's end, the SystemExit after a signal): every session still
    running is killed (atexit), and the warden then kills whatever else testbed's children left;
  * testbed dies without running any of that (SIGKILL, a CI timeout killing testbed's process group, a
    crash in C code): the warden kills it all.

The warden (testbed/_warden.py) is a small process of testbed's own, one per testbed process, started
with the first child in a session of its own, so that whatever kills testbed's group leaves it to do
its job. It reads a pipe whose writing end only testbed holds: testbed writes "+SID" there for each
child as it starts it and "-SID" once it has ended that session. When the pipe reaches its end, testbed
is gone, however it went: the warden kills every session still listed and every process that carries
testbed's mark, an environment variable (_warden.MARK_VARIABLE) every child is started with and every
descendant inherits: so the one started in the instant between its start and its announcement, and the
one that left its session (a daemon), die too. A program that empties its environment and leaves its
session is beyond it. A child that is testbed again (a build command `python -m testbed...`, the
loopback adbd) adds its own mark to its parent's and has its own warden, so the chain holds through any
depth; a warden carries no mark, so that none kills another before it has done its job.

A session's id is its leader's process id, which the kernel does not hand out again while any process
of the session lives, and otherwise only after going through every other id (pid_max): a session is
killed before it is announced gone, never after its id could have been given to someone else.

Under the test suite's in-process network guard (testbed.netguard), a program that is not Python is
beyond the guard's sight: `start` names it to the guard (netguard.unpoliced), which the test session
reports, unless the session runs in scripts/offline.sh's network namespace, where the kernel polices
every program.
"""

from __future__ import annotations

import atexit
import math
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time

from testbed import _warden, netguard, stop

_lock = threading.Lock()
_running: dict[int, subprocess.Popen] = {}  # session id (its leader's process id) -> its leader
_warden_proc: subprocess.Popen | None = None
_warden_fd: int | None = None  # the pipe's writing end (close-on-exec: no program inherits it)
MARK = f"{os.getpid()}-{secrets.token_hex(8)}"  # this process's mark on its children's environment


def _ensure_warden() -> None:
    """The warden started (or started again, if something ended it). Under _lock."""
    global _warden_proc, _warden_fd
    if _warden_proc is not None and _warden_proc.poll() is None:
        return
    if _warden_fd is not None:
        os.close(_warden_fd)
    read, write = os.pipe()
    unmarked = {k: v for k, v in os.environ.items() if k != _warden.MARK_VARIABLE}  # no warden kills another
    try:
        _warden_proc = subprocess.Popen([sys.executable, "-I", "-S", _warden.__file__, MARK], stdin=read,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/",
                                        start_new_session=True, env=unmarked)
    finally:
        os.close(read)
    _warden_fd = write


def _tell_warden(line: bytes) -> None:
    try:
        os.write(_warden_fd, line)
    except (OSError, TypeError):  # the warden is gone (someone killed it): it is started again with the next child
        pass


def start(argv, **popen) -> subprocess.Popen:
    """subprocess.Popen(argv, **popen) as the leader of a session of its own, with testbed's mark in its
    environment, announced to the warden; stdin is /dev/null unless given (a child never reads
    testbed's terminal). End it with `end` (or `returned`, once it has)."""
    for key in ("start_new_session", "process_group"):
        if key in popen:
            raise TypeError(f"children.start sets {key} itself")
    popen.setdefault("stdin", subprocess.DEVNULL)
    env = os.environ if popen.get("env") is None else popen["env"]
    # the marks of every testbed above this one too (a testbed started by testbed), even in an environment
    # made from scratch (the loopback adbd's shell): each of their wardens finds this child
    above = [m for e in (os.environ, env) for m in e.get(_warden.MARK_VARIABLE, "").split(":") if m]
    popen["env"] = {**env, _warden.MARK_VARIABLE: ":".join(dict.fromkeys([*above, MARK]))}
    netguard.unpoliced(argv, popen.get("cwd"))
    with _lock:
        _ensure_warden()
        proc = subprocess.Popen(argv, start_new_session=True, **popen)
        _running[proc.pid] = proc
        _tell_warden(b"+%d\n" % proc.pid)
    return proc


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL every process of `proc`'s session: the program and all it started, whatever groups they
    made. From any thread; nothing is reaped (`end` does that)."""
    with _lock:
        if _running.get(proc.pid) is not proc:
            return  # ended already: its id may belong to someone else by now
    _warden.kill_session(proc.pid)


def end(proc: subprocess.Popen, grace_s: float = 0.0) -> int | None:
    """End `proc`'s session: with `grace_s`, SIGTERM to its leader and up to that long for it to stop the
    rest its own way (a server that drains); then `kill`. Reap the leader and tell the warden. Safe to
    call twice, from any thread. Its exit status."""
    with _lock:
        known = _running.get(proc.pid) is proc
    if not known:
        return proc.poll()
    try:
        if grace_s > 0 and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        kill(proc)
        proc.wait()  # its pipes are left to whoever reads them (closing one under a reading thread is unsafe)
    finally:
        _forget(proc)
    return proc.returncode


def returned(proc: subprocess.Popen) -> int:
    """`proc` returned (or is about to): what it left running in its process group (a shell's background
    jobs) is killed, it is reaped, and the warden told. Cheaper than `end`, which looks through every
    process for the rest of its session; what it left in another group of its session goes when testbed
    does (the warden: those carry testbed's mark)."""
    try:
        proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    finally:
        _forget(proc)
    return proc.returncode


def _forget(proc: subprocess.Popen) -> None:
    with _lock:
        if _running.get(proc.pid) is proc:
            del _running[proc.pid]
            _tell_warden(b"-%d\n" % proc.pid)


def run(argv, *, input=None, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        **popen) -> subprocess.CompletedProcess:
    """subprocess.run's call and answer, for a program started by `start`. Once it returns, what it left
    running in its process group is killed (a leftover holding its output would otherwise keep testbed
    waiting). Past `timeout` (seconds) its session is killed and subprocess.TimeoutExpired raised; a stop
    (testbed.stop) kills it within stop.POLL_S, in any thread, and raises Interrupted."""
    if capture_output:
        popen["stdout"] = popen["stderr"] = subprocess.PIPE
    if input is not None:
        popen["stdin"] = subprocess.PIPE
    proc = start(argv, **popen)
    deadline = time.monotonic() + (math.inf if timeout is None else timeout)
    try:
        while True:
            stop.raise_if_stopped()
            try:  # the input goes with the first call; Popen keeps what is left of it for the next
                out, err = proc.communicate(input, timeout=max(0.0, min(stop.POLL_S, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired as e:
                input = None
                if time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(proc.args, timeout, output=e.output, stderr=e.stderr) from None
                if proc.poll() is not None:  # it returned; what it left behind still holds its output
                    kill(proc)
    except BaseException:
        end(proc)  # all of it, on the way out of a timeout, a stop or an exception
        raise
    returned(proc)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def lines(proc: subprocess.Popen):
    """The lines `proc` writes to its stdout (a binary pipe), decoded, as they come; a stop (testbed.stop)
    raises Interrupted within stop.POLL_S even while it writes nothing. The caller ends it (`end`)."""
    fd, pending = proc.stdout.fileno(), b""
    while True:
        stop.raise_if_stopped()
        if not select.select([fd], [], [], stop.POLL_S)[0]:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        *complete, pending = (pending + chunk).split(b"\n")
        for line in complete:
            yield line.decode(errors="replace") + "\n"
    if pending:
        yield pending.decode(errors="replace")


def running() -> list[int]:
    """The sessions this process started and has not ended yet (their ids)."""
    with _lock:
        return sorted(_running)


def end_all() -> None:
    """At the interpreter's exit: end every session still running, then let the warden go (the end of its
    pipe) and wait for it, so that what testbed's children left behind (their mark says so) is gone when
    testbed is. If testbed cannot get here, the warden does the same without it."""
    global _warden_proc, _warden_fd
    with _lock:
        procs = list(_running.values())
    for proc in procs:
        try:
            end(proc)
        except Exception:  # noqa: BLE001 -- at exit, the next session matters more than why one failed
            pass
    with _lock:
        if _warden_fd is not None:
            os.close(_warden_fd)
            try:
                _warden_proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        _warden_proc = _warden_fd = None


atexit.register(end_all)
