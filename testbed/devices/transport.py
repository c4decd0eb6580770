"""The transport interface, and what every remote POSIX device shares.

A transport does four things: push a file, pull a file, run a command with a timeout (exit code,
stdout, stderr), and clean up its work folder. Paths given to push and pull are relative to the work
folder and may not leave it: lexically (confine: no absolute path, no ..), and on the device itself,
where a symlink may point anywhere, so the path is resolved there and checked before every push, pull
and cwd (OutsideWorkFolder). Commands run in it. Every command is an argv list, each argument quoted
for the device's shell, so a file name or config value can never inject a command; an argument with a
NUL byte, which no command line can carry, is refused before anything is sent.

Remote devices (ADB, SSH) share the same discipline:
  run       `cd WORK && timeout -s KILL T argv...`: the device kills a hung command itself; if the
            device stops answering, the host gives up at T plus a grace period, drops the
            connection and raises CommandTimeout. A command whose connection closes (the host gave
            up, stopped or died) is killed on the device with all it started (ADB: adbd ends the
            stream's processes; SSH: a watcher beside the command, ssh.WATCHED). A run is never
            retried: it may have had effects, and a benchmark run twice is a different measurement.
  push      send, then check size and sha256 on the device; a mismatch or a lost connection is
            retried (a push is idempotent); a device that refuses (full, read-only) is not.
  pull      sha256 on the device first, then receive into a temporary file, check, rename: a
            corrupted or cut transfer never leaves a file that looks complete.
"""

from __future__ import annotations

import hashlib
import math
import os
import posixpath
import secrets
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from testbed.errors import DeviceError, DeviceUnreachable


@dataclass
class CommandResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float = 0.0


class TransferError(DeviceError):
    """A push or pull that failed or could not be verified."""


class CommandTimeout(DeviceError, TimeoutError):
    """A command that did not finish within its timeout; it was killed."""


class ConnectionLost(Exception):
    """Raised by a transport's primitives when the link to the device broke (internal)."""


class OutsideWorkFolder(DeviceError, ValueError):
    """A path that leaves the work folder: lexically, or through a symlink on the device."""


# The exit statuses `timeout -s KILL` leaves: 124 (GNU when the child exits on the signal) and 137
# (128 + SIGKILL).
KILLED_AT_TIMEOUT = (124, 137)
HOST_GRACE_S = 10.0


NAME_MAX = 255  # bytes in one path component (Linux and Android)


def confine(path: str) -> str:
    """A path inside the work folder, normalised; anything absolute or climbing out is refused, as is
    what no device can name (a NUL byte, a component longer than NAME_MAX bytes)."""
    p = posixpath.normpath(str(path))
    if p.startswith("/") or p == ".." or p.startswith("../") or p in ("", "."):
        raise OutsideWorkFolder(f"path {path!r} is outside the work folder (give a relative path inside it)")
    if "\0" in p:
        raise ValueError(f"path {path!r} contains a NUL byte; accepted: names without one")
    long = [c for c in p.split("/") if len(c.encode()) > NAME_MAX]
    if long:
        raise ValueError(f"path {path!r} has a name of {len(long[0].encode())} bytes; accepted: at most {NAME_MAX}")
    return p


def check_argv(argv: list) -> list[str]:
    """The arguments as strings; refused if one holds a NUL byte (the OS cuts an argument there)."""
    args = [str(a) for a in argv]
    for i, a in enumerate(args):
        if "\0" in a:
            raise ValueError(f"argument {i} ({a!r}) contains a NUL byte, which no command line can carry")
    return args


# Resolves "$2" (a path under the work folder "$1", which may not exist yet) on the device: the
# deepest part that exists, symlinks followed; exit 0 if that is inside the work folder, else print
# where it leads and exit 1. POSIX sh, coreutils or toybox.
RESOLVE_INSIDE = r'''w=$(cd -P -- "$1" && pwd -P) || exit 3
t=$2
while [ ! -e "$t" ] && [ ! -L "$t" ]; do t=$(dirname -- "$t"); done
if [ -L "$t" ]; then r=$(readlink -f -- "$t") || r=""
else r=$(cd -P -- "$(dirname -- "$t")" && printf '%s/%s' "$(pwd -P)" "$(basename -- "$t")") || r=""; fi
case "$r/" in "$w"/*) exit 0 ;; esac
printf '%s' "${r:-an unresolvable symlink}"; exit 1'''


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def quoted(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in check_argv(argv))


class Transport:
    """push / pull / run / cleanup, relative to `work_dir`."""

    kind = "abstract"
    work_dir: str

    def _verified(self, what: str, attempt) -> None:
        """Run one transfer `attempt` up to self.attempts times. The attempt returns None once the
        bytes on the far side verified, else what was wrong; a lost connection is dropped and the
        transfer retried, as is a device that did not answer."""
        problem = ""
        for _ in range(self.attempts):
            try:
                self._ensure()
                problem = attempt()
            except ConnectionLost as e:
                self._drop()
                problem = f"connection lost during the transfer: {e}"
                continue
            except DeviceUnreachable as e:
                problem = str(e)
                continue
            if problem is None:
                return
        raise TransferError(f"{self.name}: {what} failed after {self.attempts} attempts: {problem}")

    def push(self, local: Path, remote: str, mode: int = 0o644) -> None:
        local = Path(local)
        size, digest = local.stat().st_size, sha256_file(local)
        target = self.path(remote)
        parent = posixpath.dirname(target)

        def attempt() -> str | None:
            if parent != self.work_dir:
                self._shell(f"mkdir -p {shlex.quote(parent)}", 30)
            self._send(local, target, mode)
            got = self.remote_digest(remote)
            if got == (size, digest):
                return None
            problem = (f"device has {got[0]} bytes, sha256 {got[1][:12]}..." if got else "file missing on device")
            return problem + f"; sent {size} bytes, sha256 {digest[:12]}..."

        self._verified(f"push of {local.name} to {target}", attempt)

    def pull(self, remote: str, local: Path) -> None:
        local = Path(local)
        source = self.path(remote)
        expected = self.remote_digest(remote)
        if expected is None:
            raise TransferError(f"{self.name}: cannot pull {source}: no such file on the device")
        tmp = local.with_name(f".{local.name}.{secrets.token_hex(4)}.part")

        def attempt() -> str | None:
            self._recv(source, tmp)
            got = (tmp.stat().st_size, sha256_file(tmp)) if tmp.exists() else None
            if got == expected:
                os.replace(tmp, local)
                return None
            problem = (f"received {got[0]} bytes, sha256 {got[1][:12]}..." if got else "nothing received")
            return problem + f"; the device has {expected[0]} bytes, sha256 {expected[1][:12]}..."

        try:
            self._verified(f"pull of {source}", attempt)
        finally:
            tmp.unlink(missing_ok=True)

    def remote_digests(self, remotes: list[str]) -> dict[str, tuple[int, str] | None]:
        """remote_digest of each file (None for one that is absent)."""
        return {remote: self.remote_digest(remote) for remote in remotes}

    def remote_size(self, remote: str) -> int | None:
        """The size of a file in the work folder, read without reading the file (None if absent): what to
        check before pulling, or hashing, a file a program on the device wrote at a size of its choosing."""
        got = self.remote_digest(remote)
        return got[0] if got else None

    def cleanup(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class RemoteShell(Transport):
    """A device reached over a link with a POSIX shell on the far side (toybox or coreutils).

    Subclasses provide the primitives: _open() (connect, raising DeviceUnreachable), _close(),
    _exec(script, host_timeout) -> CommandResult, _send(local, abs_path, mode), _recv(abs_path, local),
    each raising ConnectionLost when the link breaks and TimeoutError when the host deadline passes."""

    attempts = 2  # transfers: the first try and one retry

    def __init__(self, name: str, work_dir: str):
        self.name = name
        self.work_dir = work_dir.rstrip("/") or "/"
        self._connected = False

    # -- primitives -------------------------------------------------------------------------------
    def _open(self) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    def _exec(self, script: str, host_timeout: float) -> CommandResult:
        raise NotImplementedError

    def _send(self, local: Path, path: str, mode: int) -> None:
        raise NotImplementedError

    def _recv(self, path: str, local: Path) -> None:
        raise NotImplementedError

    # -- connection -------------------------------------------------------------------------------
    def connect(self) -> None:
        self._open()
        self._connected = True
        made = self._shell(f"mkdir -p {shlex.quote(self.work_dir)} && test -w {shlex.quote(self.work_dir)}", 30)
        if made.returncode != 0:
            raise DeviceUnreachable(f"{self.name}: cannot create or write the work folder {self.work_dir}: "
                                    f"{(made.stderr or made.stdout).strip() or 'exit ' + str(made.returncode)}")

    def _ensure(self) -> None:
        if not self._connected:
            self._open()
            self._connected = True

    def _drop(self) -> None:
        self._connected = False
        try:
            self._close()
        except Exception:  # noqa: BLE001 -- the link is already broken; closing is best effort
            pass

    def close(self) -> None:
        self._drop()

    def _shell(self, script: str, timeout: float) -> CommandResult:
        """Run a composed shell script (internal: callers quote every value they put in it)."""
        self._ensure()
        try:
            return self._exec(script, timeout + HOST_GRACE_S)
        except ConnectionLost as e:
            self._drop()
            raise DeviceUnreachable(f"{self.name}: connection lost: {e}") from None
        except TimeoutError:
            self._drop()  # closing the link kills the command on the device
            raise CommandTimeout(f"{self.name}: the device stopped answering within {timeout:g} s") from None

    # -- the interface ----------------------------------------------------------------------------
    def path(self, remote: str) -> str:
        return posixpath.join(self.work_dir, confine(remote))

    def inside(self, remote: str) -> str:
        """The absolute path of `remote`, checked on the device not to lead out of the work folder."""
        target = self.path(remote)
        r = self._shell(f"sh -c {shlex.quote(RESOLVE_INSIDE)} sh {quoted([self.work_dir, target])}", 30)
        if r.returncode != 0:
            raise OutsideWorkFolder(f"{self.name}: {remote!r} leads out of the work folder {self.work_dir} "
                                    f"(to {r.stdout.strip() or '?'}: a symlink on the device); refused")
        return target

    def run(self, argv: list[str], timeout: float = 60.0, cwd: str = "") -> CommandResult:
        limit = max(1, math.ceil(timeout))
        folder = self.inside(cwd) if cwd else self.work_dir
        script = f"cd {shlex.quote(folder)} && timeout -s KILL {limit} {quoted(argv)}"
        t0 = time.monotonic()
        try:
            result = self._shell(script, timeout)
        except CommandTimeout:
            raise CommandTimeout(f"{self.name}: {quoted(argv)} did not finish in {timeout:g} s; killed") from None
        except DeviceUnreachable as e:
            raise DeviceUnreachable(f"{e} (while running {quoted(argv)}; not retried)") from None
        result.seconds = time.monotonic() - t0
        if result.returncode in KILLED_AT_TIMEOUT and result.seconds >= limit - 0.5:
            raise CommandTimeout(f"{self.name}: {quoted(argv)} did not finish in {timeout:g} s; killed")
        return result

    def remote_digest(self, remote: str, timeout: float = 120.0) -> tuple[int, str] | None:
        """(size, sha256) of a file in the work folder, computed on the device; None if absent."""
        # sha256sum reads stdin: given a name with a backslash or newline it would escape its output
        r = self.run(["sh", "-c", 'stat -c %s -- "$1" && sha256sum < "$1"', "sh", confine(remote)], timeout)
        lines = r.stdout.split()
        if r.returncode != 0 or len(lines) < 2 or not lines[0].isdigit():
            return None
        return int(lines[0]), lines[1].lower()

    def remote_size(self, remote: str, timeout: float = 60.0) -> int | None:
        r = self.run(["sh", "-c", '[ -f "$1" ] && stat -c %s -- "$1"', "sh", confine(remote)], timeout)
        size = r.stdout.strip()
        return int(size) if r.returncode == 0 and size.isdigit() else None

    def remote_digests(self, remotes: list[str], timeout: float = 120.0) -> dict[str, tuple[int, str] | None]:
        """remote_digest of each file, in one command on the device."""
        script = 'for f do if [ -f "$f" ]; then echo "$(stat -c %s -- "$f") $(sha256sum < "$f")"; else echo -; fi; done'
        r = self.run(["sh", "-c", script, "sh", *map(confine, remotes)], timeout)
        lines = r.stdout.splitlines()
        if r.returncode != 0 or len(lines) != len(remotes):
            return dict.fromkeys(remotes)
        got = {}
        for remote, line in zip(remotes, lines):
            fields = line.split()
            got[remote] = (int(fields[0]), fields[1].lower()) if len(fields) >= 2 and fields[0].isdigit() else None
        return got

    def push(self, local: Path, remote: str, mode: int = 0o644) -> None:
        local = Path(local)
        size, digest = local.stat().st_size, sha256_file(local)
        target = self.path(remote)
        parent = posixpath.dirname(target)
        problem = ""
        for _ in range(self.attempts):
            try:
                self._ensure()
                self.inside(remote)  # each attempt: the device may have changed in between
                if parent != self.work_dir:
                    self._shell(f"mkdir -p {shlex.quote(parent)}", 30)
                self._send(local, target, mode)
                got = self.remote_digest(remote)
            except ConnectionLost as e:
                self._drop()
                problem = f"connection lost during the transfer: {e}"
                continue
            except DeviceUnreachable as e:
                problem = str(e)
                continue
            if got == (size, digest):
                return
            problem = (f"device has {got[0]} bytes, sha256 {got[1][:12]}..." if got else "file missing on device")
            problem += f"; sent {size} bytes, sha256 {digest[:12]}..."
        raise TransferError(f"{self.name}: push of {local.name} to {target} failed after "
                            f"{self.attempts} attempts: {problem}")

    def pull(self, remote: str, local: Path) -> None:
        local = Path(local)
        source = self.inside(remote)
        expected = self.remote_digest(remote)
        if expected is None:
            raise TransferError(f"{self.name}: cannot pull {source}: no such file on the device")
        tmp = local.with_name(f".{local.name}.{secrets.token_hex(4)}.part")
        problem = ""
        try:
            for _ in range(self.attempts):
                try:
                    self._ensure()
                    self._recv(source, tmp)
                except ConnectionLost as e:
                    self._drop()
                    problem = f"connection lost during the transfer: {e}"
                    continue
                except DeviceUnreachable as e:
                    problem = str(e)
                    continue
                got = (tmp.stat().st_size, sha256_file(tmp)) if tmp.exists() else None
                if got == expected:
                    os.replace(tmp, local)
                    return
                problem = (f"received {got[0]} bytes, sha256 {got[1][:12]}..." if got else "nothing received")
                problem += f"; the device has {expected[0]} bytes, sha256 {expected[1][:12]}..."
            raise TransferError(f"{self.name}: pull of {source} failed after {self.attempts} attempts: {problem}")
        finally:
            tmp.unlink(missing_ok=True)

    def cleanup(self) -> None:
        """Empty the work folder (the folder itself stays, so later runs can write)."""
        self._shell(f"cd {shlex.quote(self.work_dir)} && rm -rf -- ./* ./.[!.]* 2>/dev/null; true", 60)


def elf_machine(path: Path) -> int | None:
    """The ELF header's e_machine (40 ARM, 183 AArch64, 164 Hexagon, 62 x86-64), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return None
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    return int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")
