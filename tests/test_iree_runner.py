"""The IREE runner: commands built from the profile, and a real module compiled with iree-compile,
pushed, run with iree-run-module and benchmarked with iree-benchmark-module, on the host and over ADB
(the loopback phone runs the host's IREE tools: it is the host underneath)."""

import dataclasses
import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from testbed import PROJECT_ROOT
from testbed.devices import Device
from testbed.errors import UsageError
from testbed.oracles import check_nmse
from testbed.backends.iree.device import IreeJob, benchmark_command, benchmark_module, run_command, run_module

pytestmark = pytest.mark.skipif(shutil.which("iree-compile") is None, reason="iree-base-compiler is not installed")

MLIR = """
func.func @main(%a: tensor<1000xf32>, %b: tensor<1000xf32>) -> tensor<1000xf32> {
  %0 = arith.mulf %a, %b : tensor<1000xf32>
  %1 = arith.addf %0, %a : tensor<1000xf32>
  return %1 : tensor<1000xf32>
}
"""


@pytest.fixture(scope="module")
def module() -> Path:
    """Compiled for this host's CPU, cached by the source's hash."""
    out = PROJECT_ROOT / ".cache" / "iree" / f"fma-{hashlib.sha256(MLIR.encode()).hexdigest()[:16]}.vmfb"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        src = out.with_suffix(".mlir")
        src.write_text(MLIR)
        subprocess.run(["iree-compile", "--iree-hal-target-device=local",
                        "--iree-hal-local-target-device-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host",
                        str(src), "-o", str(out)], check=True, capture_output=True)
    return out


def host_tools(device: Device) -> Device:
    """The device, told where the host's IREE runtime tools are (their real binaries, not shims)."""
    import iree._runtime_libs as libs

    where = Path(libs.__file__).parent
    tools = {t: str(where / t) for t in ("iree-run-module", "iree-benchmark-module")}
    return Device(dataclasses.replace(device.profile, tools=tools), device.transport)


def inputs():
    rng = np.random.default_rng(5)
    return [rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)]


def test_commands_carry_the_profile_tools_device_and_threads(adb_device, module):
    dev = Device(dataclasses.replace(adb_device.profile, tools={"iree-run-module": "/data/local/tmp/iree/run",
                                                                "iree-benchmark-module": "/data/local/tmp/iree/bench"}),
                 adb_device.transport)
    job = IreeJob(module, "main", inputs(), 1, "local-task", threads=4)
    assert run_command(dev, job) == ["/data/local/tmp/iree/run", f"--module={module.name}", "--function=main",
                                     "--device=local-task", "--task_topology_group_count=4",
                                     "--input=@in0.npy", "--input=@in1.npy", "--output=@out0.npy"]
    bench = benchmark_command(dev, dataclasses.replace(job, hal_device="vulkan"), repetitions=7)
    assert "--device=vulkan" in bench and "--benchmark_repetitions=7" in bench
    assert not any(a.startswith("--task_topology") for a in bench)
    with pytest.raises(UsageError, match="no tools.iree-run-module"):
        run_command(adb_device, job)
    with pytest.raises(UsageError, match="'cuda' is not accepted"):
        run_command(dev, dataclasses.replace(job, hal_device="cuda"))


@pytest.mark.parametrize("where", ["local_device", "adb_device"])
def test_a_module_runs_and_the_oracle_judges_its_output(request, where, module):
    device = host_tools(request.getfixturevalue(where))
    a, b = inputs()
    (out,) = run_module(device, IreeJob(module, "main", [a, b], 1, "local-task", threads=2))
    assert check_nmse({"y": a * b + a}, {"y": out}, 1e-12).passed
    # inputs given in the wrong order: it still "runs", and the oracle says it is wrong
    (swapped,) = run_module(device, IreeJob(module, "main", [b, a], 1, "local-task", threads=2))
    assert not check_nmse({"y": a * b + a}, {"y": swapped}, 1e-7).passed


def test_benchmark_gives_a_figure_over_repetitions(local_device, module):
    f = benchmark_module(host_tools(local_device), IreeJob(module, "main", inputs(), 1, "local-task", 1), 3, "20x")
    assert f.reps == 3 and f.unit == "s" and 0 < f.min <= f.median <= f.max
