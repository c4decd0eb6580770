"""A real sshd (Debian's openssh-server) on 127.0.0.1 for the test suite, with its own config and keys.

Started as `sshd -D -e -f CONFIG`: its own ed25519 host key, key-only login for one non-root user whose
shell is /bin/sh (created as `testbed-ssh` when running as root; otherwise the current user, which is
the only user a non-root sshd can log in), SFTP through internal-sftp. Ready in ~40 ms.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from testbed import children

SSH_USER = "testbed-ssh"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_user() -> str:
    """The non-root login user: created (no home, /bin/sh, no password) if running as root."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.getuid()).pw_name
    try:
        pwd.getpwnam(SSH_USER)
    except KeyError:
        # '*' is "no password" but not "locked" ('!'), which sshd without PAM would refuse.
        children.run(["useradd", "--no-create-home", "--home-dir", "/", "--shell", "/bin/sh",
                        "--password", "*", SSH_USER], check=True, capture_output=True)
    return SSH_USER


class Sshd:
    """The server's files live in a fresh folder directly under the system temp folder: the login
    user reads authorized_keys from it, so every folder above it must be traversable."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="testbed-sshd-"))
        os.chmod(self.root, 0o755)
        self.user = ensure_user()
        self.port = _free_port()
        self.host_key = self.root / "host_ed25519"
        self.client_key = self.root / "client_ed25519"
        self.known_hosts = self.root / "known_hosts"
        self.config = self.root / "sshd_config"
        self.work_dir = f"/tmp/testbed-ssh-work-{secrets.token_hex(4)}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Sshd":
        if not Path("/usr/sbin/sshd").exists():
            raise RuntimeError("sshd is not installed (apt install openssh-server; scripts/bootstrap.sh --test does)")
        for key in (self.host_key, self.client_key):
            if not key.exists():
                children.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        authorized = self.root / "authorized_keys"
        shutil.copyfile(f"{self.client_key}.pub", authorized)
        os.chmod(authorized, 0o644)
        if os.geteuid() == 0:
            os.chmod(self.client_key, 0o600)
        host_pub = Path(f"{self.host_key}.pub").read_text().split()
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {host_pub[0]} {host_pub[1]}\n")
        self.config.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {self.host_key}",
            f"AuthorizedKeysFile {authorized}", "StrictModes no",  # /tmp is world-writable
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", f"AllowUsers {self.user}", "Subsystem sftp internal-sftp", "PrintMotd no",
            f"PidFile {self.root / 'sshd.pid'}", "MaxStartups 50", "",
        ]))
        Path("/run/sshd").mkdir(exist_ok=True) if os.geteuid() == 0 else None  # privilege separation
        with open(self.root / "sshd.log", "w") as log:
            self.proc = children.start(["/usr/sbin/sshd", "-D", "-e", "-f", str(self.config)],
                                       stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.root / 'sshd.log').read_text()[-400:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("sshd did not listen within 10 s")

    def connection(self) -> dict:
        return {"host": "127.0.0.1", "port": self.port, "user": self.user, "key": str(self.client_key),
                "known_hosts": str(self.known_hosts)}

    def session_pids(self) -> list[int]:
        """The listener and every process below it (sshd forks a child per connection)."""
        below: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            below.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(below.get(pid, []))
        return out

    def kill(self) -> None:
        """The machine dies: the listener and all its sessions. The listener goes first and is reaped
        (its listening socket closed) before any session dies: a client whose session drops reconnects
        at once and must find nothing listening. Killed in one sweep, that reconnect could reach the
        listener while it was still exiting, be accepted, then reset (an EOF where a real dead machine
        refuses): a CI run saw it once."""
        sessions = self.session_pids()[1:]
        self.proc.kill()
        self.proc.wait()
        for pid in sessions:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        children.end(self.proc)  # and testbed forgets its process group

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        shutil.rmtree(self.work_dir, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)
