"""SSH through paramiko: key authentication, SFTP transfers, and an explicit host-key policy.

The host key is checked against `known_hosts` (an OpenSSH file) or pinned as `host_key_sha256` (the
`SHA256:...` fingerprint `ssh-keygen -lf` prints). An unknown or changed key refuses the connection
with both fingerprints in the message; nothing is ever accepted silently.
"""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import time
from pathlib import Path

from testbed import stop
from testbed.devices.transport import CommandResult, ConnectionLost, RemoteShell, TransferError
from testbed.errors import DeviceUnreachable


def key_fingerprint(key) -> str:
    """OpenSSH's SHA256 fingerprint of a paramiko key: SHA256:base64(sha256(blob)) without padding."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


# What runs on the device around every command. sshd gives each command a session of its own, whose
# input is the channel's; testbed never writes to it, so it reaches its end only when the channel
# closes: testbed gave up on the command (a timeout, a stop), or died, or the link broke. A watcher
# waits for that end and kills every process of the session, the command's included (a program run
# over SSH dies with testbed, as one run over ADB does with its stream). The command itself reads
# /dev/null, as it did when the input was closed at once; when it ends first, the watcher goes too.
WATCHED = """exec 3<&0 </dev/null
(read -r _ <&3; pkill -KILL -s 0 || kill -KILL 0) >/dev/null 2>&1 &
watcher=$!
exec 3<&-
{{ {script}
}}
status=$?
kill "$watcher" 2>/dev/null
exit "$status"
"""


class SshTransport(RemoteShell):
    kind = "ssh"

    def __init__(self, name: str, work_dir: str, connection: dict, connect_timeout: float = 5.0,
                 stall_timeout: float = 60.0):
        super().__init__(name, work_dir)
        self.host = connection["host"]
        self.port = int(connection.get("port") or 22)
        self.user = connection["user"]
        self.key = os.path.expanduser(connection["key"])
        self.known_hosts = os.path.expanduser(connection.get("known_hosts") or "")
        self.pinned = connection.get("host_key_sha256") or ""
        self.connect_timeout = connect_timeout
        self.stall_timeout = stall_timeout  # the longest a transfer may go without progress
        self.client = None
        self.sftp = None

    def _open(self) -> None:
        import paramiko

        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small packets go out at once
        except OSError as e:
            raise DeviceUnreachable(f"{self.name}: nothing answers at {self.host}:{self.port} ({e.strerror or e})") from None
        client = paramiko.SSHClient()
        if self.known_hosts:
            if not Path(self.known_hosts).exists():
                raise DeviceUnreachable(f"{self.name}: known_hosts file {self.known_hosts} does not exist")
            client.load_host_keys(self.known_hosts)
        client.set_missing_host_key_policy(_PinnedOrReject(self.pinned))
        try:
            client.connect(self.host, self.port, username=self.user, key_filename=self.key, sock=sock,
                           timeout=self.connect_timeout, auth_timeout=self.connect_timeout,
                           banner_timeout=self.connect_timeout, allow_agent=False, look_for_keys=False)
            sftp = client.open_sftp()
        except paramiko.BadHostKeyException as e:
            client.close()
            raise DeviceUnreachable(f"{self.name}: host key of {self.host}:{self.port} CHANGED: it offers "
                                    f"{key_fingerprint(e.key)}, {self.known_hosts} expects "
                                    f"{key_fingerprint(e.expected_key)}; refusing") from None
        except paramiko.SSHException as e:
            client.close()
            raise DeviceUnreachable(f"{self.name}: {self.user}@{self.host}:{self.port}: {e}") from None
        except (OSError, EOFError) as e:  # a server that dies mid-handshake ends the stream: EOFError
            client.close()
            raise DeviceUnreachable(f"{self.name}: {self.host}:{self.port}: {type(e).__name__}: {e}") from None
        self.client, self.sftp = client, sftp
        self.sftp.get_channel().settimeout(self.stall_timeout)

    def _close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.client = self.sftp = None

    def _exec(self, script: str, host_timeout: float) -> CommandResult:
        import paramiko

        chan = None
        try:
            chan = self.client.get_transport().open_session(timeout=self.connect_timeout)
            chan.exec_command(WATCHED.format(script=script))
            out, err = bytearray(), bytearray()
            deadline = time.monotonic() + host_timeout
            while True:
                if chan.recv_ready():
                    out += chan.recv(65536)
                elif chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                elif chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                elif chan.closed or not self.client.get_transport().is_active():
                    raise ConnectionLost("the SSH session closed before the command's exit status")
                elif time.monotonic() > deadline:
                    chan.close()
                    raise TimeoutError(f"no exit status within {host_timeout:g} s")
                elif stop.STOP.is_set():  # a signal (testbed.stop): give the command up now
                    chan.close()
                    stop.raise_if_stopped()
                else:
                    time.sleep(0.002)
            rc = chan.recv_exit_status()
        except (paramiko.SSHException, EOFError, OSError, AttributeError) as e:
            raise ConnectionLost(f"{type(e).__name__}: {e}") from None
        finally:
            if chan is not None:  # the end of the command's input: its watcher kills what is left of it
                try:
                    chan.close()
                except (paramiko.SSHException, EOFError, OSError):
                    pass  # the link is gone: the device saw the input end with it
        if rc == -1:
            raise ConnectionLost("the command ended without an exit status (killed with the session?)")
        return CommandResult(rc, out.decode(errors="replace"), err.decode(errors="replace"))

    def _send(self, local: Path, path: str, mode: int) -> None:
        import paramiko

        try:
            self.sftp.put(str(local), path)
            self.sftp.chmod(path, mode)
        except (EOFError, socket.timeout, ConnectionError, paramiko.SSHException) as e:
            raise ConnectionLost(f"{type(e).__name__}: {e}") from None
        except OSError as e:  # SFTP status errors (no space, permission) arrive as IOError
            if self.client is None or not self.client.get_transport().is_active():
                raise ConnectionLost(f"{type(e).__name__}: {e}") from None
            raise TransferError(f"{self.name}: the device refused {path}: {e}") from None

    def _recv(self, path: str, local: Path) -> None:
        import paramiko

        try:
            self.sftp.get(path, str(local))
        except (EOFError, socket.timeout, ConnectionError, paramiko.SSHException) as e:
            raise ConnectionLost(f"{type(e).__name__}: {e}") from None
        except OSError as e:
            if self.client is None or not self.client.get_transport().is_active():
                raise ConnectionLost(f"{type(e).__name__}: {e}") from None
            raise TransferError(f"{self.name}: cannot read {path}: {e}") from None


class _PinnedOrReject:
    """paramiko's policy for a host key not in known_hosts: accept only the pinned fingerprint."""

    def __init__(self, pinned: str):
        self.pinned = pinned

    def missing_host_key(self, client, hostname, key):
        import paramiko

        offered = key_fingerprint(key)
        if self.pinned and offered == self.pinned:
            return
        why = f"pinned host_key_sha256 is {self.pinned}" if self.pinned else "it is not in known_hosts"
        raise paramiko.SSHException(f"unknown host key {offered} ({key.get_name()}); {why}; refusing")
