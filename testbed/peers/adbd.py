"""A loopback adbd: the device side of the ADB wire protocol, serving a sandbox folder as a phone.

No device-side adbd exists for Linux, so the test suite brings its own. It speaks what real clients
(adb-shell and Debian's `adb`) speak, and the suite drives it with both, so its behaviour is checked
against two independent implementations rather than against itself:

  packets     six little-endian uint32 (command, arg0, arg1, length, byte-sum checksum, magic), payload
  CNXN        version and max payload are the minimum of both sides; the banner carries getprop-style
              properties and the features (shell_v2, cmd)
  AUTH        a 20-byte token; the client answers with an RSA PKCS#1 v1.5 signature over it (as a SHA-1
              digest), or offers its public key, which is accepted only with --auth=accept
  streams     OPEN -> OKAY(local, remote); every WRTE is acknowledged by OKAY before the next one on
              that stream; CLSE is echoed; closing a stream (or the connection) kills its processes
  shell:      v1: one raw byte stream (stdout and stderr merged, no exit code); shell,v2,...: packets
              of id (stdin 0, stdout 1, stderr 2, exit 3, close-stdin 4) + uint32 length + data
  sync:       a byte stream of requests: STAT, LIST (DENT... DONE), SEND path,mode (DATA... DONE ->
              OKAY | FAIL), RECV (DATA chunks <= 64 KiB, DONE | FAIL), QUIT

The device's filesystem is one folder: device paths under --device-root (default /data/local/tmp)
map into --sandbox; anything else does not exist. Shell commands run with /bin/sh in the sandbox, with
the device root spelled as the sandbox path (the command text is rewritten, and output rewritten
back), a `getprop` answering from --prop values, and an exec shim that runs ARM, AArch64 and Hexagon
ELF binaries under qemu-user (the job binfmt_misc does on a real Linux host, which a test machine may not have).

Faults for the test suite: --quota (a full device: SEND fails with ENOSPC), --corrupt-recv N (flip a
byte in the first N pulls), --drop-after-bytes N (cut the connection once after N pushed bytes).

  python -m testbed.peers.adbd --sandbox DIR [--port 0] [--auth none|keys|accept] ...
prints "adbd listening on 127.0.0.1:PORT" once it accepts connections.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import posixpath
import queue
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from testbed import PROJECT_ROOT, children

# Commands are their four ASCII letters read as a little-endian uint32.


def _cmd(name: bytes) -> int:
    return struct.unpack("<I", name)[0]


CNXN, AUTH, OPEN, OKAY, CLSE, WRTE = (_cmd(n) for n in (b"CNXN", b"AUTH", b"OPEN", b"OKAY", b"CLSE", b"WRTE"))
VERSION = 0x01000001
MAX_PAYLOAD = 1024 * 1024
AUTH_TOKEN, AUTH_SIGNATURE, AUTH_RSAPUBLICKEY = 1, 2, 3
SYNC_DATA_MAX = 64 * 1024
SHELL_STDIN, SHELL_STDOUT, SHELL_STDERR, SHELL_EXIT, SHELL_CLOSE_STDIN = 0, 1, 2, 3, 4
# DigestInfo of a SHA-1 hash: what precedes the 20 token bytes inside an adb AUTH signature.
SHA1_DIGEST_INFO = bytes.fromhex("3021300906052b0e03021a05000414")


class ProtocolError(Exception):
    pass


# --- RSA keys in Android's format ------------------------------------------------------------------


def parse_android_pubkey(text: bytes) -> tuple[int, int]:
    """(modulus, exponent) from an adbkey.pub line: base64 of {u32 words, u32 n0inv, modulus[256] LE,
    rr[256] LE, u32 exponent}, then an optional ' user@host'."""
    blob = base64.b64decode(text.split(b"\0")[0].split()[0])
    words, _n0inv, modulus, _rr, exponent = struct.unpack("<II256s256sI", blob)
    if words != 64:
        raise ProtocolError(f"public key has {words} words; adb keys are 2048-bit (64 words)")
    return int.from_bytes(modulus, "little"), exponent


def signature_matches(key: tuple[int, int], token: bytes, signature: bytes) -> bool:
    """RSA PKCS#1 v1.5 verification of `signature` over `token` taken as a SHA-1 digest."""
    n, e = key
    size = (n.bit_length() + 7) // 8
    if len(signature) != size:
        return False
    block = pow(int.from_bytes(signature, "big"), e, n).to_bytes(size, "big")
    padding = size - 3 - len(SHA1_DIGEST_INFO) - len(token)
    return block == b"\x00\x01" + b"\xff" * padding + b"\x00" + SHA1_DIGEST_INFO + token


# --- the exec shim: ARM binaries under qemu-user ---------------------------------------------------

EXEC_SHIM_C = r"""
/* Preloaded into the fake device's shell: an exec of an ELF for another machine becomes an exec of
   the qemu-user emulator named by $TB_QEMU_<e_machine>, which is what binfmt_misc would do. A
   dynamically linked program finds its loader and libraries under $TB_QEMU_LD_<e_machine> (qemu -L),
   the emulated program does not inherit this host library as its own LD_PRELOAD (qemu -U), and with
   $TB_QEMU_PLUGIN set it runs under that plugin (testbed's instruction counter: this emulated phone's
   performance counter). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern char **environ;
typedef int (*execve_fn)(const char *, char *const[], char *const[]);

static int elf_machine(const char *path) {
    unsigned char h[20];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, h, sizeof h);
    close(fd);
    if (n < (ssize_t)sizeof h || memcmp(h, "\177ELF", 4) != 0) return -1;
    return h[18] | (h[19] << 8);
}

static const char *setting(const char *prefix, int machine) {
    char name[40];
    snprintf(name, sizeof name, "%s%d", prefix, machine);
    return getenv(name);
}

static int run(const char *path, char *const argv[], char *const envp[]) {
    execve_fn real = (execve_fn)dlsym(RTLD_NEXT, "execve");
    int machine = elf_machine(path);
    const char *qemu = machine < 0 ? NULL : setting("TB_QEMU_", machine);
    if (!qemu) return real(path, argv, envp);
    const char *sysroot = setting("TB_QEMU_LD_", machine);
    int argc = 0;
    while (argv[argc]) argc++;
    char **args = calloc(argc + 9, sizeof *args);
    int a = 0;
    args[a++] = (char *)qemu;
    args[a++] = "-U";
    args[a++] = "LD_PRELOAD";
    const char *plugin = getenv("TB_QEMU_PLUGIN");
    if (plugin) {
        args[a++] = "-plugin";
        args[a++] = (char *)plugin;
    }
    if (sysroot) {
        args[a++] = "-L";
        args[a++] = (char *)sysroot;
    }
    args[a++] = (char *)path;
    for (int i = 1; i < argc; i++) args[a++] = argv[i];
    return real(qemu, args, envp);
}

int execve(const char *path, char *const argv[], char *const envp[]) { return run(path, argv, envp); }
int execv(const char *path, char *const argv[]) { return run(path, argv, environ); }
int execvp(const char *file, char *const argv[]) {
    if (strchr(file, '/')) return run(file, argv, environ);
    int (*real)(const char *, char *const[]) = dlsym(RTLD_NEXT, "execvp");
    return real(file, argv);
}
"""

# ELF e_machine: ARM, AArch64, Hexagon ("QUALCOMM DSP6": static hexagon-linux-musl programs)
EMULATORS = {40: "qemu-arm", 183: "qemu-aarch64", 164: "qemu-hexagon"}
# Debian's cross sysroots (libc6-armhf-cross, libc6-arm64-cross): the loader and libraries of
# dynamically linked ARM programs, such as the aarch64 IREE tools from the manylinux wheel.
SYSROOTS = {40: "/usr/arm-linux-gnueabihf", 183: "/usr/aarch64-linux-gnu"}


def build_exec_shim() -> Path:
    """Compile the shim once per content (cached under .cache/)."""
    digest = hashlib.sha256(EXEC_SHIM_C.encode()).hexdigest()[:16]
    out = PROJECT_ROOT / ".cache" / "adbd" / f"execshim-{digest}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        src = out.with_suffix(".c")
        src.write_text(EXEC_SHIM_C)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        children.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(tmp), str(src), "-ldl"], check=True)
        tmp.replace(out)
    return out


# --- the device -----------------------------------------------------------------------------------


class FakeDevice:
    """Everything that outlives one connection: the sandbox, properties, keys and fault settings."""

    def __init__(self, args):
        self.sandbox = Path(args.sandbox).resolve()
        self.sandbox.mkdir(parents=True, exist_ok=True)
        self.device_root = args.device_root.rstrip("/")
        self.props = dict(p.split("=", 1) for p in args.prop)
        self.auth = args.auth
        self.keys = [parse_android_pubkey(line) for f in args.authorized_keys
                     for line in Path(f).read_bytes().splitlines() if line.strip()]
        self.quota = args.quota
        self.corrupt_recv = args.corrupt_recv
        self.drop_after_bytes = args.drop_after_bytes
        self.lock = threading.Lock()
        self.bin = self.sandbox.parent / (self.sandbox.name + ".bin")
        self.bin.mkdir(exist_ok=True)
        self._write_getprop()
        self.env = self._shell_env()

    def banner(self) -> bytes:
        props = ";".join(f"{k}={self.props.get(k, '')}" for k in
                         ("ro.product.name", "ro.product.model", "ro.product.device"))
        return f"device::{props};features=shell_v2,cmd".encode()

    def _write_getprop(self) -> None:
        table = self.bin / "props"
        table.write_text("".join(f"{k}={v}\n" for k, v in sorted(self.props.items())))
        getprop = self.bin / "getprop"
        getprop.write_text(
            "#!/bin/sh\n"
            "# getprop: all properties as [key]: [value], or one value\n"
            f'if [ $# -eq 0 ]; then sed "s/^\\([^=]*\\)=\\(.*\\)$/[\\1]: [\\2]/" {self.bin}/props; exit 0; fi\n'
            f'grep -F -- "$1=" {self.bin}/props | while IFS= read -r line; do\n'
            '  case "$line" in "$1="*) printf "%s\\n" "${line#*=}";; esac\n'
            "done\n"
        )
        getprop.chmod(0o755)

    def _shell_env(self) -> dict[str, str]:
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": str(self.sandbox), "LANG": "C"}
        host_machine = os.uname().machine
        emulators = {m: shutil.which(q) for m, q in EMULATORS.items()
                     if not (q == "qemu-arm" and host_machine.startswith("arm"))
                     and not (q == "qemu-aarch64" and host_machine == "aarch64")}
        if any(emulators.values()):
            from testbed.measure.counts import qemu_plugin_args

            env["LD_PRELOAD"] = str(build_exec_shim())
            env["TB_QEMU_PLUGIN"] = qemu_plugin_args()[1]
            env.update({f"TB_QEMU_{m}": path for m, path in emulators.items() if path})
            env.update({f"TB_QEMU_LD_{m}": SYSROOTS[m] for m, path in emulators.items()
                        if path and m in SYSROOTS and os.path.isdir(SYSROOTS[m])})
        return env

    # Device paths <-> sandbox paths.
    def local_path(self, device_path: str) -> Path | None:
        p = posixpath.normpath(device_path)
        if p == self.device_root:
            return self.sandbox
        if not p.startswith(self.device_root + "/"):
            return None
        return self.sandbox / p[len(self.device_root) + 1:]

    def to_host_text(self, command: str) -> str:
        return command.replace(self.device_root, str(self.sandbox))

    def to_device_text(self, data: bytes) -> bytes:
        return data.replace(str(self.sandbox).encode(), self.device_root.encode())

    def used_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.sandbox.rglob("*") if f.is_file())


# --- one connection ---------------------------------------------------------------------------------


class StreamClosed(Exception):
    pass


class Stream:
    """One OPENed service: inbound WRTE payloads queue up; outbound writes wait for each OKAY."""

    def __init__(self, conn: "Connection", local_id: int, remote_id: int):
        self.conn, self.local_id, self.remote_id = conn, local_id, remote_id
        self.inbox: queue.Queue[bytes | None] = queue.Queue()
        self.acked = threading.Event()
        self.closed = threading.Event()
        self.procs: list[subprocess.Popen] = []
        self._pending = b""

    def write(self, data: bytes) -> None:
        for i in range(0, len(data), self.conn.max_payload):
            if self.closed.is_set():
                raise StreamClosed
            self.acked.clear()
            self.conn.send(WRTE, self.local_id, self.remote_id, data[i:i + self.conn.max_payload])
            while not self.acked.wait(0.5):
                if self.closed.is_set():
                    raise StreamClosed

    def read(self) -> bytes | None:
        """The next inbound payload, or None once the client closed the stream."""
        return None if self.closed.is_set() and self.inbox.empty() else self.inbox.get()

    def read_exact(self, n: int) -> bytes:
        while len(self._pending) < n:
            chunk = self.read()
            if chunk is None:
                raise StreamClosed
            self._pending += chunk
        out, self._pending = self._pending[:n], self._pending[n:]
        return out

    def close(self) -> None:
        """Our side is done: tell the client (once) and stop our processes."""
        if not self.closed.is_set():
            self.closed.set()
            self.conn.send(CLSE, self.local_id, self.remote_id)
        self.kill()

    def client_closed(self) -> None:
        already = self.closed.is_set()
        self.closed.set()
        self.acked.set()
        self.inbox.put(None)
        self.kill()
        if not already:
            self.conn.send(CLSE, self.local_id, self.remote_id)

    def kill(self) -> None:
        for p in self.procs:  # each program's whole session: `timeout` on the command line makes a group of its own
            children.kill(p)


class Connection:
    def __init__(self, sock: socket.socket, device: FakeDevice):
        self.sock, self.device = sock, device
        self.send_lock = threading.Lock()
        self.streams: dict[int, Stream] = {}
        self.next_id = 1
        self.max_payload = MAX_PAYLOAD
        self.version = VERSION

    def send(self, cmd: int, arg0: int, arg1: int, data: bytes = b"") -> None:
        header = struct.pack("<6I", cmd, arg0, arg1, len(data), sum(data) & 0xFFFFFFFF, cmd ^ 0xFFFFFFFF)
        with self.send_lock:
            self.sock.sendall(header + data)

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionResetError("client went away")
            buf += chunk
        return bytes(buf)

    def recv(self) -> tuple[int, int, int, bytes]:
        cmd, arg0, arg1, length, checksum, magic = struct.unpack("<6I", self._recv_exact(24))
        if magic != cmd ^ 0xFFFFFFFF:
            raise ProtocolError(f"bad magic on packet {cmd:#x}")
        data = self._recv_exact(length) if length else b""
        # Clients from version 0x01000001 on may leave the checksum 0; a non-zero one must match.
        if checksum and sum(data) & 0xFFFFFFFF != checksum:
            raise ProtocolError("payload checksum mismatch")
        return cmd, arg0, arg1, data

    def handshake(self) -> None:
        cmd, version, max_payload, _banner = self.recv()
        if cmd != CNXN:
            raise ProtocolError("expected CNXN first")
        self.version, self.max_payload = min(version, VERSION), min(max_payload, MAX_PAYLOAD)
        if self.device.auth != "none":
            self.authenticate()
        self.send(CNXN, self.version, self.max_payload, self.device.banner())

    def authenticate(self) -> None:
        token = os.urandom(20)
        self.send(AUTH, AUTH_TOKEN, 0, token)
        while True:
            cmd, kind, _, data = self.recv()
            if cmd != AUTH:
                continue
            if kind == AUTH_SIGNATURE:
                if any(signature_matches(k, token, data) for k in self.device.keys):
                    return
                token = os.urandom(20)  # refused: the client tries its next key on a fresh token
                self.send(AUTH, AUTH_TOKEN, 0, token)
            elif kind == AUTH_RSAPUBLICKEY:
                if self.device.auth == "accept":  # the user tapped "Allow" on the phone
                    with self.device.lock:
                        self.device.keys.append(parse_android_pubkey(data))
                    return
                raise ProtocolError("public key refused: not in the authorized keys")

    def serve(self) -> None:
        try:
            self.handshake()
            while True:
                cmd, arg0, arg1, data = self.recv()
                if cmd == OPEN:
                    self.open(arg0, data.rstrip(b"\0").decode(errors="replace"))
                elif cmd == OKAY and arg1 in self.streams:
                    self.streams[arg1].acked.set()
                elif cmd == WRTE and arg1 in self.streams:
                    self.send(OKAY, arg1, arg0)
                    self.streams[arg1].inbox.put(data)
                elif cmd == CLSE and arg1 in self.streams:
                    self.streams.pop(arg1).client_closed()
                elif cmd == CNXN:  # a client restarting the session: answer again
                    self.send(CNXN, self.version, self.max_payload, self.device.banner())
        except (OSError, ProtocolError, struct.error):
            pass
        finally:
            for s in list(self.streams.values()):
                s.closed.set()
                s.acked.set()
                s.inbox.put(None)
                s.kill()
            self.sock.close()

    def open(self, remote_id: int, service: str) -> None:
        handler = None
        if service.startswith("shell"):  # shell:CMD or shell,v2,raw:CMD
            options, _, command = service.partition(":")
            handler = lambda s: run_shell(s, command, v2="v2" in options.split(",")[1:])
        elif service.startswith("exec:"):
            handler = lambda s: run_shell(s, service[5:], v2=False, merge_stderr=False)
        elif service == "sync:":
            handler = run_sync
        if handler is None:
            self.send(CLSE, 0, remote_id)  # unknown service: refuse the OPEN
            return
        local_id, self.next_id = self.next_id, self.next_id + 1
        stream = Stream(self, local_id, remote_id)
        self.streams[local_id] = stream
        self.send(OKAY, local_id, remote_id)

        def serve_stream():
            try:
                handler(stream)
            except (StreamClosed, OSError):
                pass
            finally:
                self.streams.pop(local_id, None)
                try:
                    stream.close()
                except OSError:
                    pass

        threading.Thread(target=serve_stream, daemon=True).start()


# --- services ----------------------------------------------------------------------------------------


def run_shell(stream: Stream, command: str, v2: bool, merge_stderr: bool = True) -> None:
    device = stream.conn.device
    argv = ["/bin/sh", "-c", device.to_host_text(command)] if command else ["/bin/sh"]
    # a child of this adbd's (testbed.children): however this adbd ends, its programs end with it
    proc = children.start(
        argv, cwd=device.sandbox, env=device.env,
        stdin=subprocess.PIPE if v2 else subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if v2 or not merge_stderr else subprocess.STDOUT,
    )
    stream.procs.append(proc)

    def frame(kind: int, data: bytes) -> bytes:
        return struct.pack("<BI", kind, len(data)) + data if v2 else data

    def pump(pipe, kind):
        try:
            while chunk := os.read(pipe.fileno(), SYNC_DATA_MAX):
                stream.write(frame(kind, device.to_device_text(chunk)))
        except (StreamClosed, OSError):
            stream.kill()

    pumps = [threading.Thread(target=pump, args=(proc.stdout, SHELL_STDOUT), daemon=True)]
    if proc.stderr is not None:
        pumps.append(threading.Thread(target=pump, args=(proc.stderr, SHELL_STDERR), daemon=True))
    if v2:
        threading.Thread(target=feed_stdin, args=(stream, proc), daemon=True).start()
    for t in pumps:
        t.start()
    rc = proc.wait()
    children.end(proc)  # what it left running in its session (which may hold its output open)
    for t in pumps:
        t.join()
    if v2:
        stream.write(frame(SHELL_EXIT, bytes([(128 - rc if rc < 0 else rc) & 0xFF])))


def feed_stdin(stream: Stream, proc: subprocess.Popen) -> None:
    """Shell v2 input: stdin packets go to the process, close-stdin closes its input."""
    try:
        while True:
            kind, length = struct.unpack("<BI", stream.read_exact(5))
            data = stream.read_exact(length) if length else b""
            if kind == SHELL_STDIN:
                proc.stdin.write(data)
                proc.stdin.flush()
            elif kind == SHELL_CLOSE_STDIN:
                break
    except (StreamClosed, OSError):
        pass
    finally:
        try:
            proc.stdin.close()
        except OSError:
            pass


def _status(kind: bytes, *numbers: int) -> bytes:
    return kind + struct.pack(f"<{len(numbers)}I", *numbers)


def _fail(message: str) -> bytes:
    return b"FAIL" + struct.pack("<I", len(message.encode())) + message.encode()


def run_sync(stream: Stream) -> None:
    """sync: requests parsed as a byte stream (clients pack several into one WRTE)."""
    device = stream.conn.device
    while True:
        request, length = struct.unpack("<4sI", stream.read_exact(8))
        if request == b"QUIT":
            return
        path = stream.read_exact(length).decode(errors="replace")
        if request == b"STAT":
            local = device.local_path(path)
            st = local.stat() if local is not None and local.exists() else None
            stream.write(_status(b"STAT", st.st_mode, st.st_size, int(st.st_mtime)) if st else _status(b"STAT", 0, 0, 0))
        elif request == b"LIST":
            local = device.local_path(path)
            out = b""
            if local is not None and local.is_dir():
                for entry in sorted(local.iterdir()):
                    st = entry.lstat()
                    name = entry.name.encode()
                    out += _status(b"DENT", st.st_mode, st.st_size, int(st.st_mtime), len(name)) + name
            stream.write(out + _status(b"DONE", 0, 0, 0, 0))
        elif request == b"SEND":
            sync_receive_file(stream, device, path)
        elif request == b"RECV":
            sync_send_file(stream, device, path)
        else:
            stream.write(_fail(f"unknown sync request {request!r}"))
            return


def sync_receive_file(stream: Stream, device: FakeDevice, spec: str) -> None:
    """SEND path,mode: DATA chunks then DONE(mtime). On any failure the rest is read and dropped and
    the partial file removed, as adbd does, then FAIL says why."""
    path, _, mode = spec.rpartition(",")
    local = device.local_path(path)
    error = None if local is not None else f"{path}: Permission denied"
    out = None
    if error is None:
        try:
            local.parent.mkdir(parents=True, exist_ok=True)
            out = open(local, "wb")
        except OSError as e:
            error = f"{path}: {e.strerror}"
    budget = None if device.quota is None else device.quota - device.used_bytes()
    written = 0
    while True:
        kind, n = struct.unpack("<4sI", stream.read_exact(8))
        if kind == b"DONE":
            break
        if kind != b"DATA":
            raise StreamClosed
        data = stream.read_exact(n)
        if out is None:
            continue
        if budget is not None and written + len(data) > budget:
            error = f"{path}: No space left on device"
            out.close()
            out = None
            local.unlink(missing_ok=True)
            continue
        out.write(data)
        written += len(data)
        with device.lock:
            drop = device.drop_after_bytes is not None and written >= device.drop_after_bytes
            if drop:
                device.drop_after_bytes = None
        if drop:  # the cable is pulled: the connection dies mid-transfer, the partial file stays
            out.close()
            stream.conn.sock.shutdown(socket.SHUT_RDWR)
            raise StreamClosed
    if out is not None:
        out.close()
        os.chmod(local, int(mode) & 0o777 if mode.isdigit() else 0o644)  # the client sends st_mode in decimal
    stream.write(_fail(error) if error else _status(b"OKAY", 0))


def sync_send_file(stream: Stream, device: FakeDevice, path: str) -> None:
    local = device.local_path(path)
    if local is None or not local.is_file():
        stream.write(_fail(f"{path}: No such file or directory"))
        return
    with device.lock:
        corrupt = device.corrupt_recv > 0
        device.corrupt_recv -= corrupt
    with open(local, "rb") as f:
        first = True
        while chunk := f.read(SYNC_DATA_MAX):
            if corrupt and first:  # a flipped bit on the wire, after the device read it correctly
                chunk = bytes([chunk[0] ^ 0x01]) + chunk[1:]
            first = False
            stream.write(_status(b"DATA", len(chunk)) + chunk)
    stream.write(_status(b"DONE", 0))


# --- server ------------------------------------------------------------------------------------------


def exit_with_parent(pid: int) -> None:
    """A peer started by a testbed process must not outlive it, however that process ends."""
    def watch():
        while os.getppid() == pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def serve(args) -> None:
    if args.parent:
        exit_with_parent(args.parent)
    device = FakeDevice(args)
    listener = socket.create_server(("127.0.0.1", args.port))
    print(f"adbd listening on 127.0.0.1:{listener.getsockname()[1]}", flush=True)
    while True:
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=Connection(sock, device).serve, daemon=True).start()


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m testbed.peers.adbd", description=__doc__.splitlines()[0])
    p.add_argument("--sandbox", required=True, help="host folder holding the device's files")
    p.add_argument("--device-root", default="/data/local/tmp", help="device path the sandbox appears as")
    p.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0: any free port)")
    p.add_argument("--auth", choices=("none", "keys", "accept"), default="keys",
                   help="none: no AUTH; keys: only --authorized-keys; accept: also keys clients offer")
    p.add_argument("--authorized-keys", action="append", default=[], help="adbkey.pub files")
    p.add_argument("--prop", action="append", default=[], help="KEY=VALUE answered by getprop")
    p.add_argument("--quota", type=int, default=None, help="bytes the sandbox may hold (pushes beyond fail)")
    p.add_argument("--corrupt-recv", type=int, default=0, help="flip a byte in the first N pulls")
    p.add_argument("--drop-after-bytes", type=int, default=None, help="cut the connection once mid-push")
    p.add_argument("--parent", type=int, default=0, help="exit when this process (the one that started us) ends")
    return p.parse_args(argv)


if __name__ == "__main__":
    try:
        serve(parse_args())
    except KeyboardInterrupt:
        sys.exit(0)
