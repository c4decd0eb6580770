"""The native runner on the selected device (`pytest --device=NAME`): push a static program built for
the device's ABI and its .npy input, run it, pull its output and timings, compare with numpy.

This is the native equivalence suite in miniature, with a tiny program until kernels/ provides the
real benchmark-and-dump programs: it runs on host, qemu-arm32, qemu-aarch64 and adb-loopback alike."""

from pathlib import Path, PurePosixPath

import numpy as np
import pytest

from testbed.backends.native.device import NativeJob, NativeRunFailed, run_native
from testbed.oracles.numerical import check_bitexact
from testbed.peers.fixtures import compile_static

SOURCE = Path(__file__).parent / "data" / "axpb.c"


def reference(x: np.ndarray, a: float, b: float) -> np.ndarray:
    """a*x + b in float32, one rounding per operation (as the C code with -ffp-contract=off)."""
    return (np.float32(a) * x + np.float32(b)).astype(np.float32)


def job_for(device, x, defines=()):
    return NativeJob(compile_static(SOURCE, device.profile.abi, defines), {"x": x}, ["y"], ["1.5", "-0.25", "3"])


@pytest.mark.requires("native")
def test_the_program_matches_numpy_bit_for_bit(device):
    x = np.random.default_rng(1).standard_normal(1001).astype(np.float32)
    result = run_native(device, job_for(device, x))
    verdict = check_bitexact({"y": reference(x, 1.5, -0.25)}, result.outputs)
    assert verdict.passed, verdict.detail
    t = result.figure()
    assert t.reps == 3 and 0 < t.min <= t.median <= t.max
    assert {"throttled", "temperatures_c_before", "temperatures_c_after", "cooldown"} <= set(result.health)


@pytest.mark.requires("native")
def test_a_planted_tail_bug_is_caught(device):
    x = np.random.default_rng(2).standard_normal(1001).astype(np.float32)
    result = run_native(device, job_for(device, x, ("PLANTED_BUG",)))
    verdict = check_bitexact({"y": reference(x, 1.5, -0.25)}, result.outputs)
    assert not verdict.passed and "1 elements differ, first at flat index 1000" in verdict.detail


@pytest.mark.requires("native")
def test_a_failing_program_is_an_error_with_its_stderr(device, monkeypatch):
    pushed = []
    push = device.push
    monkeypatch.setattr(device, "push", lambda local, remote, *a: (pushed.append(remote), push(local, remote, *a))[1])
    wrong = np.arange(10, dtype=np.float64)  # the program reads float32 only
    with pytest.raises(NativeRunFailed, match="exited 3: cannot read x.npy"):
        run_native(device, NativeJob(compile_static(SOURCE, device.profile.abi), {"x": wrong}, ["y"], ["1", "0", "1"]))
    # this run's folder was removed (others' folders, e.g. of runs killed on purpose elsewhere, are not ours)
    run_dir = next(str(PurePosixPath(p).parent) for p in pushed if p.endswith("/x.npy"))
    assert run_dir.startswith("runs/")
    assert device.run(["test", "-e", run_dir]).returncode != 0


@pytest.mark.parametrize("abi", ["armeabi-v7a", "arm64-v8a"])
def test_arm_programs_through_adb_and_qemu(loopback_adbd, adb_key, abi):
    """In any session: both ARM ABIs over the loopback adbd (qemu-user behind it)."""
    from testbed.peers.fixtures import adb_connect

    x = np.linspace(-3, 3, 257, dtype=np.float32)
    adb_device = adb_connect(loopback_adbd, adb_key, abi=abi)
    try:
        result = run_native(adb_device, NativeJob(compile_static(SOURCE, abi), {"x": x}, ["y"], ["1.5", "-0.25", "2"]))
    finally:
        adb_device.close()
    assert check_bitexact({"y": reference(x, 1.5, -0.25)}, result.outputs).passed


@pytest.mark.parametrize("which", ["local_device", "ssh_device"])
def test_staged_inputs_changed_on_the_device_are_pushed_again(which, request, tmp_path):
    """Issue 24, item 2: inputs staged once per content were reused on a `.complete` marker alone, so
    inputs corrupted on the device failed every later run there, blamed on the kernel."""
    from testbed.backends.native.device import stage_inputs

    device = request.getfixturevalue(which)
    rng = np.random.default_rng(3)
    inputs = {"q": rng.standard_normal(300).astype(np.float32), "k": rng.standard_normal(77).astype(np.float32)}
    folder = stage_inputs(device, inputs, tmp_path)
    for name, damage in (("q", b"\0" * 64), ("k", b"")):  # bytes changed in place, a file cut short
        local = tmp_path / "back.npy"
        device.pull(f"{folder}/{name}.npy", local)
        data = bytearray(local.read_bytes())
        data[-len(damage) or len(data) - 8:] = damage
        local.write_bytes(bytes(data))
        device.push(local, f"{folder}/{name}.npy")
    again = tmp_path / "again"
    again.mkdir()
    assert stage_inputs(device, inputs, again) == folder
    for name, array in inputs.items():
        device.pull(f"{folder}/{name}.npy", tmp_path / "back.npy")
        assert np.array_equal(np.load(tmp_path / "back.npy"), array), name
