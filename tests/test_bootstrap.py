"""scripts/bootstrap.sh on a shared machine."""

import fcntl
import subprocess
import sys
from pathlib import Path

from testbed import PROJECT_ROOT


def test_bootstrap_waits_for_a_held_package_lock_saying_who_holds_it(tmp_path):
    """Issue 44, item 7: on a shared machine another apt-get holds dpkg's lock, and apt-get exits 100.
    scripts/bootstrap.sh waits before each apt-get (scripts/wait-for-dpkg-lock.sh) with one line naming
    the holder (then one at least every 30 s), and goes on once the lock is free. Here a lock file of the
    test's own, held with the fcntl lock dpkg takes, by a process the test releases."""
    lock = tmp_path / "lock-frontend"
    lock.touch()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a'); "
                               "fcntl.lockf(f, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", str(lock)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    waiting = subprocess.Popen([str(PROJECT_ROOT / "scripts" / "wait-for-dpkg-lock.sh"), str(tmp_path / "absent"),
                                str(lock)], stderr=subprocess.PIPE, text=True)
    first = waiting.stderr.readline()
    name = Path(f"/proc/{holder.pid}/comm").read_text().strip()  # the holder's name, as ps shows it
    assert first == f"bootstrap: waiting for the package lock, held by process {holder.pid} ({name}) on {lock}\n"
    assert waiting.poll() is None  # still waiting: the lock is held
    holder.stdin.close()  # the holder ends, and its lock with it
    holder.wait(timeout=60)
    rest = waiting.stderr.read()
    assert waiting.wait(timeout=600) == 0 and rest.splitlines()[-1].startswith("bootstrap: the package lock is free")
    with open(lock, "a") as f:  # free indeed
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    free = subprocess.run([str(PROJECT_ROOT / "scripts" / "wait-for-dpkg-lock.sh"), str(lock)], capture_output=True,
                          text=True, timeout=600)
    assert (free.returncode, free.stderr) == (0, "")  # a free lock: not a word
