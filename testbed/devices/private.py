"""Per-user private folders in the shared temporary folder, and the per-device lock kept in one.

/tmp is shared by every user of the machine. A predictable path there (a lock folder, the host's work
folder) can be made first by someone else: as a symlink to a file of yours (a lock that truncates it),
or as a world-writable folder (where they can swap files under you). So testbed's folders there are
per user (TMP/testbed-UID/...), made 0700 whatever the umask, and checked before use: a real folder
(not a symlink), owned by this user, that nobody else can enter. Anything else is refused, saying why.

One lock per device, shared by everything that drives it (testbed nightly, `pytest --device=NAME`, a
farm job), by every job of this user on this host whatever its results store: a device is one
machine, and two jobs on it at once would time each other's work. An flock on LOCKS/DEVICE.lock,
released by the kernel when the holder dies. The lock file holds who has it, so a refusal can say so,
and a job that waits for it says once that it waits and for whom.

The default work folder of a device this host runs itself (the host, qemu-user) is not shared that
way: it is the results store's own (STORE/.work/NAME, private to this user; the store is
TESTBED_RESULTS, else the project's results/), so jobs writing different stores never meet in it, and
what a killed job leaves there stays with its store.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from testbed.errors import UsageError
from testbed.stop import raise_if_stopped


class DeviceBusy(Exception):
    """Another run holds the device's lock for longer than the caller may wait."""


def private_dir(path: Path) -> Path:
    """`path` as a folder only this user can use: made 0700 if absent, refused if it is a symlink,
    someone else's, or open to others."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True)
        os.chmod(path, 0o700, follow_symlinks=False)  # mkdir's mode is masked by the umask
    except FileExistsError:
        pass
    except OSError as e:
        raise UsageError(f"cannot make the private folder {path}: {e.strerror}") from None
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UsageError(f"{path} is not a folder (a symlink or a file); refusing to use it: remove it")
    if info.st_uid != os.geteuid():
        raise UsageError(f"{path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()}); "
                         "refusing to use it: remove it or choose another folder")
    if info.st_mode & 0o077:
        raise UsageError(f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):04o}); refusing "
                         f"to use it: chmod 700 {path}")
    return path


def user_temp(name: str) -> Path:
    """TMP/testbed-UID/NAME, private to this user (the lock folder, the host's work folder)."""
    base = private_dir(Path(tempfile.gettempdir()) / f"testbed-{os.geteuid()}")
    return private_dir(base / name)


def work_folder(name: str) -> Path:
    """STORE/.work/NAME: the default work folder of the device NAME this host runs itself (see above)."""
    from testbed.config import project_path
    from testbed.results import make_folder

    store = project_path(os.environ.get("TESTBED_RESULTS") or "results")
    make_folder(store)
    return private_dir(private_dir(store / ".work") / name)


def default_lock_dir() -> Path:
    return user_temp("locks")


@contextmanager
def device_lock(device: str, wait_s: float, holder: str, lock_dir: Path | None = None):
    """Hold `device` exclusively, waiting up to wait_s; DeviceBusy says who has it."""
    folder = private_dir(lock_dir) if lock_dir is not None else default_lock_dir()
    path = folder / f"{device}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise UsageError(f"cannot open the lock {path}: {e.strerror} (a symlink there is refused)") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise UsageError(f"{path} is not a lock file of this user; refusing to use it: remove it")
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                who = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
                if time.monotonic() >= deadline:
                    raise DeviceBusy(f"device {device} is busy: held by {who} ({path}); waited {wait_s:g} s") from None
                raise_if_stopped()  # a signal ends the wait (testbed.stop)
                if not said:  # waiting is visible: once, naming the holder
                    print(f"testbed: device {device} is busy: held by {who}; waiting up to {wait_s:g} s for it",
                          file=sys.stderr, flush=True)
                    said = True
                time.sleep(0.2)
        os.ftruncate(fd, 0)  # our own file (checked above), and ours to write while we hold it
        os.pwrite(fd, f"pid {os.getpid()}, {holder}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def process_alive(host, pid) -> bool | None:
    """Whether the process a start mark names still runs: None when that cannot be told here (another
    host, or a mark from before marks named their process). A zombie is gone."""
    if not isinstance(pid, int) or host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True
