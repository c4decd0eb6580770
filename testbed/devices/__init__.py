"""Devices: a profile (devices/NAME.yaml) plus a transport that pushes, pulls and runs commands.

  profile.py    profiles and their validation
  transport.py  the interface and the remote discipline (quoting, confinement, timeouts, verified
                transfers, retries where safe)
  local.py      the host, and ARM binaries under qemu-user
  adb.py        ADB via adb-shell (TCP, USB)
  adb_server.py ADB through an adb server (adb -H HOST -P PORT), sharing USB with the system's adb
  ssh.py        SSH via paramiko (SFTP, explicit host-key policy)
  health.py     fingerprint, temperatures, battery, throttling, cool-down

connect(profile) returns a Device only when the device answers; otherwise it raises DeviceUnreachable
saying why, so `pytest --device=pixel` without a phone stops at once.
"""

from __future__ import annotations

import atexit
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed import children
from testbed.devices import health
from testbed.devices.health import host_fingerprint
from testbed.devices.local import LocalTransport, QemuTransport
from testbed.devices.private import work_folder
from testbed.devices.profile import Profile, TRANSPORTS, load_profile
from testbed.devices.transport import CommandResult, CommandTimeout, TransferError, Transport
from testbed.errors import DeviceError, DeviceUnreachable, UsageError

__all__ = ["Profile", "load_profile", "connect", "Device", "host_fingerprint", "CommandResult",
           "CommandTimeout", "TransferError", "TRANSPORTS"]


@dataclass
class Device:
    profile: Profile
    transport: Transport
    peer: "Peer | None" = None
    _fingerprint: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.profile.name

    def push(self, local: Path, remote: str, mode: int = 0o644) -> None:
        self.transport.push(Path(local), remote, mode)

    def pull(self, remote: str, local: Path) -> None:
        self.transport.pull(remote, Path(local))

    def run(self, argv: list[str], timeout: float | None = None, cwd: str = "") -> CommandResult:
        return self.transport.run(argv, timeout if timeout is not None else self.profile.timeout("command_s"), cwd)

    def health(self) -> dict[str, Any]:
        """A snapshot: temperatures, battery, frequencies (what the device exposes)."""
        snap = health.probe_device(self.transport)
        return {k: snap[k] for k in ("temperatures_c", "battery", "frequencies", "governor")}

    def measured(self, fn):
        """Run `fn` (one measurement) under the profile's health discipline: cool-down gate, health
        before, warm-up runs, the measured run, health after, throttling flag. Returns (fn's result,
        what to add to the record's metrics)."""
        h = self.profile.health
        gate = health.cool_down(self.health, h.get("cooldown_below_c"), h.get("cooldown_delay_s") or 0.0,
                                h.get("cooldown_max_wait_s") or 300.0)
        before = self.health()
        for _ in range(int(h.get("warmup") or 0)):
            fn()
        result = fn()
        after = self.health()
        flagged, why = health.throttled(after, h.get("throttle_fraction") or 0.8, h.get("cooldown_below_c"))
        return result, {"cooldown": gate, "warmup_runs": int(h.get("warmup") or 0),
                        "hottest_c_before": health.hottest(before), "hottest_c_after": health.hottest(after),
                        "temperatures_c_before": before["temperatures_c"], "temperatures_c_after": after["temperatures_c"],
                        "battery_before": before["battery"], "battery_after": after["battery"],
                        "throttled": flagged, "throttle_reason": why}

    def fingerprint(self) -> dict[str, Any]:
        """Model, ABI, OS build, governor, temperatures: stored with every record."""
        if self._fingerprint is None:
            if self.profile.transport == "local":
                fp = host_fingerprint()
            else:
                fp = health.probe_device(self.transport)
                if self.profile.transport == "qemu":
                    fp = {**fp, "abi": self.profile.abi, "emulated": True}
            self._fingerprint = {"profile": self.name, "transport": self.profile.transport,
                                 "profile_abi": self.profile.abi, **fp}
        return self._fingerprint

    def close(self) -> None:
        self.transport.close()
        if self.peer is not None:
            self.peer.stop()


class Peer:
    """A loopback device the profile starts itself (peer.command), stopped with the Device.

    The command's placeholders: {python} this interpreter, {sandbox} a fresh temporary folder,
    {adbkey_pub} the public half of the adb key the transport will use, {pid} this process (a peer
    should exit when it ends: the CLI never closes the device it ran on). It must print
    `... listening on HOST:PORT` first.

    It runs in its own folder (the sandbox), with the folder that holds this testbed package first on
    its PYTHONPATH: a `testbed/` folder where the user happens to be, or another install, is never the
    testbed it imports."""

    def __init__(self, command: list[str], key_pub: str, timeout: float):
        self.sandbox = tempfile.mkdtemp(prefix="testbed-peer-")
        argv = [str(a).format(python=sys.executable, sandbox=os.path.join(self.sandbox, "fs"), adbkey_pub=key_pub,
                              pid=os.getpid()) for a in command]
        self.log = os.path.join(self.sandbox, "peer.log")
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONSAFEPATH": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
        with open(self.log, "w") as log:  # a child of testbed's (testbed.children): it dies with testbed
            self.proc = children.start(argv, stdout=subprocess.PIPE, stderr=log, text=True, cwd=self.sandbox, env=env)
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        found = re.search(r"listening on ([\d.]+):(\d+)", line)
        if not found:
            said = [ln.strip() for ln in Path(self.log).read_text(errors="replace").splitlines() if ln.strip()]
            self.stop()
            raise DeviceUnreachable(f"the loopback peer {' '.join(argv[:4])} did not start: "
                                    f"{said[-1][-300:] if said else 'no answer'}")
        self.host, self.port = found.group(1), int(found.group(2))
        atexit.register(self.stop)  # its sandbox too

    def stop(self) -> None:
        children.end(self.proc)
        shutil.rmtree(self.sandbox, ignore_errors=True)


def transport_for(profile: Profile, connection: dict | None = None) -> Transport:
    conn = dict(profile.connection if connection is None else connection)
    t = profile.timeout("connect_s")
    if profile.transport == "local":
        return LocalTransport(profile.name, profile.work_dir or str(work_folder("host")))
    if profile.transport == "qemu":
        work = profile.work_dir or str(work_folder(profile.name))
        return QemuTransport(profile.name, work, conn["emulator"], conn.get("sysroot") or "")
    if profile.transport == "adb" and conn.get("server"):
        from testbed.devices.adb_server import AdbServerTransport

        return AdbServerTransport(profile.name, profile.work_dir, conn, t, profile.timeout("transfer_s"))
    if profile.transport == "adb":
        from testbed.devices.adb import AdbTransport

        return AdbTransport(profile.name, profile.work_dir, conn, t, profile.timeout("transfer_s"))
    from testbed.devices.ssh import SshTransport

    return SshTransport(profile.name, profile.work_dir, conn, t, profile.timeout("transfer_s"))


def connect(profile: Profile, connection: dict | None = None) -> Device:
    """Reach the device (starting its loopback peer if the profile has one) and make its work folder.
    `connection` overrides the profile's connection fields (tests point a profile at their peers)."""
    peer = None
    conn = dict(profile.connection if connection is None else connection)
    why = profile.not_configured() if connection is None else None
    if why:
        raise DeviceUnreachable(f"{profile.name}: {why}")
    if profile.peer:
        from testbed.devices.adb import ensure_adb_key

        key = ensure_adb_key(conn.get("key") or "~/.android/adbkey")
        peer = Peer(profile.peer["command"], f"{key}.pub", profile.timeout("connect_s") + 10)
        conn.update(host=peer.host, port=peer.port)
    transport = transport_for(profile, conn)
    try:
        transport.connect()
    except DeviceUnreachable:
        if peer is not None:
            peer.stop()
        raise
    return Device(profile, transport, peer)


def reachability(name: str) -> str:
    """yes, or why not; a profile that is not configured (a template) is listed so, never probed."""
    try:
        profile = load_profile(name)
        if profile.not_configured():
            return profile.not_configured()
        device = connect(profile)
    except (DeviceUnreachable, DeviceError) as e:
        return one_line(f"no: {str(e).removeprefix(name + ': ')}")
    except UsageError as e:
        return one_line(f"invalid profile: {e}")
    device.close()
    return "yes"


def one_line(text: str) -> str:
    """A table cell: whatever a reason holds (a peer's traceback), on one line."""
    return " ".join(str(text).split())
