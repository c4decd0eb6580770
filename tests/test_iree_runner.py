"""The IREE runner on a device (testbed.backends.iree.device): a real module compiled with iree-compile,
staged once per content, run with iree-run-module and benchmarked with iree-benchmark-module, on the
host and over ADB (the loopback arm64 phone runs the aarch64 manylinux tools under qemu-aarch64); its
output judged by an oracle that can fail; targets and modules refused on a device of another kind.
And a Vulkan device that loses a module's load (as lavapipe does now and then): the load is made
again, through the tools and in-process, at most VULKAN_LOST_RETRIES times, and only on Vulkan."""

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from testbed.backends.iree.artifacts import Contract, Graph, TensorSpec, compile_graph
from testbed.backends.iree.device import (IreeDevice, IreeRunFailed, ToolMissing, check_target_fits, device_flags,
                                          host_tools_folder, stage)
from testbed.backends.iree.runtime import VULKAN_LOST_RETRIES, RuntimeSession, TargetRunner, VulkanLost
from testbed.devices import Device
from testbed.devices.profile import Profile
from testbed.devices.transport import sha256_file
from testbed.errors import UsageError
from testbed.oracles.numerical import check_nmse
from testbed.peers.fixtures import adb_connect

pytestmark = pytest.mark.skipif(shutil.which("iree-compile") is None, reason="iree-base-compiler is not installed")

N = 1000
HOST_IREE = {"target": "host", "hal_device": "local-task"}
LAVAPIPE_IREE = {"target": "lavapipe", "hal_device": "vulkan"}
ARM64_IREE = {"target": "aarch64-linux", "hal_device": "local-sync"}


def fma_graph() -> Graph:
    spec = TensorSpec("a", (N,), "float32")
    return Graph("fma_test", lambda w, a, b: (a * b + a,),
                 Contract("main", (spec, dataclasses.replace(spec, name="b")), (dataclasses.replace(spec, name="y"),)))


@pytest.fixture(scope="module")
def host_module():
    return compile_graph(fma_graph(), "host")


@pytest.fixture(scope="module")
def lavapipe_module():
    return compile_graph(fma_graph(), "lavapipe")


@pytest.fixture(scope="module")
def arm64_module():
    return compile_graph(fma_graph(), "aarch64-linux")


def with_iree(device: Device, iree: dict, **fields) -> Device:
    """The same connection, under a profile that names an IREE target (and maybe tools)."""
    return Device(dataclasses.replace(device.profile, iree=iree, **fields), device.transport)


@pytest.fixture(scope="module")
def arm64_phone(loopback_adbd, adb_key):
    """The loopback adbd as an arm64-v8a phone: the exec shim runs aarch64 ELF under qemu-aarch64."""
    device = adb_connect(loopback_adbd, adb_key, name="loopback-arm64", abi="arm64-v8a", iree=ARM64_IREE)
    yield device
    device.close()


def inputs():
    rng = np.random.default_rng(5)
    return rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)


def test_hal_device_flags():
    assert device_flags("local-task", 4) == ["--device=local-task", "--task_topology_group_count=4"]
    assert device_flags("vulkan", 4) == ["--device=vulkan"]
    with pytest.raises(UsageError, match="'cuda' is not accepted"):
        device_flags("cuda", 1)


@pytest.mark.parametrize("where", ["local", "adb-arm64"])
def test_a_module_runs_on_the_device_and_the_oracle_judges_its_output(request, where, host_module, arm64_module):
    if where == "local":
        device, artifact = with_iree(request.getfixturevalue("local_device"), HOST_IREE), host_module
    else:
        device, artifact = request.getfixturevalue("arm64_phone"), arm64_module
    iree = IreeDevice(device, threads=2)
    staged = iree.stage(artifact)
    a, b = inputs()
    with iree.folder() as run:
        iree.run(run, staged, [run.put("a.npy", a), run.put("b.npy", b)], ["y.npy"])
        assert check_nmse({"y": a * b + a}, {"y": run.get("y.npy")}, 1e-12).passed
        # inputs in the wrong order: it still "runs", and the oracle says it is wrong
        iree.run(run, staged, ["b.npy", "a.npy"], ["y.npy"])
        assert not check_nmse({"y": a * b + a}, {"y": run.get("y.npy")}, 1e-7).passed
    evidence = iree.evidence.take()
    assert [e["sha256"] for e in evidence] == [sha256_file(artifact.module)] * 2
    assert device.transport.remote_digest(staged.module) == (artifact.module.stat().st_size, evidence[0]["sha256"])
    assert all(e["device"] == device.name and e["device_seconds"] > 0 for e in evidence)


def test_benchmark_gives_a_figure_from_the_tools_timer(local_device, host_module):
    iree = IreeDevice(with_iree(local_device, HOST_IREE))
    staged = iree.stage(host_module)
    with iree.folder() as run:
        a, b = inputs()
        f = iree.benchmark(run, staged, [run.put("a.npy", a), run.put("b.npy", b)], reps=3, min_time="20x")
    assert f.reps == 3 and f.unit == "s" and 0 < f.min <= f.median <= f.max
    (evidence,) = iree.evidence.take()
    assert "real_time" in evidence["detail"]["timer"] and evidence["device_seconds"] == f.median


def test_files_are_pushed_once_per_content_and_again_when_the_device_lost_them(local_device, host_module):
    remote = stage(local_device, host_module.module, "artifacts")
    on_device = local_device.transport.path(remote)
    first = on_device.stat().st_mtime_ns
    assert stage(local_device, host_module.module, "artifacts") == remote and on_device.stat().st_mtime_ns == first
    on_device.write_bytes(b"not the module")  # the device's copy changed: pushed again
    assert stage(local_device, host_module.module, "artifacts") == remote
    assert sha256_file(on_device) == sha256_file(host_module.module)


def test_a_module_for_another_kind_of_device_is_refused_before_it_is_pushed(arm64_phone, host_module):
    iree = IreeDevice(arm64_phone)
    with pytest.raises(UsageError, match="runs embedded-elf-arm_64"):
        iree.stage(host_module)
    assert arm64_phone.transport.remote_digest(f"artifacts/{sha256_file(host_module.module)[:16]}/module.vmfb") is None


@pytest.mark.parametrize("target, profile, message", [
    ("lavapipe", {"abi": "host", "iree": {"target": "host", "hal_device": "local-sync"}}, "builds vulkan modules"),
    ("host", {"abi": "host", "iree": {"target": "lavapipe", "hal_device": "vulkan"}}, "builds local modules"),
    ("mali", {"abi": "host", "iree": {"target": "lavapipe", "hal_device": "vulkan"}}, "Vulkan code for valhall4"),
    ("arm32", {"abi": "arm64-v8a", "iree": ARM64_IREE}, "builds embedded-elf-arm_32 code"),
    ("host", {"abi": "arm64-v8a", "iree": ARM64_IREE}, "use target=aarch64-linux"),
])
def test_a_target_that_does_not_fit_the_device_is_refused(target, profile, message):
    with pytest.raises(UsageError, match=message):
        check_target_fits(target, Profile(name="d", transport="local", **profile))


def test_an_arm32_device_without_tools_is_told_how_to_get_them(tmp_path):
    profile = Profile(name="arm", transport="qemu", abi="armeabi-v7a", work_dir=str(tmp_path),
                      connection={"emulator": "qemu-arm"}, iree={"target": "arm32", "hal_device": "local-sync"})
    from testbed.devices import connect

    device = connect(profile)
    with pytest.raises(ToolMissing, match="no armv7 build.*Cross-build iree-run-module.*revision [0-9a-f]{40}.*"
                                          "tools.iree-run-module") as e:
        IreeDevice(device)
    assert e.value.exit_status == 3


def test_a_failing_tool_is_an_error_with_its_stderr(local_device, host_module, tmp_path):
    """The real iree-run-module on a module the device's copy of which was cut short: it exits
    non-zero and the error carries its own words."""
    iree = IreeDevice(with_iree(local_device, HOST_IREE))
    staged = iree.stage(host_module)
    cut = tmp_path / "module.vmfb"
    cut.write_bytes(host_module.module.read_bytes()[:4096])
    local_device.push(cut, staged.module)
    try:
        with iree.folder() as run, pytest.raises(IreeRunFailed, match=r"iree-run-module exited [1-9].*\S") as e:
            a, b = inputs()
            iree.run(run, staged, [run.put("a.npy", a), run.put("b.npy", b)], ["y.npy"])
        assert "main" in str(e.value) and not iree.evidence.take()
    finally:
        local_device.push(host_module.module, staged.module)


# What lavapipe's iree-run-module printed when it lost the device in CI (it does so in about 2 of 100
# processes; see VULKAN_LOST_RETRIES).
LOST_DEVICE = ("c/runtime/src/iree/hal/drivers/vulkan/queue.c:2867: DATA_LOSS; [vkSignalSemaphore] "
               "VK_ERROR_DEVICE_LOST; while invoking native function hal.fence.await; while calling variadic "
               "import; \n[ 0] bytecode jit_with_weights@2:11068 -; creating VM context; creating run context")


def losing_tools(folder: Path, losses: int) -> tuple[dict, Path]:
    """The real runtime tools behind a wrapper that loses the device on its first `losses` calls (the
    driver's fault cannot be made to happen on demand), and the file counting its calls."""
    calls, words = folder / "calls", folder / "lost-device.txt"
    words.write_text(LOST_DEVICE + "\n")
    tools = {}
    for name in ("iree-run-module", "iree-benchmark-module"):
        wrapper = folder / name
        wrapper.write_text(f"""#!/bin/sh
n=$(cat '{calls}' 2>/dev/null || echo 0)
echo $((n + 1)) > '{calls}'
if [ "$n" -lt {losses} ]; then cat '{words}' >&2; exit 1; fi
exec '{host_tools_folder() / name}' "$@"
""")
        wrapper.chmod(0o755)
        tools[name] = str(wrapper)
    return tools, calls


@pytest.mark.parametrize("losses", [2, VULKAN_LOST_RETRIES + 1])
def test_a_lost_vulkan_device_is_made_again_and_kept_in_the_evidence(local_device, lavapipe_module, tmp_path, losses):
    """On lavapipe: the call is made again while the device is lost, at most VULKAN_LOST_RETRIES
    times; the output that comes back is still judged, and the record keeps each loss."""
    tools, calls = losing_tools(tmp_path, losses)
    said = []
    iree = IreeDevice(with_iree(local_device, LAVAPIPE_IREE, tools=tools), progress=said.append)
    staged = iree.stage(lavapipe_module)
    a, b = inputs()
    with iree.folder() as run:
        ins = [run.put("a.npy", a), run.put("b.npy", b)]
        if losses > VULKAN_LOST_RETRIES:
            with pytest.raises(IreeRunFailed, match=f"lost the Vulkan device on each of {losses} attempts"):
                iree.run(run, staged, ins, ["y.npy"])
            assert int(calls.read_text()) == losses and not iree.evidence.take()
            return
        iree.run(run, staged, ins, ["y.npy"])
        assert check_nmse({"y": a * b + a}, {"y": run.get("y.npy")}, 1e-12).passed
    (evidence,) = iree.evidence.take()
    lost = evidence["detail"]["lost_device"]  # lavapipe may lose the device for real after the planted losses
    assert lost[:losses] == [LOST_DEVICE] * losses and all("DATA_LOSS;" in w for w in lost)
    assert int(calls.read_text()) == len(lost) + 1 and len(said) == len(lost) and "lost the Vulkan device" in said[0]


def test_data_loss_off_vulkan_is_the_modules_failure_and_not_made_again(local_device, host_module, tmp_path):
    tools, calls = losing_tools(tmp_path, 1)
    iree = IreeDevice(with_iree(local_device, HOST_IREE, tools=tools))
    staged = iree.stage(host_module)
    with iree.folder() as run, pytest.raises(IreeRunFailed, match="exited 1 .*DATA_LOSS"):
        a, b = inputs()
        iree.run(run, staged, [run.put("a.npy", a), run.put("b.npy", b)], ["y.npy"])
    assert int(calls.read_text()) == 1


def scaled_graph(name: str, factor: float) -> Graph:
    """y = a * s, with s a weight: a module that reads a parameter archive when it loads."""
    spec = TensorSpec("a", (N,), "float32")
    return Graph(name, lambda w, a: (a * w["s"],), Contract("main", (spec,), (dataclasses.replace(spec, name="y"),)),
                 weights={"s": np.full(N, factor, np.float32)})


def lose_loads(monkeypatch, losses: int) -> None:
    """The Python runtime's module loads lose the device on the next `losses` tries, then load for real."""
    import iree.runtime as rt

    real, left = rt.VmContext, [losses]

    def context(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("Error creating vm context with modules: " + LOST_DEVICE)
        return real(*args, **kwargs)

    monkeypatch.setattr(rt, "VmContext", context)


def test_in_process_a_lost_load_reloads_every_session_on_a_fresh_device(monkeypatch):
    """A loss while loading the second module takes the first one's device too: both load again on a
    fresh device, and the session the caller already holds still gives the right numbers."""
    said = []
    runner = TargetRunner("lavapipe", progress=said.append)
    a = inputs()[0]
    first = runner.session(scaled_graph("scale_by_two", 2.0))
    lose_loads(monkeypatch, 2)  # the second module's load, then the first's again on the next device
    second = runner.session(scaled_graph("scale_by_three", 3.0))
    assert np.array_equal(first(a)[0], a * 2) and np.array_equal(second(a)[0], a * 3)
    assert first.device is second.device
    assert sum("lost the module's load" in m for m in said) >= 2


@pytest.mark.parametrize("losses", [VULKAN_LOST_RETRIES, VULKAN_LOST_RETRIES + 1])
def test_in_process_a_session_of_its_own_loads_again_at_most_the_retries(monkeypatch, losses):
    artifact = compile_graph(scaled_graph("scale_by_two", 2.0), "lavapipe")
    lose_loads(monkeypatch, losses)
    if losses > VULKAN_LOST_RETRIES:
        with pytest.raises(VulkanLost, match=f"lost the load on each of {losses} attempts"):
            RuntimeSession(artifact, "vulkan")
        return
    session = RuntimeSession(artifact, "vulkan")
    a = inputs()[0]
    assert np.array_equal(session(a)[0], a * 2) and len(session.lost_device) >= losses


def test_in_process_data_loss_off_vulkan_is_not_loaded_again(monkeypatch):
    artifact = compile_graph(scaled_graph("scale_by_two", 2.0), "host")
    lose_loads(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="DATA_LOSS") as e:
        RuntimeSession(artifact, "local-sync")
    assert not isinstance(e.value, VulkanLost)


def test_profile_tools_are_used_where_the_profile_says(local_device):
    tools = {t: str(host_tools_folder() / t) for t in ("iree-run-module", "iree-benchmark-module")}
    iree = IreeDevice(with_iree(local_device, HOST_IREE, tools=tools))
    assert iree.tool("iree-run-module") == tools["iree-run-module"] and iree.source.origin == "device"
    with pytest.raises(ToolMissing, match="not tools.iree-benchmark-module"):
        IreeDevice(with_iree(local_device, HOST_IREE, tools={"iree-run-module": tools["iree-run-module"]}))


@pytest.fixture(scope="module")
def arm32_module():
    return compile_graph(fma_graph(), "arm32")


@pytest.mark.parametrize("abi, target, wrong, runs", [
    ("armeabi-v7a", "arm32", "arm64_module", "embedded-elf-arm_32"),
    ("arm64-v8a", "aarch64-linux", "arm32_module", "embedded-elf-arm_64"),
])
def test_a_module_for_the_other_arm_is_refused_by_its_own_bytes(abi, target, wrong, runs, request):
    """Issue 24, item 6: both ARM formats start embedded-elf-arm; an aarch64 module for an arm32 device
    (or the reverse) is refused by the module check itself, not later by accident."""
    from testbed.backends.iree.device import check_module_fits

    profile = Profile(name="d", transport="local", abi=abi, iree={"target": target, "hal_device": "local-sync"})
    module = request.getfixturevalue(wrong).module
    with pytest.raises(UsageError, match=f"runs {runs}"):
        check_module_fits(module, profile)
    right = request.getfixturevalue("arm32_module" if wrong == "arm64_module" else "arm64_module").module
    check_module_fits(right, profile)
