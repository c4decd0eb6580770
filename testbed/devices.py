"""Devices: a profile (devices/NAME.yaml) plus a transport that pushes, pulls and runs commands.

A transport does four things: push a file, pull a file, run a command with a timeout (exit code,
stdout, stderr) and clean up its work folder. The local transport is the host itself.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from testbed.config import DEVICES_DIR, choices
from testbed.errors import UsageError

TRANSPORTS = ("local", "qemu", "adb", "ssh")


@dataclass
class Profile:
    """What a device is and how to reach it (validated from devices/NAME.yaml)."""

    name: str
    transport: str
    abi: str
    description: str = ""
    capabilities: list[str] = field(default_factory=list)
    threads: list[int] = field(default_factory=lambda: [1])
    work_dir: str = ""
    tools: dict[str, str] = field(default_factory=dict)
    connection: dict[str, Any] = field(default_factory=dict)

    REQUIRED = ("name", "transport", "abi")

    @classmethod
    def from_config(cls, node: DictConfig | dict, source: str) -> "Profile":
        data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        known = set(cls.__dataclass_fields__)
        for key in data:
            if key not in known:
                raise UsageError(f"{source}: unknown field {key!r}; accepted: {', '.join(sorted(known))}")
        for key in cls.REQUIRED:
            if key not in data:
                raise UsageError(f"{source}: missing field {key!r}")
        if data["transport"] not in TRANSPORTS:
            raise UsageError(f"{source}: transport {data['transport']!r} is not one of {', '.join(TRANSPORTS)}")
        threads = data.get("threads", [1])
        if not isinstance(threads, list) or not all(isinstance(t, int) and t > 0 for t in threads):
            raise UsageError(f"{source}: threads {threads!r} must be a list of positive integers")
        return cls(**data)

    def has(self, capability: str) -> bool:
        return capability in self.capabilities


def load_profile(name: str) -> Profile:
    if name not in choices("device"):
        raise UsageError(f"unknown device {name!r}; accepted: {', '.join(choices('device'))}")
    path = DEVICES_DIR / f"{name}.yaml"
    return Profile.from_config(OmegaConf.load(path), str(path.relative_to(DEVICES_DIR.parent)))


@dataclass
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


class LocalTransport:
    """The host itself: files are copied into the work folder, commands run as subprocesses."""

    def __init__(self, work_dir: str):
        self.work_dir = Path(work_dir)

    def push(self, local: Path, remote: str) -> None:
        dest = self.work_dir / remote
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, dest)

    def pull(self, remote: str, local: Path) -> None:
        shutil.copyfile(self.work_dir / remote, local)

    def run(self, argv: list[str], timeout: float = 60.0) -> CommandResult:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            p = subprocess.run(argv, cwd=self.work_dir, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"{shlex.join(argv)} did not finish in {timeout:g} s") from e
        return CommandResult(p.returncode, p.stdout, p.stderr)

    def cleanup(self) -> None:
        shutil.rmtree(self.work_dir, ignore_errors=True)


@dataclass
class Device:
    profile: Profile
    transport: Any

    @property
    def name(self) -> str:
        return self.profile.name

    def fingerprint(self) -> dict[str, Any]:
        return host_fingerprint() if self.profile.transport == "local" else {"abi": self.profile.abi}


def connect(profile: Profile) -> Device:
    if profile.transport == "local":
        work = profile.work_dir or os.path.join(os.environ.get("TMPDIR", "/tmp"), "testbed-host")
        return Device(profile, LocalTransport(work))
    raise UsageError(f"device {profile.name!r}: transport {profile.transport!r} is not available in this build")


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def host_fingerprint() -> dict[str, Any]:
    """What identifies this machine's measurements: CPU model, cores, OS, governor, temperatures."""
    model = None
    cpuinfo = _read("/proc/cpuinfo") or ""
    for line in cpuinfo.splitlines():
        if line.lower().startswith(("model name", "hardware", "processor\t: arm")):
            model = line.split(":", 1)[1].strip()
            break
    temps = {}
    for zone in sorted(Path("/sys/class/thermal").glob("thermal_zone*")):
        t = _read(str(zone / "temp"))
        kind = _read(str(zone / "type")) or zone.name
        if t and t.lstrip("-").isdigit():
            temps[kind] = int(t) / 1000.0
    return {
        "model": model or platform.processor() or "unknown",
        "abi": platform.machine(),
        "os": f"{platform.system()} {platform.release()}",
        "cores": os.cpu_count(),
        "governor": _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
        "temperatures_c": temps,
        "python": platform.python_version(),
    }
