"""ADB through an adb server (what `adb -H HOST -P PORT -s SERIAL` talks to), beside adb-shell's direct link.

The usual way to reach phones attached to another host, and the way to share USB with the system's
`adb`: only one program may own a phone's USB interface, and on most machines that is the adb
server. A profile selects it with `connection: {server: "HOST:PORT", serial: SERIAL}` (the serial
as `adb devices` lists it; empty: the only device the server has).

The server's protocol (adb's SERVICES.TXT and protocol.txt): a request is its length as four hex
digits then the text; the answer is OKAY, or FAIL with a hex length and a message. A connection is
bound to one device by `host:transport:SERIAL` and then carries one service: `shell:SCRIPT` (shell v1,
one byte stream until the device closes it) or `sync:` (STAT/SEND/RECV/DATA/DONE/QUIT frames of a
four-byte id and a little-endian uint32). This module speaks that protocol in the shape of adb-shell's
AdbDevice (shell, push, pull, close), so AdbTransport's framing of exit codes and stderr, its
transfer checks and its error handling serve both links unchanged.
"""

from __future__ import annotations

import os
import socket
import struct

from testbed.devices.adb import AdbTransport
from testbed.errors import DeviceUnreachable

SYNC_CHUNK = 64 * 1024  # the largest DATA frame a device accepts


class ServerFailed(ConnectionError):
    """The adb server answered FAIL (an unknown serial, a device gone offline): the link is lost."""


class ServerDevice:
    """One device as an adb server offers it, with adb-shell's AdbDevice methods and exceptions."""

    def __init__(self, host: str, port: int, serial: str, connect_timeout: float):
        self.host, self.port, self.serial = host, port, serial
        self.connect_timeout = connect_timeout

    # -- the smart-socket protocol ----------------------------------------------------------------
    def _request(self, sock: socket.socket, text: str) -> None:
        data = text.encode()
        sock.sendall(b"%04x" % len(data) + data)
        status = _read(sock, 4)
        if status == b"FAIL":
            raise ServerFailed(_read(sock, int(_read(sock, 4), 16)).decode(errors="replace"))
        if status != b"OKAY":
            raise ConnectionError(f"the adb server answered {status!r}, not OKAY or FAIL")

    def _service(self, service: str, timeout: float) -> socket.socket:
        """A connection to the server, bound to the device, carrying `service`."""
        sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        try:
            sock.settimeout(timeout)
            self._request(sock, f"host:transport:{self.serial}" if self.serial else "host:transport-any")
            self._request(sock, service)
        except BaseException:
            sock.close()
            raise
        return sock

    def state(self) -> str:
        """The device's state as the server sees it (device, offline, unauthorized); ServerFailed if
        the server has no such device."""
        with socket.create_connection((self.host, self.port), timeout=self.connect_timeout) as sock:
            sock.settimeout(self.connect_timeout)
            self._request(sock, f"host-serial:{self.serial}:get-state" if self.serial else "host:get-state")
            return _read(sock, int(_read(sock, 4), 16)).decode()

    # -- adb-shell's AdbDevice interface, as AdbTransport calls it --------------------------------
    def shell(self, command: str, timeout_s: float, read_timeout_s: float, transport_timeout_s: float,
              decode: bool = False) -> bytes:
        from adb_shell.exceptions import AdbTimeoutError

        try:
            with self._service(f"shell:{command}", timeout_s) as sock:
                chunks = []
                while chunk := sock.recv(1 << 16):
                    chunks.append(chunk)
        except socket.timeout:
            raise AdbTimeoutError(f"no answer from {self.serial or 'the device'} within {timeout_s:g} s") from None
        return b"".join(chunks)

    def push(self, local: str, path: str, st_mode: int, transport_timeout_s: float, read_timeout_s: float) -> None:
        from adb_shell.exceptions import AdbTimeoutError, PushFailedError

        header = f"{path},{st_mode}".encode()
        try:
            with self._service("sync:", transport_timeout_s) as sock, open(local, "rb") as f:
                sock.sendall(b"SEND" + struct.pack("<I", len(header)) + header)
                while block := f.read(SYNC_CHUNK):
                    sock.sendall(b"DATA" + struct.pack("<I", len(block)) + block)
                sock.sendall(b"DONE" + struct.pack("<I", int(os.path.getmtime(local))))
                status, size = _frame(sock)
                message = _read(sock, size) if status == b"FAIL" else b""
                sock.sendall(b"QUIT" + struct.pack("<I", 0))
        except socket.timeout:
            raise AdbTimeoutError(f"a push to {path} made no progress in {transport_timeout_s:g} s") from None
        if status != b"OKAY":
            raise PushFailedError(message or status)

    def pull(self, path: str, local: str, transport_timeout_s: float, read_timeout_s: float) -> None:
        from adb_shell.exceptions import AdbCommandFailureException, AdbTimeoutError

        data = path.encode()
        try:
            with self._service("sync:", transport_timeout_s) as sock, open(local, "wb") as f:
                sock.sendall(b"RECV" + struct.pack("<I", len(data)) + data)
                while True:
                    status, size = _frame(sock)
                    if status == b"DATA":
                        f.write(_read(sock, size))
                    elif status == b"DONE":
                        break
                    elif status == b"FAIL":
                        raise AdbCommandFailureException(_read(sock, size))
                    else:
                        raise ConnectionError(f"the sync stream sent {status!r}")
                sock.sendall(b"QUIT" + struct.pack("<I", 0))
        except socket.timeout:
            raise AdbTimeoutError(f"a pull of {path} made no progress in {transport_timeout_s:g} s") from None

    def close(self) -> None:
        pass  # every service has its own connection, closed when it ends


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("the adb server closed the connection")
        data += chunk
    return data


def _frame(sock: socket.socket) -> tuple[bytes, int]:
    head = _read(sock, 8)
    return head[:4], struct.unpack("<I", head[4:])[0]


class AdbServerTransport(AdbTransport):
    """AdbTransport whose link is an adb server instead of adb-shell's own USB or TCP connection."""

    def __init__(self, name: str, work_dir: str, connection: dict, connect_timeout: float = 5.0,
                 stall_timeout: float = 60.0):
        super().__init__(name, work_dir, connection, connect_timeout, stall_timeout)
        self.server = connection["server"]
        host, _, port = self.server.rpartition(":")
        self.server_host, self.server_port = host, int(port)

    @property
    def address(self) -> str:
        return f"{self.serial or 'the only device'} via the adb server {self.server}"

    def _open(self) -> None:
        dev = ServerDevice(self.server_host, self.server_port, self.serial, self.connect_timeout)
        try:
            state = dev.state()
        except ServerFailed as e:
            raise DeviceUnreachable(f"{self.name}: the adb server at {self.server} says: {e}; "
                                    f"`adb -H HOST -P PORT devices` lists the devices it has") from None
        except OSError as e:
            raise DeviceUnreachable(f"{self.name}: no adb server answers at {self.server} ({e.strerror or e}); "
                                    f"start one there (`adb -a start-server` to serve other hosts)") from None
        if state != "device":
            raise DeviceUnreachable(f"{self.name}: the adb server at {self.server} lists {self.serial or 'the device'} "
                                    f"as {state!r}, not 'device' (allow USB debugging on it?)")
        self.dev = dev
