"""Faults: the device dies mid-push or mid-run, a pulled file arrives corrupted, the device is full,
a command hangs. Each ends in a clear error, is retried only where that is safe (transfers), and
never leaves a file or record that reads as good."""

import os
import threading
import time

import numpy as np
import pytest

from testbed.devices import CommandTimeout, TransferError, connect
from testbed.devices.transport import sha256_file
from testbed.errors import DeviceUnreachable
from testbed.peers.fixtures import adb_connect, ssh_profile


def big_file(tmp_path, mb=24):
    path = tmp_path / "big.bin"
    path.write_bytes(np.random.default_rng(3).integers(0, 256, mb << 20, dtype=np.uint8).tobytes())
    return path


def in_thread(fn):
    """Run fn in a thread; returns a function that joins it and returns its exception (or None)."""
    box = {}

    def target():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 -- the test inspects whatever was raised
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    return lambda: (t.join(60), box.get("error"))[1]


def wait_for(condition, seconds=20):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# --- ADB -------------------------------------------------------------------------------------------


def test_adbd_killed_mid_push(adbd_factory, adb_key, tmp_path):
    adbd = adbd_factory()
    device = adb_connect(adbd, adb_key)
    src = big_file(tmp_path)
    target = adbd.sandbox / "testbed" / "big.bin"
    join = in_thread(lambda: device.push(src, "big.bin"))
    wait_for(lambda: target.exists() and target.stat().st_size > 0)
    adbd.kill()
    error = join()
    assert isinstance(error, TransferError), error
    assert "failed after 2 attempts" in str(error) and "nothing answers" in str(error)


def test_a_connection_cut_mid_push_is_retried_and_verified(adbd_factory, adb_key, tmp_path):
    adbd = adbd_factory("--drop-after-bytes", "300000")
    device = adb_connect(adbd, adb_key)
    src = big_file(tmp_path, 2)
    device.push(src, "big.bin")  # the first attempt is cut; the retry lands and is checked
    assert sha256_file(adbd.sandbox / "testbed" / "big.bin") == sha256_file(src)
    device.close()


def test_a_corrupted_pull_is_retried(adbd_factory, adb_key, tmp_path):
    adbd = adbd_factory("--corrupt-recv", "1")
    device = adb_connect(adbd, adb_key)
    src = big_file(tmp_path, 1)
    device.push(src, "data.bin")
    device.pull("data.bin", tmp_path / "back.bin")
    assert sha256_file(tmp_path / "back.bin") == sha256_file(src)
    device.close()


def test_a_pull_corrupted_every_time_fails_and_leaves_no_file(adbd_factory, adb_key, tmp_path):
    adbd = adbd_factory("--corrupt-recv", "1000")
    device = adb_connect(adbd, adb_key)
    src = big_file(tmp_path, 1)
    device.push(src, "data.bin")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(TransferError, match="pull of .*data.bin failed after 2 attempts: received 1048576 bytes"):
        device.pull("data.bin", out / "back.bin")
    assert os.listdir(out) == []
    device.close()


def test_a_full_device_refuses_the_push_clearly(adbd_factory, adb_key, tmp_path):
    adbd = adbd_factory("--quota", str(1 << 20))
    device = adb_connect(adbd, adb_key)
    with pytest.raises(TransferError, match="No space left on device"):
        device.push(big_file(tmp_path, 2), "big.bin")
    assert not (adbd.sandbox / "testbed" / "big.bin").exists()  # no partial file on the device
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 1000)
    device.push(small, "small.bin")  # the device still works
    device.close()


def test_adbd_killed_mid_run_is_not_retried(adbd_factory, adb_key):
    adbd = adbd_factory()
    device = adb_connect(adbd, adb_key)
    join = in_thread(lambda: device.run(["sh", "-c", "touch started; sleep 30"], timeout=60))
    wait_for(lambda: (adbd.sandbox / "testbed" / "started").exists())
    t0 = time.monotonic()
    adbd.kill()
    error = join()
    assert isinstance(error, DeviceUnreachable), error
    assert "connection lost" in str(error) and "not retried" in str(error)
    assert time.monotonic() - t0 < 10


# --- SSH -------------------------------------------------------------------------------------------


@pytest.fixture
def doomed_sshd():
    from testbed.peers.sshd import Sshd

    server = Sshd().start()
    yield server
    server.stop()


def test_sshd_killed_mid_run(doomed_sshd):
    device = connect(ssh_profile(doomed_sshd))
    started = f"{doomed_sshd.work_dir}/started"
    join = in_thread(lambda: device.run(["sh", "-c", "touch started; sleep 30"], timeout=60))
    wait_for(lambda: os.path.exists(started))
    doomed_sshd.kill()
    error = join()
    assert isinstance(error, DeviceUnreachable) and "not retried" in str(error), error


def test_sshd_killed_mid_push(doomed_sshd, tmp_path):
    device = connect(ssh_profile(doomed_sshd))
    target = f"{doomed_sshd.work_dir}/big.bin"
    join = in_thread(lambda: device.push(big_file(tmp_path, 48), "big.bin"))
    wait_for(lambda: os.path.exists(target) and os.path.getsize(target) > 0)
    doomed_sshd.kill()
    error = join()
    assert isinstance(error, TransferError) and "nothing answers" in str(error), error


def test_a_hung_command_is_killed_even_if_it_ignores_sigterm(ssh_device):
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout):
        ssh_device.run(["sh", "-c", "trap '' TERM; sleep 60"], timeout=1)
    assert time.monotonic() - t0 < 5


def test_an_ssh_handshake_cut_short_is_a_transfer_error_not_a_raw_eof(ssh_device, tmp_path, monkeypatch):
    """sshd dying mid-handshake makes paramiko raise EOFError; a push must still end in TransferError."""
    import paramiko

    (tmp_path / "f").write_text("x")

    def cut(*args, **kwargs):
        raise EOFError()

    ssh_device.transport._drop()
    monkeypatch.setattr(paramiko.SSHClient, "connect", cut)
    with pytest.raises(TransferError, match="EOFError"):
        ssh_device.push(tmp_path / "f", "f")
    monkeypatch.undo()
    ssh_device.push(tmp_path / "f", "f")  # and the next push reconnects
