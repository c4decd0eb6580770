"""pytest fixtures for the real peers (loaded by testbed's pytest plugin).

  adb_key            an adb RSA key pair in a session folder (never the user's ~/.android)
  adbd_factory       start(**flags) -> a loopback adbd subprocess; all stopped at session end
  adb_device         a Device on the session's loopback adbd, through adb-shell
  adb_server         Debian's adb server on its own port, connected to a loopback adbd of its own
  adb_server_device  a Device on that adbd through that server (adb -H 127.0.0.1 -P PORT)
  sshd               Debian's sshd on 127.0.0.1 for the session (own config, host key, user)
  ssh_device         a Device on it, through paramiko
  local_device       the host, with a session work folder
  compile_static     build a small C test program, statically, for an ABI (cached by content)
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from testbed import PROJECT_ROOT, children
from testbed.devices import Device, Profile, connect
from testbed.devices.adb import ensure_adb_key

COMPILERS = {"host": "gcc", "x86_64": "gcc", "armeabi-v7a": "arm-linux-gnueabihf-gcc",
             "arm64-v8a": "aarch64-linux-gnu-gcc"}


def compile_static(source: Path, abi: str, defines: tuple[str, ...] = ()) -> Path:
    """A static binary of one C file for `abi`, bit-reproducible arithmetic (-ffp-contract=off),
    cached under .cache/test-programs by the hash of source, compiler and flags."""
    flags = ["-static", "-O2", "-ffp-contract=off", *[f"-D{d}" for d in defines]]
    compiler = COMPILERS[abi]
    key = hashlib.sha256(Path(source).read_bytes() + repr((compiler, flags)).encode()).hexdigest()[:16]
    out = PROJECT_ROOT / ".cache" / "test-programs" / f"{Path(source).stem}-{abi}-{key}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        children.run([compiler, *flags, "-o", str(tmp), str(source)], check=True, capture_output=True)
        tmp.replace(out)
    return out


class LoopbackAdbd:
    """One `python -m testbed.peers.adbd` process."""

    def __init__(self, sandbox: Path, key_pub: Path, *flags: str):
        self.sandbox = sandbox
        self.proc = children.start(
            [sys.executable, "-m", "testbed.peers.adbd", "--sandbox", str(sandbox),
             "--authorized-keys", str(key_pub), "--parent", str(os.getpid()), "--prop", "ro.product.model=Loopback",
             "--prop", "ro.product.cpu.abi=armeabi-v7a", *flags],
            stdout=subprocess.PIPE, text=True, cwd=PROJECT_ROOT)
        line = self.proc.stdout.readline()
        found = re.search(r"listening on ([\d.]+):(\d+)", line)
        if not found:
            raise RuntimeError(f"adbd did not start: {line!r}")
        self.host, self.port = found.group(1), int(found.group(2))

    def kill(self) -> None:
        children.end(self.proc)


def adb_profile(name: str = "loopback", abi: str = "armeabi-v7a", **fields) -> Profile:
    return Profile(name=name, transport="adb", abi=abi, capabilities=["cpu", "native", "adb"],
                   work_dir="/data/local/tmp/testbed", **fields)


def adb_connect(adbd: LoopbackAdbd, key: Path, **fields) -> Device:
    return connect(adb_profile(**fields), {"host": adbd.host, "port": adbd.port, "key": str(key)})


@pytest.fixture(scope="session")
def adb_key(tmp_path_factory) -> Path:
    return ensure_adb_key(str(tmp_path_factory.mktemp("adbhome") / ".android" / "adbkey"))


@pytest.fixture(scope="session")
def adbd_factory(tmp_path_factory, adb_key):
    started: list[LoopbackAdbd] = []

    def start(*flags: str) -> LoopbackAdbd:
        adbd = LoopbackAdbd(tmp_path_factory.mktemp("adbd") / "fs", Path(f"{adb_key}.pub"), *flags)
        started.append(adbd)
        return adbd

    yield start
    for adbd in started:
        adbd.kill()


@pytest.fixture(scope="session")
def loopback_adbd(adbd_factory) -> LoopbackAdbd:
    return adbd_factory()


@pytest.fixture(scope="session")
def adb_device(loopback_adbd, adb_key):
    device = adb_connect(loopback_adbd, adb_key)
    yield device
    device.close()


class AdbServer:
    """Debian's `adb` server on 127.0.0.1:PORT, with its own HOME so it signs with the session key
    (`adb -P PORT`: adb starts a server only on this machine, so no -H)."""

    def __init__(self, key: Path):
        if shutil.which("adb") is None:
            pytest.fail("Debian's adb client is not installed (apt install adb; scripts/bootstrap.sh --test does)")
        with socket.socket() as s:  # a free port for this server alone, never the user's 5037
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.env = {**os.environ, "HOME": str(Path(key).parent.parent)}

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return children.run(["adb", "-P", str(self.port), *args], env=self.env,  # `adb start-server`'s server
                            capture_output=True, text=True, timeout=30, check=check)  # leaves in a session of its own

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="session")
def adb_server(adbd_factory, adb_key):
    """(the server, the serial of its loopback phone)."""
    server, adbd = AdbServer(adb_key), adbd_factory()
    server("start-server")
    serial = f"{adbd.host}:{adbd.port}"
    assert "connected to" in server("connect", serial).stdout
    yield server, serial
    server("kill-server", check=False)


@pytest.fixture(scope="session")
def adb_server_device(adb_server):
    server, serial = adb_server
    device = connect(adb_profile("loopback-via-server"), {"server": server.address, "serial": serial})
    yield device
    device.close()


@pytest.fixture(scope="session")
def sshd():
    from testbed.peers.sshd import Sshd

    server = Sshd().start()
    yield server
    server.stop()


def ssh_profile(sshd, name: str = "sshpeer") -> Profile:
    return Profile(name=name, transport="ssh", abi="x86_64", capabilities=["cpu", "native", "ssh"],
                   work_dir=sshd.work_dir, connection=sshd.connection())


@pytest.fixture(scope="session")
def ssh_device(sshd):
    device = connect(ssh_profile(sshd))
    yield device
    device.close()


@pytest.fixture(scope="session")
def local_device(tmp_path_factory):
    profile = Profile(name="local", transport="local", abi="host", work_dir=str(tmp_path_factory.mktemp("work")))
    device = connect(profile)
    yield device
    device.close()
