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


@pytest.mark.parametrize("which", ["local_device", "ssh_device"])
def test_every_engine_request_says_its_peak_rss_through_the_transport(request, which, wrapper):
    """testbed-c serving one chunk_prefill request on the host and over SSH (a real sshd on loopback): the
    wrapper is pushed like a program, its file pulled like a response; the figure is in the evidence."""
    import numpy as np

    from refimpl import gemma
    from testbed.backends.engine import build, spec as engine_spec
    from testbed.backends.engine.gemma import model_config
    from testbed.backends.engine.models import GemmaModel
    from testbed.backends.engine.runner import Expect, Request, call

    device = request.getfixturevalue(which)
    spec = engine_spec.load("testbed-c")
    cfg = gemma.tiny_config(layers=2)
    model, fmt = GemmaModel(cfg, gemma.init_weights(cfg, 0)).file_for(spec)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, 12)
    response = call(device, spec, Request("chunk_prefill", tokens, model, fmt, "f32", model_config(cfg, "f32", 32),
                                          past=5, chunk=4, logits_at=[11]),
                    Expect(cfg.vocab, cfg.layers, cfg.kv_heads, cfg.head_dim), build.program_for(spec, "host"))
    assert response.status == "ok" and 1 << 20 < response.peak_rss_bytes < 1 << 30
    detail = response.evidence.detail
    assert detail["peak_rss_bytes"] == response.peak_rss_bytes and "VmHWM" in detail["peak_rss_how"]
    assert "tb_peak_rss" in response.evidence.command
