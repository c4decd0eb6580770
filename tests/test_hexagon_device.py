"""Hexagon as a device: the profile fields (ABI hexagon, its core, the SDK runner), what `testbed doctor`
says a Hexagon phone lacks, and the runner prefixing the commands that start a program, checked with
a real runner: a script standing for run_main_on_hexagon that starts the program under qemu-hexagon."""

import shutil

import pytest

from testbed.backends.native import build as kernel_build
from testbed.backends.native.device import NativeJob, run_native
from testbed.cli.devices import hexagon_checks
from testbed.devices import connect, load_profile
from testbed.devices.profile import Profile
from testbed.errors import UsageError
from testbed.experiments.gdn import TBO_CASES
from testbed.oracles.numerical import check_nmse
from tests.native_support import reference64

BASE = {"name": "dsp", "transport": "adb", "abi": "hexagon", "work_dir": "/data/local/tmp/testbed",
        "connection": {"serial": ""}, "accelerators": {"hexagon": "v73"}}


def test_a_hexagon_profile_names_its_core():
    assert Profile.from_config(BASE, "dsp.yaml").accelerators["hexagon"] == "v73"
    with pytest.raises(UsageError, match="accelerators.hexagon.*required for ABI hexagon"):
        Profile.from_config({**BASE, "accelerators": {}}, "dsp.yaml")
    with pytest.raises(UsageError, match="accelerators.hexagon' 'v68' is newer than qemu-hexagon emulates"):
        Profile.from_config({**BASE, "transport": "qemu", "work_dir": "", "connection": {"emulator": "qemu-hexagon"},
                             "accelerators": {"hexagon": "v68"}}, "q.yaml")
    with pytest.raises(UsageError, match="tools.hexagon_runner.*only for ABI hexagon"):
        Profile.from_config({**BASE, "abi": "arm64-v8a", "accelerators": {}, "tools": {"hexagon_runner": "/r"}},
                            "p.yaml")


def test_doctor_says_a_hexagon_phone_needs_the_sdks_runner():
    [(check, status, detail)] = hexagon_checks(Profile.from_config(BASE, "dsp.yaml"))
    assert (check, status) == ("hexagon runner", "MISSING") and "run_main_on_hexagon" in detail
    assert "tools.hexagon_runner" in detail
    named = Profile.from_config({**BASE, "tools": {"hexagon_runner": "/data/local/tmp/run_main_on_hexagon 3"}}, "d")
    assert hexagon_checks(named) == []
    for profile in ("qemu-hexagon", "adb-loopback-hexagon"):
        [(_, status, _)] = hexagon_checks(load_profile(profile))
        assert status == "ok"


@pytest.mark.skipif(shutil.which("qemu-hexagon") is None, reason="qemu-user is not installed")
def test_the_runner_starts_every_native_program(tmp_path):
    """A profile's hexagon_runner (with its arguments) is what the device runs; the program and its
    arguments follow it. The runner here logs its call and starts the program under qemu-hexagon."""
    try:
        program = kernel_build.build_programs("hexagon") / "tb_gdn_bench"
    except kernel_build.BuildError as e:
        pytest.skip(str(e))
    log = tmp_path / "runner.log"
    runner = tmp_path / "run_main_on_hexagon"
    runner.write_text(f'#!/bin/sh\necho "domain=$1 program=$2" >> {log}\nshift\nexec qemu-hexagon "$@"\n')
    runner.chmod(0o755)
    profile = load_profile("qemu-hexagon")
    profile.capabilities = [c for c in profile.capabilities if c != "counts"]  # the runner is not under the plugin
    profile.tools = {"hexagon_runner": f"{runner} 3"}
    device = connect(profile)
    try:
        x = TBO_CASES[7].inputs(seed=0)
        result = run_native(device, NativeJob(program, dict(zip(("q", "k", "v", "g", "beta", "state"), x.arrays())),
                                              ["out", "state"], [".", ".", "form=chunkwise", "chunk=16", "warmup=0",
                                                                 "reps=1"], measured=False))
    finally:
        device.close()
    assert check_nmse(reference64(x, "tiled"), result.outputs).passed
    assert result.evidence.command.startswith(f"{runner} 3 ../../bin/")
    assert result.evidence.detail["elf_machine"] == 164
    assert log.read_text().startswith("domain=3 program=../../bin/")
