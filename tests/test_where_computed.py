"""A record's device is the machine that computed it: refimpl is refused off the host, a device's
default backend is the first its profile lists, and a run on a device whose records carry no evidence
of the device (a host computation filed under its name) is an error, never stored as a pass."""

import re

import pytest

from testbed import backends, cli, config, runner
from testbed.backends.refimpl import gdn as refimpl_gdn
from testbed.backends.native.device import WrongMachine
from testbed.devices import connect, load_profile
from testbed.results import ResultsStore
from tests.cli_support import said


@pytest.mark.parametrize("argv", [["run", "gdn", "device=qemu-arm32", "backend=refimpl"],
                                  ["sweep", "experiment=tail", "tail=0,8", "device=qemu-aarch64", "backend=refimpl"]])
def test_refimpl_on_a_device_is_refused_in_one_line(argv, results_dir, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "backend=refimpl runs on the host; for device=qemu-" in err and "use backend=native" in err
    assert "\n" not in err and not (results_dir / "records.jsonl").exists()


def test_a_backend_the_device_lacks_is_refused(results_dir, capsys):
    assert cli.main(["run", "gdn", "device=qemu-arm32", "backend=iree"]) == 2
    assert "device=qemu-arm32 cannot run backend=iree" in capsys.readouterr().err


@pytest.mark.parametrize("device,expected", [("host", "refimpl"), ("qemu-arm32", "native"), ("hexagon", "llamacpp"),
                                             ("qemu-hexagon", "native")])
def test_a_devices_default_backend_is_the_first_it_has(device, expected):
    assert config.load([f"device={device}"], experiment="gdn").cfg.backend == expected


def test_a_host_computation_filed_under_a_device_is_an_error(results_dir, monkeypatch):
    """The planted bug: a backend that computes on the host whatever device it is given (what every
    experiment did before), run with device=qemu-arm32. Its records carry no device evidence."""
    monkeypatch.setattr(backends, "load", lambda name, technique: refimpl_gdn)
    rc = config.load(["device=qemu-arm32", "mode=oracle", "matrix=awkward"], experiment="gdn")
    device = connect(load_profile("qemu-arm32"))
    try:
        with pytest.raises(runner.ComputedElsewhere, match="no evidence that the device computed them"):
            runner.execute(rc, device=device)
    finally:
        device.close()
    rows = ResultsStore(results_dir).records()
    assert [(r["verdict"], r["device"]) for r in rows] == [("error", "qemu-arm32")]  # no pass stored


def test_host_programs_run_under_a_hexagon_device_are_refused(results_dir, monkeypatch):
    """The planted bug: the build for a Hexagon device picks the host's programs (an ABI map that falls
    back to the host). The qemu transport runs a host ELF natively, so the outputs would be right and
    every oracle pass; the program is an x86-64 ELF, and the run is refused before it starts."""
    from testbed.backends.native.device import WrongMachine

    from testbed.backends.native import gdn as native_gdn

    monkeypatch.setattr(native_gdn, "target_for_abi", lambda abi: "host")
    rc = config.load(["device=qemu-hexagon", "backend=native", "mode=oracle", "matrix=awkward"], experiment="gdn")
    device = connect(load_profile("qemu-hexagon"))
    try:
        with pytest.raises(WrongMachine, match="is an ELF for machine 62 .* not for the device's ABI hexagon"):
            runner.execute(rc, device=device)
    finally:
        device.close()
    assert [(r["verdict"], r["device"]) for r in ResultsStore(results_dir).records()] == [("error", "qemu-hexagon")]


def test_hexagon_evidence_must_name_its_machine():
    """Evidence that does not say what machine ran (a tool whose header could not be read) is evidence
    of no device's kind, Hexagon's or ARM's; a Hexagon ELF is evidence for Hexagon only."""
    from testbed.results import Record

    def record(detail):
        return Record("gdn", "case", "oracle", "nmse", "pass", 1.0, evidence=[
            {"device": "d", "ran": "tb_gdn_bench", "sha256": "0" * 64, "command": "x", "detail": detail}])

    for device in ("qemu-hexagon", "qemu-arm32"):  # no machine named: no evidence of any device's kind
        with pytest.raises(runner.ComputedElsewhere, match="does not say what kind of program ran"):
            runner.check_evidence([record({})], load_profile(device))
    runner.check_evidence([record({"elf_machine": 164})], load_profile("qemu-hexagon"))
    runner.check_evidence([record({"elf_machine": 40})], load_profile("qemu-arm32"))
    with pytest.raises(runner.ComputedElsewhere, match=r"machine 164 \(QUALCOMM DSP6\), not 40 \(ARM\)"):
        runner.check_evidence([record({"elf_machine": 164})], load_profile("qemu-arm32"))


def test_a_program_killed_on_the_device_leaves_an_error_record_with_its_stderr(results_dir, monkeypatch, tmp_path):
    """The device program dies mid-run (a crash, the OOM killer): the run is an error record carrying the
    program's last words, and nothing of it reads as passed."""
    from testbed.backends.native import gdn as native_gdn

    crashing = tmp_path / "programs" / "tb_gdn_bench"
    crashing.parent.mkdir()
    crashing.write_text("#!/bin/sh\necho 'tb_gdn_bench: out of memory in chunk 3' >&2\nkill -9 $$\n")
    crashing.chmod(0o755)
    monkeypatch.setattr(native_gdn, "build_programs", lambda target: crashing.parent)
    assert cli.main(["run", "gdn", "backend=native", "mode=oracle", "matrix=awkward"]) == 4
    rows = ResultsStore(results_dir).records()
    assert [r["verdict"] for r in rows] == ["error"]
    assert "tb_gdn_bench exited -9" in rows[0]["detail"] and "out of memory in chunk 3" in rows[0]["detail"]


def test_a_device_that_drops_mid_run_is_an_error_record_and_unreachable(results_dir, monkeypatch):
    """The loopback phone's adbd dies after the third program run of the oracle matrix (deterministic:
    killed from inside the run, not on a timer): the run ends with an error record saying the device was
    lost, what it measured before is kept but never counts as passed, and the CLI reports the device
    unreachable (exit 3), which is how a nightly lists it."""
    import os
    import signal

    from testbed.backends.native import gdn as native_gdn

    device = connect(load_profile("adb-loopback"))
    calls = []

    def dropping(dev, job):
        calls.append(job)
        if len(calls) == 3:
            os.kill(device.peer.proc.pid, signal.SIGKILL)
        return real(dev, job)

    real = native_gdn.run_native
    monkeypatch.setattr(native_gdn, "run_native", dropping)
    monkeypatch.setattr(runner, "connect", lambda profile: device)
    try:
        assert cli.main(["run", "gdn", "device=adb-loopback", "mode=oracle", "matrix=awkward"]) == 3
    finally:
        device.close()
    rows = ResultsStore(results_dir).records()
    # what was judged before the drop is kept, marked as from an incomplete run; the run is an error
    assert all(r["device"] == "adb-loopback" and r["incomplete"] for r in rows)
    error = rows[-1]
    assert error["verdict"] == "error" and "connection lost" in error["detail"]
    assert error["metrics"]["records_before_error"] == len(rows) - 1 >= 1


def test_a_host_program_built_for_an_emulated_device_is_refused(results_dir, monkeypatch):
    """Issue 24, item 5, the planted bug: the host's x86 program built for qemu-aarch64. The qemu transport
    runs a host ELF natively, so every verdict passed; the evidence's ELF machine says what ran."""
    from testbed.backends.native import gdn as native_gdn

    import dataclasses

    from testbed.devices import Device

    monkeypatch.setattr(native_gdn, "target_for_abi", lambda abi: "host")
    real = connect(load_profile("qemu-aarch64"))
    # without the instruction counts (which a host program leaves none of): only the evidence can tell
    device = Device(dataclasses.replace(real.profile, capabilities=["cpu", "native", "emulated"]), real.transport)
    rc = config.load(["device=qemu-aarch64", "backend=native", "mode=oracle", "matrix=awkward"], experiment="gdn")
    try:  # refused before it runs (the pushed file's machine), or at the latest by the evidence check
        with pytest.raises((runner.ComputedElsewhere, WrongMachine)) as refused:
            runner.execute(rc, device=device)
    finally:
        device.close()
    assert re.search(r"is an ELF for machine 62 \(.*X86-64\), not .*183", str(refused.value))
    rows = ResultsStore(results_dir).records()
    assert [r["verdict"] for r in rows if r["case"] != "run"] == [] or not any(r["verdict"] == "pass" for r in rows)
    assert any(r["verdict"] == "error" and "machine 62" in r["detail"] for r in rows)


def evidence(**detail) -> list[dict]:
    return [{"device": "d", "ran": "prog", "sha256": "0" * 64, "command": "prog", "device_seconds": 1.0,
             **({"detail": detail} if detail else {})}]


@pytest.mark.parametrize("device, detail, problem", [
    ("qemu-arm32", {"elf_machine": 40}, None),
    ("qemu-arm32", {"elf_machine": 183}, "is an ELF for machine 183 (AArch64), not 40 (ARM)"),
    ("qemu-arm32", {}, "does not say what kind of program ran"),
    ("qemu-arm32", {"elf_machine": None}, "does not say what kind of program ran"),
    ("qemu-aarch64", {"module_formats": ["embedded-elf-arm_64"]}, None),
    ("qemu-aarch64", {"module_formats": ["embedded-elf-arm_32"]}, "is a module for embedded-elf-arm_32, not "
                                                                 "embedded-elf-arm_64"),
    ("lavapipe", {"module_formats": ["vulkan-spirv-fb"]}, None),
    ("lavapipe", {"module_formats": ["embedded-elf-x86_64"]}, "not vulkan-spirv-fb"),
])
def test_evidence_must_show_a_program_of_the_devices_kind(device, detail, problem):
    from testbed.results import Record

    record = Record("gdn", "case", "oracle", "nmse", "pass", 1.0, evidence=evidence(**detail))
    if problem is None:
        runner.check_evidence([record], load_profile(device))
    else:
        with pytest.raises(runner.ComputedElsewhere, match=problem.replace("(", r"\(").replace(")", r"\)")):
            runner.check_evidence([record], load_profile(device))


def test_a_tools_evidence_names_its_elf_machine_read_on_the_device(local_device):
    import shutil

    from testbed.backends.llamacpp.runner import evidence as tool_evidence
    from testbed.devices import CommandResult

    (ran,) = tool_evidence(local_device, [shutil.which("true")], CommandResult(0, "", "", 0.1))
    assert ran["detail"]["elf_machine"] == 62 and len(ran["sha256"]) == 64


def test_a_device_output_of_the_wrong_shape_is_one_line_and_exit_4(results_dir, tmp_path, monkeypatch, capsys):
    """Issue 24, item 12: a stale or cut output (here: out.npy and state.npy of another shape) reached
    check_nmse, whose ValueError ended the run in a traceback, exit 1."""
    from testbed.backends.native import gdn as native_gdn

    fake = tmp_path / "programs" / "tb_gdn_bench"
    fake.parent.mkdir()
    fake.write_text("#!/usr/bin/env python3\nimport json, sys, numpy as np\n"
                    "np.save(sys.argv[2] + '/out.npy', np.zeros((1, 3, 2, 4), np.float32))\n"
                    "np.save(sys.argv[2] + '/state.npy', np.zeros((1, 2, 4, 4), np.float32))\n"
                    "json.dump({'seconds': [0.001], 'reps': 1}, open(sys.argv[2] + '/timings.json', 'w'))\n")
    fake.chmod(0o755)
    monkeypatch.setattr(native_gdn, "build_programs", lambda target, **kw: fake.parent)
    assert cli.main(["run", "gdn", "backend=native", "mode=oracle", "matrix=awkward"]) == 4
    err = capsys.readouterr().err
    assert len(said(err)) == 1 and "Traceback" not in err
    assert "tb_gdn_bench wrote out.npy of shape (1, 3, 2, 4), expected (" in err and "a stale or cut output" in err
    rows = ResultsStore(results_dir).records()
    assert [r["verdict"] for r in rows] == ["error"] and "stale or cut" in rows[0]["detail"]
