"""`testbed devices`, `testbed doctor DEVICE`, and `pytest --device=pixel` with no phone attached."""

import subprocess
import sys

from testbed import PROJECT_ROOT
from testbed.cli import main


def test_devices_lists_every_profile_and_why_one_is_unreachable(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines()[2:]}
    assert {"host", "qemu-arm32", "qemu-aarch64", "pixel", "arm32", "hexagon", "board", "adb-loopback"} <= set(rows)
    assert rows["adb-loopback"].rstrip(" |").endswith("yes")  # its peer starts on connect
    assert "no: no USB device with an ADB interface" in rows["pixel"]


def test_doctor_checks_what_a_profile_names(capsys):
    assert main(["doctor", "adb-loopback"]) == 0
    out = capsys.readouterr().out
    assert "ok       utility sha256sum" in out and "model=Loopback" in out


def test_doctor_says_what_is_missing(capsys, tmp_path, monkeypatch):
    import testbed.config as config

    devices = tmp_path / "devices"
    devices.mkdir()
    (devices / "half.yaml").write_text(
        "name: half\ntransport: qemu\nabi: armeabi-v7a\nconnection: {emulator: qemu-arm, sysroot: /no/such/sysroot}\n"
        "tools: {llama-bench: /no/such/llama-bench}\n")
    monkeypatch.setitem(config.GROUPS, "device", devices)
    assert main(["doctor", "half"]) == 1
    out = capsys.readouterr().out
    assert "MISSING  qemu sysroot" in out and "MISSING  tool llama-bench" in out and "2 missing" in out


def test_doctor_on_an_unreachable_device_exits_3_saying_why(capsys):
    assert main(["doctor", "pixel"]) == 3
    assert "UNREACHABLE" in capsys.readouterr().out


def test_pytest_with_an_absent_phone_stops_at_once_saying_why():
    p = subprocess.run([sys.executable, "-m", "pytest", "--device=pixel", "-p", "no:cacheprovider", "tests/test_native_runner.py"],
                       cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 3
    assert "device 'pixel' is unreachable" in p.stdout + p.stderr and "no USB device" in p.stdout + p.stderr
    assert " passed" not in p.stdout and " failed" not in p.stdout  # no test ran


def test_a_loopback_peer_dies_with_the_process_that_started_it():
    """`testbed run ... device=adb-loopback` never closes its device; the peer must not outlive it,
    even when the process ends without cleaning up (os._exit skips atexit)."""
    import time

    code = ("import os; from testbed.devices import connect, load_profile; "
            "d = connect(load_profile('adb-loopback')); print(d.peer.proc.pid, d.peer.sandbox, flush=True); "
            "os._exit(0)")
    pid, sandbox = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True,
                                  timeout=60).stdout.split()
    pid = int(pid)

    def alive():
        try:
            return "\tZ" not in open(f"/proc/{pid}/status").read().split("State:")[1][:4]
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive()
    import shutil

    shutil.rmtree(sandbox)  # what the dead process would have removed at exit


def test_doctor_says_when_the_native_programs_cannot_be_built_for_the_device(monkeypatch, capsys):
    """A host without the device's cross compiler: doctor names the missing toolchain, exit 1."""
    from testbed.backends.native import build

    def no_toolchain(target):
        raise build.BuildError("aarch64-linux-gnu-gcc is not installed (Debian: gcc-aarch64-linux-gnu)")

    monkeypatch.setattr(build, "build_programs", no_toolchain)
    assert main(["doctor", "qemu-aarch64"]) == 1
    out = capsys.readouterr().out
    assert "MISSING  native programs" in out and "gcc-aarch64-linux-gnu" in out


def test_doctor_says_how_to_get_an_arm32_iree_runtime(capsys):
    """No armv7 IREE runtime exists as a package: doctor names what is missing and how to build it."""
    assert main(["doctor", "qemu-arm32"]) == 3
    out = capsys.readouterr().out
    assert "MISSING  iree runtime" in out and "Cross-build iree-run-module" in out
    assert "name them in devices/qemu-arm32.yaml as tools.iree-run-module" in out


def test_doctor_checks_that_the_iree_tools_start_on_an_arm64_device(capsys):
    """The aarch64 manylinux tools, under qemu-aarch64 with the glibc sysroot, of the compiler's release."""
    assert main(["doctor", "qemu-aarch64"]) == 0
    out = capsys.readouterr().out
    assert "ok       iree runtime" in out and "= the compiler's" in out
    assert "ok       iree iree-run-module" in out and "ok       iree iree-benchmark-module" in out


def test_doctor_says_when_adb_shell_cannot_reach_usb(monkeypatch, capsys):
    """A USB phone's profile on a host without adb-shell's USB extra: doctor names it before connecting."""
    import builtins

    real_import = builtins.__import__

    def no_usb1(name, *args, **kwargs):
        if name == "usb1":
            raise ImportError("No module named 'usb1'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_usb1)
    assert main(["doctor", "pixel"]) == 3  # and no phone is attached either
    out = capsys.readouterr().out
    assert out.startswith("MISSING  adb-shell usb support") and "pip install 'testbed[usb]'" in out


def test_the_loopback_adbd_starts_from_a_folder_holding_a_testbed_folder(tmp_path, monkeypatch):
    """Issue 24, item 15: `python -m testbed.peers.adbd` run where the user is imported ./testbed."""
    from testbed.devices import connect, load_profile

    (tmp_path / "testbed").mkdir()
    (tmp_path / "testbed" / "__init__.py").write_text("raise ImportError('the wrong testbed')\n")
    monkeypatch.chdir(tmp_path)
    device = connect(load_profile("adb-loopback"))
    try:
        assert device.run(["echo", "hi"]).stdout.strip() == "hi"
    finally:
        device.close()


def test_a_peer_that_fails_to_start_is_one_line_in_the_devices_table(tmp_path, monkeypatch, capsys):
    """Issue 24, item 15: its traceback went into the table cell, line breaks and all."""
    import testbed.config as config

    devices = tmp_path / "devices"
    devices.mkdir()
    (devices / "broken-peer.yaml").write_text(
        "name: broken-peer\ntransport: adb\nabi: armeabi-v7a\nwork_dir: /data/local/tmp/testbed\n"
        "connection: {host: 127.0.0.1}\n"
        "peer: {command: ['{python}', '-c', 'import no_such_module_here']}\n")
    monkeypatch.setitem(config.GROUPS, "device", devices)
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if "broken-peer" in line]
    assert "did not start: ModuleNotFoundError: No module named 'no_such_module_here'" in row
    assert len(out.splitlines()) == 3  # header, rule, the one row


def test_devices_lists_templates_as_not_configured_and_dials_nothing_outside_loopback(monkeypatch, capsys):
    """Issue 24, item 17: `testbed devices` probed every shipped profile, the example phone at
    192.168.1.50:5555 and the board at board.local:22 among them."""
    import ipaddress
    import socket

    tried = []

    def local(host) -> bool:
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return host == "localhost"

    real_connect, real_lookup = socket.socket.connect, socket.getaddrinfo

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not local(address[0]):
            tried.append(address)
            raise ConnectionRefusedError(f"test: no connect to {address}")
        return real_connect(sock, address)

    def lookup(host, *args, **kwargs):
        if host is not None and not local(host):
            tried.append(host)
            raise socket.gaierror(f"test: no lookup of {host}")
        return real_lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    assert main(["devices"]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()[2:]}
    assert tried == []
    for template in ("arm32", "board"):
        assert f"not configured: connection.host is empty (devices/{template}.yaml is a template" in rows[template]
    assert main(["doctor", "board"]) == 3 and tried == []


def test_a_device_name_is_a_name_never_a_path(capsys, tmp_path):
    """`doctor ../x` read any YAML file the path reached (and named it as if in devices/): a profile
    outside the device folders, valid as it is, is refused by its path, naming the accepted names."""
    import os

    from testbed.config import DEVICES_DIR

    (tmp_path / "outside.yaml").write_text("name: outside\ntransport: local\nabi: host\nwork_dir: ''\n")
    path = os.path.relpath(tmp_path / "outside", DEVICES_DIR)
    assert main(["doctor", path]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"testbed: error: unknown device {path!r}; accepted: ") and " host, " in line
    assert main(["run", "gdn", f"device={path}", "--cfg", "job"]) == 2
