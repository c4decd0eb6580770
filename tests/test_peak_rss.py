"""Peak memory of engine runs (testbed.backends.engine.peak_rss): tb_peak_rss runs a program, reaps it, and
writes its peak resident set size (VmHWM, wait4's ru_maxrss); the engine runner puts it around every engine
request where the device lets it be read, and says why not elsewhere."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testbed.backends.engine import peak_rss
from testbed.devices import connect, load_profile

ALLOCATE = "import sys; b = bytearray(int(sys.argv[1]) << 20); b[::4096] = b'x' * len(b[::4096]); sys.exit(int(sys.argv[2]))"


@pytest.fixture(scope="module")
def wrapper():
    built = peak_rss.build("host")
    if isinstance(built, str):
        pytest.skip(built)
    return built


@pytest.mark.parametrize("megabytes", [30, 150])
def test_the_peak_is_the_programs_resident_high_water_mark(wrapper, tmp_path, megabytes):
    out = tmp_path / "peak.json"
    done = subprocess.run([str(wrapper), str(out), sys.executable, "-c", ALLOCATE, str(megabytes), "0"])
    assert done.returncode == 0
    kb = json.loads(out.read_text())["peak_rss_kb"]
    # the touched buffer, plus the interpreter (a few MB, never a hundred)
    assert megabytes * 1024 <= kb < (megabytes + 100) * 1024, kb


def test_the_programs_exit_status_and_signal_come_through(wrapper, tmp_path):
    out = tmp_path / "peak.json"
    assert subprocess.run([str(wrapper), str(out), sys.executable, "-c", ALLOCATE, "1", "3"]).returncode == 3
    killed = subprocess.run([str(wrapper), str(out), sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert killed.returncode == 128 + 9 and json.loads(out.read_text())["peak_rss_kb"] > 0
    missing = subprocess.run([str(wrapper), str(out), str(tmp_path / "no-such-program")], capture_output=True, text=True)
    assert missing.returncode == 127 and "cannot run" in missing.stderr


def test_where_it_is_not_read_the_reason_is_said(results_dir):
    for name, target, valgrind, said in (("qemu-aarch64", "aarch64", False, "not read: the device is emulated"),
                                         ("host", "host", True, "not read: the engine ran under valgrind")):
        device = connect(load_profile(name))
        try:
            assert peak_rss.wrapper_for(device, target, valgrind).startswith(said)
        finally:
            device.close()
    assert peak_rss.build("hexagon").startswith("not read: no compiler here builds tb_peak_rss for hexagon")
