"""The loopback adbd is trustworthy only if independent clients agree: adb-shell (testbed's transport)
and Debian's `adb` must see the same files, the same bytes and the same exit codes."""

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from testbed.devices.adb import ensure_adb_key
from testbed.devices.transport import sha256_file
from testbed.errors import DeviceUnreachable
from testbed.peers.fixtures import adb_connect


@pytest.fixture(scope="module")
def debian_adb(loopback_adbd, adb_key):
    """`adb` with its own server port and HOME (so it signs with the session key), connected."""
    if shutil.which("adb") is None:
        pytest.fail("Debian's adb client is not installed (apt install adb; scripts/bootstrap.sh --test does)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HOME": str(Path(adb_key).parent.parent), "ANDROID_ADB_SERVER_PORT": str(port)}
    serial = f"{loopback_adbd.host}:{loopback_adbd.port}"

    def adb(*args, check=True):
        return subprocess.run(["adb", *args], env=env, capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL, check=check)

    assert "connected to" in adb("connect", serial).stdout
    yield lambda *args, check=True: adb("-s", serial, *args, check=check)
    adb("kill-server", check=False)


def test_the_device_answers_with_its_fake_properties(debian_adb, adb_device):
    assert debian_adb("get-state").stdout.strip() == "device"
    assert debian_adb("shell", "getprop ro.product.model").stdout == "Loopback\n"
    assert adb_device.fingerprint()["model"] == "Loopback"
    assert adb_device.fingerprint()["abi"] == "armeabi-v7a"


def test_both_clients_see_the_same_files(debian_adb, adb_device, tmp_path):
    ours = tmp_path / "ours.bin"
    ours.write_bytes(os.urandom(700_000))
    adb_device.push(ours, "agree/ours.bin")
    theirs = tmp_path / "theirs.bin"
    theirs.write_bytes(os.urandom(300_001))
    debian_adb("push", str(theirs), "/data/local/tmp/testbed/agree/theirs.bin")

    listing = debian_adb("shell", "ls /data/local/tmp/testbed/agree").stdout.split()
    assert sorted(listing) == sorted(adb_device.run(["ls", "agree"]).stdout.split()) == ["ours.bin", "theirs.bin"]
    # adb pulls what testbed pushed; testbed pulls what adb pushed; both byte-identical
    debian_adb("pull", "/data/local/tmp/testbed/agree/ours.bin", str(tmp_path / "ours.back"))
    adb_device.pull("agree/theirs.bin", tmp_path / "theirs.back")
    assert sha256_file(tmp_path / "ours.back") == sha256_file(ours)
    assert sha256_file(tmp_path / "theirs.back") == sha256_file(theirs)
    adb_device.run(["rm", "-rf", "agree"])


@pytest.mark.parametrize("code", [0, 1, 7, 255])
def test_both_clients_see_the_same_exit_codes(debian_adb, adb_device, code):
    """Debian's adb reads it from shell v2's exit packet, adb-shell from testbed's v1 framing."""
    theirs = debian_adb("shell", f"echo out; echo err >&2; exit {code}", check=False)
    ours = adb_device.run(["sh", "-c", f"echo out; echo err >&2; exit {code}"])
    assert theirs.returncode == ours.returncode == code
    assert theirs.stdout == ours.stdout == "out\n" and theirs.stderr == ours.stderr == "err\n"


def test_arm_binaries_run_behind_adb(debian_adb, adb_device, tmp_path):
    from testbed.peers.fixtures import compile_static

    prog = compile_static(Path(__file__).parent / "data" / "axpb.c", "armeabi-v7a")
    adb_device.push(prog, "axpb", mode=0o755)
    theirs = debian_adb("shell", "cd /data/local/tmp/testbed && ./axpb", check=False)
    ours = adb_device.run(["./axpb"])
    assert theirs.returncode == ours.returncode == 2 and "usage" in ours.stderr  # the ARM program's own exit


def test_an_unknown_key_is_refused_with_the_reason(loopback_adbd, tmp_path):
    stranger = ensure_adb_key(str(tmp_path / "stranger" / "adbkey"))
    with pytest.raises(DeviceUnreachable, match="did not accept the key"):
        adb_connect(loopback_adbd, stranger, timeouts={"connect_s": 1.0})


def test_a_missing_adbkey_is_created_as_adb_does(tmp_path):
    key = ensure_adb_key(str(tmp_path / ".android" / "adbkey"))
    assert key.exists() and (key.stat().st_mode & 0o777) == 0o600
    pub = Path(f"{key}.pub").read_text()
    from testbed.peers.adbd import parse_android_pubkey

    n, e = parse_android_pubkey(pub.encode())
    assert n.bit_length() == 2048 and e == 65537


def test_the_default_key_is_the_usual_android_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    key = ensure_adb_key()
    assert key == tmp_path / ".android" / "adbkey" and Path(f"{key}.pub").exists()
    assert ensure_adb_key() == key and key.read_bytes() == ensure_adb_key().read_bytes()  # kept, not remade
