"""The host itself (local) and ARM or Hexagon binaries on the host under qemu-user (qemu).

qemu is for correctness, never timing: emulated code runs 40-70x slower than on a device.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

from testbed import children
from testbed.devices.transport import (CommandResult, CommandTimeout, OutsideWorkFolder, Transport, TransferError,
                                       check_argv, confine, elf_machine, quoted, sha256_file)


class LocalTransport(Transport):
    """Files are copied into the work folder; commands run there as testbed's children (testbed.children):
    each in a session of its own, so a timeout kills the whole tree, not just the first process, and
    none outlives testbed."""

    kind = "local"

    def __init__(self, name: str, work_dir: str):
        self.name = name
        self.root = Path(work_dir)
        self.work_dir = str(self.root)

    def connect(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            from testbed.errors import DeviceUnreachable

            raise DeviceUnreachable(f"{self.name}: cannot create the work folder {self.root}: {e.strerror}") from None

    def path(self, remote: str) -> Path:
        return self.root / confine(remote)

    def inside(self, remote: str) -> Path:
        """The path of `remote`, checked not to lead out of the work folder through a symlink."""
        target = self.path(remote)
        resolved = Path(os.path.realpath(target))
        if not resolved.is_relative_to(os.path.realpath(self.root)):
            raise OutsideWorkFolder(f"{self.name}: {remote!r} leads out of the work folder {self.root} "
                                    f"(to {resolved}: a symlink); refused")
        return target

    def push(self, local: Path, remote: str, mode: int = 0o644) -> None:
        dest = self.inside(remote)
        tmp = dest.with_name(f".tb-{secrets.token_hex(4)}.part")  # short: dest's own name may be NAME_MAX long
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local, tmp)
            os.chmod(tmp, mode)
            os.replace(tmp, dest)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise TransferError(f"{self.name}: push of {Path(local).name} to {dest} failed: {e.strerror}") from None

    def pull(self, remote: str, local: Path) -> None:
        source = self.inside(remote)
        if not source.is_file():
            raise TransferError(f"{self.name}: cannot pull {source}: no such file")
        tmp = Path(local).with_name(f".tb-{secrets.token_hex(4)}.part")
        try:
            shutil.copyfile(source, tmp)
            os.replace(tmp, local)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise TransferError(f"{self.name}: pull of {source} to {local} failed: {e.strerror}") from None

    def remote_digest(self, remote: str) -> tuple[int, str] | None:
        path = self.inside(remote)
        return (path.stat().st_size, sha256_file(path)) if path.is_file() else None

    def remote_size(self, remote: str) -> int | None:
        path = self.inside(remote)
        return path.stat().st_size if path.is_file() else None

    def command(self, argv: list[str], folder: Path) -> list[str]:
        return check_argv(argv)

    def run(self, argv: list[str], timeout: float = 60.0, cwd: str = "") -> CommandResult:
        folder = self.inside(cwd) if cwd else self.root
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:  # its own session, ended on a timeout, a stop (testbed.stop) and testbed's own end
            p = children.run(self.command(argv, folder), cwd=folder, capture_output=True, text=True, errors="replace",
                             timeout=timeout)
        except OSError as e:  # as a shell says it on the other transports: 127 not found, 126 cannot be started
            status = 127 if isinstance(e, FileNotFoundError) else 126
            return CommandResult(status, "", f"{argv[0]}: {e.strerror}", time.monotonic() - t0)
        except subprocess.TimeoutExpired:
            raise CommandTimeout(f"{self.name}: {quoted(argv)} did not finish in {timeout:g} s; killed") from None
        return CommandResult(p.returncode, p.stdout, p.stderr, time.monotonic() - t0)

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# ELF e_machine values of the ABIs qemu-user emulates here (164: Hexagon, "QUALCOMM DSP6").
ELF_MACHINES = {"qemu-arm": 40, "qemu-aarch64": 183, "qemu-hexagon": 164}


class QemuTransport(LocalTransport):
    """Like local, but a program built for the emulated ABI (ARM, AArch64, Hexagon) is started through
    qemu-user (with -L
    SYSROOT for dynamically linked ones) and the instruction-counting plugin (testbed.measure.counts), which
    leaves the program's counts in its working folder; host programs (sh, cat) run as they are."""

    kind = "qemu"

    def __init__(self, name: str, work_dir: str, emulator: str, sysroot: str = ""):
        super().__init__(name, work_dir)
        self.emulator = emulator
        self.sysroot = sysroot

    def connect(self) -> None:
        if shutil.which(self.emulator) is None:
            from testbed.errors import DeviceUnreachable

            raise DeviceUnreachable(f"{self.name}: emulator {self.emulator!r} is not installed (Debian: qemu-user)")
        super().connect()

    def command(self, argv: list[str], folder: Path) -> list[str]:
        argv = check_argv(argv)
        program = Path(argv[0]) if os.path.isabs(argv[0]) else folder / argv[0]
        if elf_machine(program) != ELF_MACHINES.get(self.emulator):
            return argv
        from testbed.measure.counts import qemu_plugin_args

        prefix = [self.emulator, *qemu_plugin_args()] + (["-L", self.sysroot] if self.sysroot else [])
        return prefix + [str(program)] + argv[1:]
