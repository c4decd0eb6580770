"""ADB through adb-shell, over TCP (host:port) or USB (a serial, or the only phone attached).

Authentication uses the usual ~/.android/adbkey (created with its .pub if absent, as Debian's adb
does), so a phone that trusts this computer's adb trusts testbed too.

adb-shell speaks shell v1 only: no exit code and stderr merged into stdout. So each script is framed
  { SCRIPT ; } 2>WORK/.tb-stderr-NONCE; rc=$?; printf '\\n%s%s\\n' __TB_NONCE_RC= "$rc"; cat that file
and the exit code, stdout and stderr are cut apart at the marker, which carries a fresh random nonce
per call so program output cannot fake it.
"""

from __future__ import annotations

import base64
import os
import secrets
import shlex
import socket
import time
from pathlib import Path

from testbed.devices.transport import CommandResult, ConnectionLost, RemoteShell, TransferError
from testbed.errors import DeviceUnreachable

DEFAULT_KEY = "~/.android/adbkey"
USB_DEVICES = Path("/sys/bus/usb/devices")


def ensure_adb_key(path: str = DEFAULT_KEY) -> Path:
    """The adb RSA key pair (private key PEM + Android-format .pub), as Debian's adb keeps it.

    The private key is never overwritten: it is what every phone trusts. A missing one is created
    0600 from its first byte (O_EXCL, so a concurrent `adb` or testbed that creates it first wins and
    its key is used). The public half is always derived from the private key on disk, so a .pub that
    is missing or belongs to another key (two writers racing) is rebuilt rather than trusted."""
    from adb_shell.auth.keygen import encode_pubkey, get_user_info
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = Path(os.path.expanduser(path))
    key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # the leaf only; the umask can only take away
    if not key.exists():
        pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        try:
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass  # another writer made it first: use theirs
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
                f.flush()
                os.fsync(f.fileno())
    for _ in range(50):  # a concurrent writer may still be filling the private key in
        try:
            public = base64.b64encode(encode_pubkey(str(key))) + get_user_info().encode()
            break
        except ValueError:
            time.sleep(0.1)
    else:
        raise DeviceUnreachable(f"{key} is not a PEM RSA private key; adb keys are made by `adb keygen {key}`")
    pub = key.with_name(key.name + ".pub")
    current = pub.read_bytes().split(b" ")[0] if pub.is_file() else b""
    if current != public.split(b" ")[0]:
        tmp = pub.with_name(f"{pub.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        os.fchmod(fd, 0o644)  # 0644 whatever the umask (under umask 000, open's mode alone gives it)
        with os.fdopen(fd, "wb") as f:
            f.write(public)
        os.replace(tmp, pub)
    return key


def usb_adb_serials() -> list[str]:
    """Serial numbers of attached USB devices that expose an ADB interface (class ff, subclass 42,
    protocol 01), read from sysfs so no USB library is needed to say whether a phone is there."""
    serials = []
    for iface in USB_DEVICES.glob("*:*"):
        try:
            triple = tuple((iface / f).read_text().strip() for f in
                           ("bInterfaceClass", "bInterfaceSubClass", "bInterfaceProtocol"))
        except OSError:
            continue
        if triple == ("ff", "42", "01"):
            serial = iface.parent / "serial"
            serials.append(serial.read_text().strip() if serial.exists() else "?")
    return sorted(set(serials))


def _tcp_transport(host: str, port: int):
    """adb-shell's TCP transport with two fixes. A closed socket is an error at once: adb-shell reads
    the empty bytes of a dead connection as "no data yet" and spins until its read timeout, which
    would report a device that died as a command that timed out. And Nagle's algorithm is off: a
    packet goes out as a header write then a payload write, and the payload would otherwise wait
    for the device's delayed ACK (~40 ms on every command)."""
    from adb_shell.transport.tcp_transport import TcpTransport

    class EofAwareTcpTransport(TcpTransport):
        def connect(self, transport_timeout_s):
            super().connect(transport_timeout_s)
            self._connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def bulk_read(self, numbytes, transport_timeout_s):
            data = super().bulk_read(numbytes, transport_timeout_s)
            if not data:
                raise ConnectionResetError(f"{host}:{port} closed the connection")
            return data

    return EofAwareTcpTransport(host, port)


class AdbTransport(RemoteShell):
    kind = "adb"

    def __init__(self, name: str, work_dir: str, connection: dict, connect_timeout: float = 5.0,
                 stall_timeout: float = 60.0):
        super().__init__(name, work_dir)
        self.host = connection.get("host") or ""
        self.port = int(connection.get("port") or 5555)
        self.serial = connection.get("serial") or ""
        self.key_path = connection.get("key") or DEFAULT_KEY
        self.auth_timeout = float(connection.get("auth_timeout_s") or 10.0)
        self.connect_timeout = connect_timeout
        self.stall_timeout = stall_timeout  # the longest a transfer may go without progress
        self.dev = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}" if self.host else f"usb:{self.serial or 'any'}"

    def _open(self) -> None:
        from adb_shell import exceptions as ex
        from adb_shell.auth.sign_cryptography import CryptographySigner

        signer = CryptographySigner(str(ensure_adb_key(self.key_path)))
        dev = self._tcp() if self.host else self._usb()
        try:
            dev.connect(rsa_keys=[signer], transport_timeout_s=self.connect_timeout,
                        auth_timeout_s=self.auth_timeout, read_timeout_s=self.connect_timeout)
        except (ex.InvalidCommandError, ex.InvalidChecksumError) as e:
            dev.close()
            raise DeviceUnreachable(f"{self.name}: {self.address} answered, but not as an adb device "
                                    f"({str(e)[:120]})") from None
        except (ex.DeviceAuthError, ex.InvalidResponseError, ex.AdbTimeoutError, ex.TcpTimeoutException,
                OSError) as e:
            dev.close()
            raise DeviceUnreachable(
                f"{self.name}: {self.address} answered but did not accept the key {self.key_path}.pub "
                f"({type(e).__name__}: {e or 'no reply'}); allow USB debugging from this computer on the device"
            ) from None
        self.dev = dev

    def _tcp(self):
        from adb_shell.adb_device import AdbDevice

        try:
            socket.create_connection((self.host, self.port), timeout=self.connect_timeout).close()
        except OSError as e:
            raise DeviceUnreachable(f"{self.name}: nothing answers at {self.host}:{self.port} "
                                    f"({e.strerror or e}); is adbd listening (adb tcpip) and the address right?") from None
        return AdbDevice(_tcp_transport(self.host, self.port), default_transport_timeout_s=self.connect_timeout)

    def _usb(self):
        attached = usb_adb_serials()
        if not attached:
            raise DeviceUnreachable(f"{self.name}: no USB device with an ADB interface is attached (checked "
                                    f"{USB_DEVICES}); plug the phone in with USB debugging on, or set "
                                    f"connection.host for adb over TCP")
        if self.serial and self.serial not in attached:
            raise DeviceUnreachable(f"{self.name}: no USB device with serial {self.serial!r}; attached: "
                                    f"{', '.join(attached)}")
        try:
            from adb_shell.adb_device import AdbDeviceUsb
            import usb1  # noqa: F401 -- adb-shell's USB transport needs it
        except ImportError:
            raise DeviceUnreachable(f"{self.name}: a phone is attached ({', '.join(attached)}) but adb-shell's USB "
                                    f"support is missing: pip install 'adb-shell[usb]'") from None
        return AdbDeviceUsb(serial=self.serial or None, default_transport_timeout_s=self.connect_timeout)

    def _close(self) -> None:
        if self.dev is not None:
            self.dev.close()
            self.dev = None

    def _errors(self):
        from adb_shell import exceptions as ex

        lost = (OSError, ex.InvalidResponseError, ex.InvalidCommandError, ex.AdbConnectionError,
                ex.InvalidChecksumError, ex.TcpTimeoutException)
        timeout = (ex.AdbTimeoutError,)
        return lost, timeout

    def _exec(self, script: str, host_timeout: float) -> CommandResult:
        nonce = secrets.token_hex(8)
        marker = f"__TB_{nonce}_RC="
        errfile = shlex.quote(f"{self.work_dir}/.tb-stderr-{nonce}")
        framed = (f"mkdir -p {shlex.quote(self.work_dir)} 2>/dev/null; {{ {script} ; }} 2>{errfile}; rc=$?; "
                  f"printf '\\n%s%s\\n' {marker} \"$rc\"; cat {errfile} 2>/dev/null; rm -f {errfile}")
        lost, timeout = self._errors()
        try:
            raw = self.dev.shell(framed, timeout_s=host_timeout, read_timeout_s=host_timeout,
                                 transport_timeout_s=host_timeout, decode=False)
        except timeout as e:
            raise TimeoutError(str(e)) from None
        except lost as e:
            raise ConnectionLost(f"{type(e).__name__}: {e}") from None
        text = raw.decode(errors="replace")
        cut = text.rfind("\n" + marker)
        if cut < 0:
            raise ConnectionLost(f"the shell ended without an exit status (output ended: {text[-200:]!r})")
        rc_text, _, stderr = text[cut + 1 + len(marker):].partition("\n")
        return CommandResult(int(rc_text), text[:cut], stderr)

    def _send(self, local: Path, path: str, mode: int) -> None:
        from adb_shell import exceptions as ex

        lost, timeout = self._errors()
        try:
            self.dev.push(str(local), path, st_mode=0o100000 | mode, transport_timeout_s=self.stall_timeout,
                          read_timeout_s=self.stall_timeout)
        except ex.PushFailedError as e:  # the device refused (full, read-only): retrying will not help
            raise TransferError(f"{self.name}: the device refused {path}: {_text(e)}") from None
        except timeout + lost as e:
            raise ConnectionLost(f"{type(e).__name__}: {e}") from None

    def _recv(self, path: str, local: Path) -> None:
        from adb_shell import exceptions as ex

        lost, timeout = self._errors()
        try:
            self.dev.pull(path, str(local), transport_timeout_s=self.stall_timeout,
                          read_timeout_s=self.stall_timeout)
        except ex.AdbCommandFailureException as e:
            raise TransferError(f"{self.name}: the device refused to send {path}: {_text(e)}") from None
        except timeout + lost as e:
            raise ConnectionLost(f"{type(e).__name__}: {e}") from None


def _text(error: Exception) -> str:
    arg = error.args[0] if error.args else ""
    return arg.decode(errors="replace") if isinstance(arg, (bytes, bytearray)) else str(arg)
