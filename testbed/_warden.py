"""The warden of testbed's children (testbed.children), and how a session is killed.

Run as `python -I -S _warden.py MARK`, its input a pipe whose writing end only testbed holds, it reads
"+SID" and "-SID" lines (a session a child of testbed's leads; one testbed has ended) until the pipe's
end, which comes when testbed is gone, however it went. Then it kills every process of a session still
listed, and every process whose environment carries testbed's mark (MARK_VARIABLE=...:MARK: every
descendant of testbed's children inherits it, the one that left its session included), until none is
left; then it exits. Standard library only, and no import of testbed's: it must do its job whatever
state testbed's package or environment is in. Linux: it reads /proc.
"""

import os
import signal
import sys

MARK_VARIABLE = "TESTBED_WARDEN"


def _processes():
    """(pid, its session, where its environment is read) of every live process, by /proc: a stat line is
    "PID (NAME) STATE PPID PGRP SESSION ...", and a name may hold anything, so its fields are read after
    the last ")"; zombies are dead already."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) < 4 or fields[0] in (b"Z", b"X"):
            continue
        yield int(name), int(fields[3]), f"/proc/{name}/environ"


def _environ(path: str) -> bytes:
    """A process's environment (NAME=VALUE entries, NUL-separated); b"" where it is not readable (another
    user's process, one just gone)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def kill_until_none(chosen) -> None:
    """SIGKILL every process `chosen(pid, session, environ_path)` picks, again until none is left (one
    may fork while the others die). Without /proc (not Linux) nothing is found."""
    if not os.path.isdir("/proc/self"):
        return
    me = os.getpid()
    for _ in range(100):
        found = [pid for pid, session, environ in _processes() if pid != me and chosen(pid, session, environ)]
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def kill_session(sid: int) -> None:
    """Every process of session `sid`: the leader's own process group and the groups made inside it."""
    try:
        os.killpg(sid, signal.SIGKILL)  # most of it at once (and all of it where there is no /proc)
    except OSError:
        pass
    kill_until_none(lambda pid, session, environ: session == sid)


def watch(lines, mark: str) -> None:
    sessions = set()
    for line in lines:
        try:
            sid = int(line[1:])
        except ValueError:
            continue
        if sid > 1:
            (sessions.add if line[:1] == b"+" else sessions.discard)(sid)
    kill_until_none(lambda pid, session, environ: session in sessions or mark in marks(_environ(environ)))


def marks(environ: bytes) -> list[str]:
    """The marks in a process's environment (MARK_VARIABLE=MARK:MARK...: one per testbed above it)."""
    for entry in environ.split(b"\0"):
        if entry.startswith(MARK_VARIABLE.encode() + b"="):
            return entry.split(b"=", 1)[1].decode(errors="replace").split(":")
    return []


if __name__ == "__main__":
    watch(sys.stdin.buffer, sys.argv[1])
