"""Locks and the host's work folder live in per-user private folders, and one lock serves every
driver of a device: a nightly and `pytest --device=X` (issue 13, items 9 and 20)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testbed import PROJECT_ROOT
from testbed.devices import load_profile, transport_for
from testbed.devices.private import DeviceBusy, device_lock, private_dir
from testbed.errors import UsageError


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    """A TMPDIR of our own, so the per-user folders of this test are not the machine's."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return tmp_path


def test_the_lock_never_follows_a_symlink_nor_truncates_its_target(tmpdir_env):
    victim = tmpdir_env / "victim"
    victim.write_text("precious\n")
    locks = private_dir(tmpdir_env / "locks")
    (locks / "host.lock").symlink_to(victim)
    with pytest.raises(UsageError, match="a symlink there is refused"):
        with device_lock("host", 0, "test", locks):
            pass
    assert victim.read_text() == "precious\n"


def test_a_lock_folder_that_is_a_symlink_or_open_to_others_is_refused(tmpdir_env):
    (tmpdir_env / "elsewhere").mkdir()
    (tmpdir_env / "link").symlink_to(tmpdir_env / "elsewhere")
    with pytest.raises(UsageError, match="not a folder"):
        private_dir(tmpdir_env / "link")
    (tmpdir_env / "open").mkdir()
    os.chmod(tmpdir_env / "open", 0o777)
    with pytest.raises(UsageError, match="open to other users"):
        private_dir(tmpdir_env / "open")
    theirs = tmpdir_env / "theirs"
    theirs.mkdir(mode=0o700)
    try:
        os.chown(theirs, 65534, 65534)
    except PermissionError:
        pytest.skip("cannot chown here to play another user")
    with pytest.raises(UsageError, match="belongs to uid 65534"):
        private_dir(theirs)


def test_folders_are_private_even_under_umask_000(tmpdir_env, results_dir):
    old = os.umask(0)
    try:
        with device_lock("host", 0, "test"):
            pass
        work = transport_for(load_profile("host")).work_dir
    finally:
        os.umask(old)
    base = tmpdir_env / f"testbed-{os.geteuid()}"
    for folder in (base, base / "locks", results_dir / ".work", results_dir / ".work" / "host"):
        assert folder.is_dir() and (folder.stat().st_mode & 0o777) == 0o700
    assert work == str(results_dir / ".work" / "host")
    assert ((base / "locks" / "host.lock").stat().st_mode & 0o777) == 0o600


def test_pytest_on_a_device_a_night_holds_stops_at_once_naming_the_holder(tmpdir_env):
    env = {**os.environ, "TMPDIR": str(tmpdir_env)}
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from testbed.devices.private import device_lock\n"
         "with device_lock('adb-loopback', 0, 'testbed nightly, night N1'):\n"
         "    print('held', flush=True); sys.stdin.read()"],
        cwd=PROJECT_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        p = subprocess.run([sys.executable, "-m", "pytest", "--device=adb-loopback", "-q", "--co",
                            "-p", "no:cacheprovider", "tests/test_results.py"],
                           cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert p.returncode == 3, p.stdout + p.stderr
    assert f"device adb-loopback is busy: held by pid {holder.pid}, testbed nightly, night N1" in p.stdout + p.stderr


def test_a_night_sees_the_device_a_pytest_session_holds(tmpdir_env):
    with device_lock("qemu-arm32", 0, "pytest session (pytest --device=qemu-arm32)"):
        with pytest.raises(DeviceBusy, match=r"held by pid \d+, pytest session"):
            with device_lock("qemu-arm32", 0.3, "testbed nightly"):
                pass


def test_each_results_store_has_its_own_work_folders(tmp_path, monkeypatch):
    """Issue 24, item 24: the host's and qemu's work folders were $TMPDIR/testbed-UID/NAME, shared by every
    job of one user: another job's run folders (a killed one's leftovers) and cleanup landed in each
    other's. Each results store now has its own (STORE/.work/NAME)."""
    from testbed.devices import connect

    folders = {}
    for store in ("a", "b"):
        monkeypatch.setenv("TESTBED_RESULTS", str(tmp_path / store))
        for name in ("host", "qemu-arm32"):
            folders[store, name] = transport_for(load_profile(name)).work_dir
        device = connect(load_profile("host"))
        device.run(["mkdir", "-p", f"runs/left-by-{store}"])
        device.close()
    assert folders["a", "host"] == str(tmp_path / "a" / ".work" / "host")
    assert folders["a", "qemu-arm32"] == str(tmp_path / "a" / ".work" / "qemu-arm32")
    assert folders["a", "host"] != folders["b", "host"] and folders["a", "qemu-arm32"] != folders["b", "qemu-arm32"]
    assert os.listdir(tmp_path / "b" / ".work" / "host" / "runs") == ["left-by-b"]


def test_a_job_waiting_for_a_device_says_so_naming_the_holder(tmpdir_env, capsys):
    """Issue 24, item 24: one lock per device serves every job on this host (README: why); a job that
    waits for it says once that it waits, and for whom, instead of hanging silently."""
    with device_lock("qemu-arm32", 0, "testbed nightly, night N7"):
        with pytest.raises(DeviceBusy):
            with device_lock("qemu-arm32", 0.5, "pytest session"):
                pass
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "device qemu-arm32 is busy: held by pid" in err and "night N7" in err
    assert "waiting up to 0.5 s" in err

