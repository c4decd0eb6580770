"""Run a compiled IREE module on a device with iree-run-module or iree-benchmark-module.

The commands are built from the profile: its tool paths (tools.iree-run-module, ...; the bare names on
the host), the HAL device (`local-task` with N worker threads, `local-sync`, or `vulkan`), the module,
its parameter files and inputs as .npy. Outputs come back as .npy; benchmark times as Google
Benchmark JSON, parsed into Figures. A module only loads on the device kind it was compiled for, and
a Vulkan module that RUNS is not thereby right (valhall4 code runs wrongly on lavapipe): outputs always
go to the oracles.
"""

from __future__ import annotations

import json
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from testbed.devices import CommandResult, Device
from testbed.errors import DeviceError, UsageError
from testbed.results import Figure

HAL_DEVICES = ("local-task", "local-sync", "vulkan")


@dataclass
class IreeJob:
    module: Path
    function: str
    inputs: list[np.ndarray]
    n_outputs: int
    hal_device: str = "local-task"
    threads: int = 1
    parameters: list[Path] = field(default_factory=list)
    timeout: float | None = None


def tool(device: Device, name: str) -> str:
    """Where a tool lives on the device: the profile's path, or the bare name on the host."""
    path = device.profile.tools.get(name)
    if path:
        return path
    if device.profile.transport in ("local", "qemu"):
        return name
    raise UsageError(f"device {device.name!r} has no tools.{name} in devices/{device.name}.yaml")


def device_flags(hal_device: str, threads: int) -> list[str]:
    if hal_device not in HAL_DEVICES:
        raise UsageError(f"hal device {hal_device!r} is not accepted; accepted: {', '.join(HAL_DEVICES)}")
    flags = [f"--device={hal_device}"]
    if hal_device == "local-task":
        # An exact worker count (not a maximum the topology detection may undercut).
        flags.append(f"--task_topology_group_count={threads}")
    return flags


def run_command(device: Device, job: IreeJob) -> list[str]:
    """iree-run-module argv, with paths relative to the run folder the files are pushed into."""
    return [tool(device, "iree-run-module"), f"--module={job.module.name}", f"--function={job.function}",
            *device_flags(job.hal_device, job.threads),
            *[f"--parameters={p.name}" for p in job.parameters],
            *[f"--input=@in{i}.npy" for i in range(len(job.inputs))],
            *[f"--output=@out{i}.npy" for i in range(job.n_outputs)]]


def benchmark_command(device: Device, job: IreeJob, repetitions: int = 5, min_time: str = "") -> list[str]:
    """min_time: Google Benchmark's per-repetition budget, "<N>x" iterations or "<T>s" (default 0.5 s)."""
    return [tool(device, "iree-benchmark-module"), f"--module={job.module.name}", f"--function={job.function}",
            *device_flags(job.hal_device, job.threads),
            *[f"--parameters={p.name}" for p in job.parameters],
            *[f"--input=@in{i}.npy" for i in range(len(job.inputs))],
            f"--benchmark_repetitions={repetitions}", "--benchmark_format=json",
            *([f"--benchmark_min_time={min_time}"] if min_time else [])]


_UNIT_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_benchmark_json(text: str) -> Figure:
    """Google Benchmark JSON -> a Figure in seconds over the per-repetition (iteration) rows."""
    start = text.find("{")
    try:
        data = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError as e:
        raise DeviceError(f"iree-benchmark-module did not print JSON: {e}") from None
    rows = [b for b in (data or {}).get("benchmarks", []) if b.get("run_type", "iteration") == "iteration"]
    if not rows:
        raise DeviceError("iree-benchmark-module reported no benchmark repetitions")
    return Figure.of([b["real_time"] * _UNIT_S[b.get("time_unit", "ns")] for b in rows], "s")


def _stage(device: Device, job: IreeJob, run_dir: str, tmp: Path) -> None:
    device.push(job.module, f"{run_dir}/{job.module.name}")
    for p in job.parameters:
        device.push(p, f"{run_dir}/{p.name}")
    for i, array in enumerate(job.inputs):
        np.save(tmp / f"in{i}.npy", np.ascontiguousarray(array))
        device.push(tmp / f"in{i}.npy", f"{run_dir}/in{i}.npy")


def _check(device: Device, result: CommandResult, what: str) -> None:
    if result.returncode != 0:
        raise DeviceError(f"{device.name}: {what} exited {result.returncode}: "
                          f"{(result.stderr or result.stdout).strip()[-400:]}")


def run_module(device: Device, job: IreeJob) -> list[np.ndarray]:
    run_dir = f"runs/iree-{secrets.token_hex(6)}"
    try:
        with tempfile.TemporaryDirectory(prefix="testbed-iree-") as tmp:
            tmp = Path(tmp)
            _stage(device, job, run_dir, tmp)
            _check(device, device.run(run_command(device, job), job.timeout, cwd=run_dir), "iree-run-module")
            outputs = []
            for i in range(job.n_outputs):
                device.pull(f"{run_dir}/out{i}.npy", tmp / f"out{i}.npy")
                outputs.append(np.load(tmp / f"out{i}.npy", allow_pickle=False))
            return outputs
    finally:
        device.run(["rm", "-rf", run_dir], timeout=60)


def benchmark_module(device: Device, job: IreeJob, repetitions: int = 5, min_time: str = "") -> Figure:
    run_dir = f"runs/iree-{secrets.token_hex(6)}"
    try:
        with tempfile.TemporaryDirectory(prefix="testbed-iree-") as tmp:
            _stage(device, job, run_dir, Path(tmp))
            result = device.run(benchmark_command(device, job, repetitions, min_time), job.timeout, cwd=run_dir)
            _check(device, result, "iree-benchmark-module")
            return parse_benchmark_json(result.stdout)
    finally:
        device.run(["rm", "-rf", run_dir], timeout=60)
