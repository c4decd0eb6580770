"""The test suite's network guard: no packet to an address outside loopback.

Installed, it wraps Python's socket calls that can send a packet off this machine (socket's, and
_socket's beneath it): connect, connect_ex, sendto and sendmsg to an IPv4/IPv6 address that is not
loopback (127.0.0.0/8, ::1; 0.0.0.0 and :: mean this host), and a name lookup of anything but a
numeric address, `localhost` or a name /etc/hosts gives a loopback address (a lookup may ask a DNS
server). Each such call is refused with PermissionError before anything is sent, and recorded: in
this process (`take`), and, where the environment names a log file (TESTBED_NETGUARD_LOG), as one
line there, so the test session that set it can fail the test during which any of its processes
dialled out, even if the code under test swallowed the error. Standard library only: it is also loaded as `sitecustomize` by every Python
process the suite starts (testbed/netguard/sitecustomize.py).

What no guard in a Python process can see (C code's own connect, a program that is not Python),
scripts/offline.sh stops: the test command runs pytest in a network namespace with only loopback. A
plain `pytest` runs without it: there every program testbed starts that is not Python is named
(`unpoliced`: one line in the file TESTBED_NETGUARD_UNPOLICED names), and the session says which
programs ran beyond the guard's sight.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import threading

ENV_LOG = "TESTBED_NETGUARD_LOG"
ENV_UNPOLICED = "TESTBED_NETGUARD_UNPOLICED"
_recorded: list[str] = []
_lock = threading.Lock()


def _loopback_names() -> set[str]:
    names = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}
    try:
        with open("/etc/hosts") as f:
            for line in f:
                fields = line.split("#", 1)[0].split()
                if len(fields) > 1 and _is_local_address(fields[0]):
                    names.update(n.lower() for n in fields[1:])
    except OSError:
        pass
    return names


def _is_local_address(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def outside(host) -> bool:
    """Whether dialling or looking up `host` may send a packet off this machine."""
    if host is None or host == "":
        return False
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    host = str(host)
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return not _is_local_address(host)
    except ValueError:
        return host.lower().rstrip(".") not in _LOOPBACK_NAMES


def _process() -> str:
    import sys

    argv = getattr(sys, "argv", None) or ["?"]
    return " ".join(os.path.basename(str(a)) if i == 0 else str(a) for i, a in enumerate(argv[:3]))[:80]


def _refuse(what: str):
    line = f"pid {os.getpid()} ({_process()}): {what}"
    with _lock:
        _recorded.append(line)
    log = os.environ.get(ENV_LOG)
    if log:
        try:
            with open(log, "a") as f:
                f.write(line.replace("\n", " ") + "\n")
        except OSError:
            pass
    raise PermissionError(errno.EACCES, f"testbed network guard: {what} (the tests talk to loopback only)")


def _inet(sock) -> bool:
    return sock.family in (socket.AF_INET, socket.AF_INET6)


# The socket methods that send to an address they are given, what the refusal calls each, and where
# the address is among their arguments (after the socket): connect(address), connect_ex(address),
# sendto(data[, flags], address), sendmsg(buffers[, ancdata[, flags[, address]]]).
_SENDING = {
    "connect": ("connect to", lambda args: args[0] if args else None),
    "connect_ex": ("connect to", lambda args: args[0] if args else None),
    "sendto": ("sendto", lambda args: args[-1] if len(args) >= 2 else None),
    "sendmsg": ("sendmsg to", lambda args: args[3] if len(args) >= 4 else None),
}
_LOOKUPS = ("getaddrinfo", "gethostbyname", "gethostbyname_ex")


def _guarded_method(name, real):
    verb, address_of = _SENDING[name]

    def method(sock, *args):
        address = address_of(args)
        if _inet(sock) and isinstance(address, tuple) and outside(address[0]):
            _refuse(f"{verb} {address[0]}:{address[1]}")
        return real(sock, *args)

    method.__name__ = name
    return method


def _guarded_lookup(real):
    def lookup(host, *args, **kwargs):
        if outside(host) and not _numeric(host):
            _refuse(f"name lookup of {host!r}")
        return real(host, *args, **kwargs)

    lookup.__name__ = real.__name__
    return lookup


class _AnySocket(type):
    """The guarded _socket.socket's type: every socket is still an instance of _socket.socket."""

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.__base__)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, cls.__base__)


def install() -> None:
    """Wrap the socket calls (once per process): socket.socket's, and the C module _socket's beneath
    it, whose socket type cannot be patched in place, so _socket.socket becomes a guarded subclass."""
    import _socket

    # The mark on _socket, not in this module: sitecustomize loads this file under another name than
    # testbed.netguard does, and a process may load both
    if getattr(_socket, "testbed_netguard", False):
        return
    _socket.testbed_netguard = True
    real_type = _socket.socket
    guarded = {name: _guarded_method(name, getattr(real_type, name)) for name in _SENDING}
    for name, method in guarded.items():
        setattr(socket.socket, name, method)
    _socket.socket = _socket.SocketType = _AnySocket("socket", (real_type,), {"__module__": "_socket", **guarded})
    for module in (socket, _socket):
        for name in _LOOKUPS:
            setattr(module, name, _guarded_lookup(getattr(module, name)))


def _numeric(host) -> bool:
    """A numeric address is looked up without asking anyone (its connect is what the guard judges)."""
    try:
        ipaddress.ip_address(str(host.decode() if isinstance(host, bytes) else host).split("%", 1)[0])
        return True
    except ValueError:
        return False


def take() -> list[str]:
    """What this process was refused since the last call (and forget it)."""
    with _lock:
        out = _recorded[:]
        _recorded.clear()
    return out


def is_python(program: str, cwd=None) -> bool:
    """Whether `program` (a path, relative to `cwd`, or a name on PATH) is a Python interpreter or a script
    one runs (its #! line names python): a process the guard, loaded by sitecustomize, is inside of."""
    import shutil
    import sys

    path = os.path.join(cwd or "", program) if os.sep in program else (shutil.which(program) or program)
    name = os.path.basename(path)
    if name.startswith("python") or os.path.realpath(path) == os.path.realpath(sys.executable):
        return True
    try:
        with open(path, "rb") as f:
            first = f.readline(256)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def unpoliced(argv, cwd=None) -> None:
    """Name a program about to start (in `cwd`) that the guard cannot see into (one that is not Python),
    where a session asked (TESTBED_NETGUARD_UNPOLICED) and it does not run in scripts/offline.sh's
    network namespace, where the kernel lets no program out."""
    log = os.environ.get(ENV_UNPOLICED)
    if not log or os.environ.get("TESTBED_NETWORK") == "namespace":
        return
    program = os.fsdecode(argv if isinstance(argv, (str, bytes, os.PathLike)) else argv[0])
    if is_python(program, cwd and os.fsdecode(cwd)):
        return
    try:
        with open(log, "a") as f:
            f.write(os.path.basename(program).replace("\n", " ") + "\n")
    except OSError:
        pass


def install_from_environment() -> None:
    if os.environ.get(ENV_LOG):
        install()


_LOOPBACK_NAMES = _loopback_names()
