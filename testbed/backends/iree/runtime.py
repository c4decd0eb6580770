"""Run IREE artifacts on this host: in-process through the Python runtime, or through the host's
iree-run-module and iree-benchmark-module with .npy inputs and outputs (testbed.backends.iree.device
runs the same tools on a device, through its transport).

Before anything runs, the module is checked against the device that would run it and against its
contract:
  - the device kind and executable format the module was compiled for, read from the module's own
    bytes (IREE embeds its `#hal.device.target<...>` and executable formats), against the driver:
    a Vulkan module is refused on a CPU driver, an arm32 module on this x86 host;
  - for Vulkan, the GPU architecture the module was compiled for (`arch = "..."`) against the
    device's name: a valhall4 (Mali) module runs on lavapipe and returns wrong numbers without an
    error, so it is refused with the target to compile for instead;
  - the contract against the module's exported signature (reflection), naming the first difference;
  - the caller's arrays against the contract.

Read-back on Vulkan: a device-local result cannot be imported to a host pointer on lavapipe
(minImportedHostPointerAlignment 4096), so results are copied on the device queue into a
host-visible staging buffer and read from its mapping.
"""

from __future__ import annotations

import platform
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import numpy as np

from testbed import children
from testbed.backends.iree.artifacts import Artifact, ContractError, check_signature
from testbed.errors import DeviceError
from testbed.results import Figure

CPU_DRIVERS = ("local-sync", "local-task")
DRIVERS = (*CPU_DRIVERS, "vulkan")
# platform.machine() -> the ELF format IREE's llvm-cpu backend emits for it
HOST_ELF = {"x86_64": "embedded-elf-x86_64", "aarch64": "embedded-elf-arm_64", "armv7l": "embedded-elf-arm_32"}
# IREE 3.13's Vulkan driver on Mesa 22.3's lavapipe (Debian 12) fails about 1.5 of 100 module loads
# that read a parameter archive, in the runtime's own parameter load, before any of the module's code
# runs: the device is lost ("DATA_LOSS ... [vkWaitSemaphores] VK_ERROR_DEVICE_LOST ...") or, rarely,
# the read lands in a buffer its allocation has not backed yet ("transient buffer has no staged
# Vulkan backing"). Measured: 60 of 4,000 iree-run-module processes loading the tiny Gemma's prefill
# module, whatever --vulkan_dedicated_compute_queue, --vulkan_tracing, --vulkan_buffer_device_addresses,
# --parameter_mode or MESA_VK_ENABLE_SUBMIT_THREAD said; 5 of 300 in-process loads; 0 of 500 loads of a
# module without parameters. A phone's GPU driver can lose its device too. Such a load is made again
# on a fresh device, at most VULKAN_LOST_RETRIES times; one that fails every time still fails, with
# every attempt's words.
VULKAN_LOST_RETRIES = 3
_VULKAN_LOST = re.compile(r"(?:^|[\s:;])DATA_LOSS;|transient buffer has no staged Vulkan backing")


def vulkan_lost(words: str) -> bool:
    """Whether an IREE error on a Vulkan device is the device losing the call (see VULKAN_LOST_RETRIES)."""
    return bool(_VULKAN_LOST.search(words))


class IncompatibleModule(Exception):
    """The module was compiled for another kind of device than the one asked to run it."""


class VulkanLost(DeviceError):
    """The Vulkan device lost the module's load (vulkan_lost): every session on it is gone with it."""


Loaded = TypeVar("Loaded")


def load_until_kept(load: Callable[[], Loaded], what: str,
                    progress: Callable[[str], None] = lambda msg: None) -> tuple[Loaded, list[str]]:
    """load() made again after each VulkanLost (it opens its fresh device), at most VULKAN_LOST_RETRIES
    times: what it returned, and the words of each loss on the way."""
    losses: list[str] = []
    while True:
        try:
            return load(), losses
        except VulkanLost as lost:
            losses.append(str(lost))
            if len(losses) > VULKAN_LOST_RETRIES:
                raise VulkanLost(f"the Vulkan device lost the load on each of {len(losses)} attempts: "
                                 + " | ".join(losses)) from None
            progress(f"{what}: the Vulkan device lost the module's load; loading again on a fresh device "
                     f"({len(losses)} of {VULKAN_LOST_RETRIES} retries)")


@dataclass(frozen=True)
class ModuleRequirements:
    """What a compiled module needs from a device, as recorded inside the module."""

    device_kinds: tuple[str, ...]      # "local", "vulkan"
    formats: tuple[str, ...]           # embedded-elf-x86_64, vulkan-spirv-fb, ...
    gpu_archs: tuple[str, ...]         # llvmpipe, valhall4, ...

    @classmethod
    def of(cls, module: Path) -> "ModuleRequirements":
        data = module.read_bytes()

        def found(pattern: bytes) -> tuple[str, ...]:
            return tuple(sorted({m.decode() for m in re.findall(pattern, data)}))

        return cls(found(rb'hal\.device\.target<"([\w-]+)"'),
                   found(rb"(embedded-elf-\w+|system-elf-\w+|vmvx-bytecode-fb|vulkan-spirv-fb)"),
                   found(rb'arch = "([\w.-]+)"'))


@lru_cache(maxsize=None)
def vulkan_device_name() -> str:
    import iree.runtime as rt

    devices = rt.get_driver("vulkan").query_available_devices()
    if not devices:
        raise IncompatibleModule("no Vulkan device is available (is mesa-vulkan-drivers installed?)")
    return devices[0]["name"]


def vulkan_devices_by_arch() -> dict[str, str]:
    """--iree-vulkan-target=ARCH -> the Vulkan device name that runs it, from the target configs."""
    from testbed.backends.iree.artifacts import load_target, target_names

    out = {}
    for target in map(load_target, target_names()):
        for flag in target.flags:
            if flag.startswith("--iree-vulkan-target=") and target.vulkan_device:
                out[flag.split("=", 1)[1]] = target.vulkan_device
    return out


def check_runs_on(artifact: Artifact, driver: str) -> None:
    """Refuse, before loading, a module that this driver's device cannot run correctly."""
    if driver not in DRIVERS:
        raise ContractError(f"driver {driver!r} is not supported; accepted: {', '.join(DRIVERS)}")
    need = ModuleRequirements.of(artifact.module)
    built_for = artifact.target.get("name", "an unknown target")
    if driver in CPU_DRIVERS:
        host_format = HOST_ELF.get(platform.machine(), f"embedded-elf-{platform.machine()}")
        if host_format not in need.formats:
            raise IncompatibleModule(
                f"{artifact.module} was compiled for {built_for} ({', '.join(need.formats) or 'no CPU format'}); "
                f"{driver} on this host runs {host_format}: compile for target=host")
        return
    if "vulkan-spirv-fb" not in need.formats:
        raise IncompatibleModule(f"{artifact.module} was compiled for {built_for} "
                                 f"({', '.join(need.formats)}), not Vulkan: compile for target=lavapipe")
    name = vulkan_device_name()
    # The module's own GPU architecture decides (a manifest could be wrong): each Vulkan target's
    # config says which device names run its architecture; an unknown one must appear in the name.
    devices_for = vulkan_devices_by_arch()
    wanted = [devices_for.get(arch, arch) for arch in need.gpu_archs] or [artifact.target.get("vulkan_device")]
    if not all(w and w.lower() in name.lower() for w in wanted):
        raise IncompatibleModule(
            f"{artifact.module} was compiled for Vulkan target {', '.join(need.gpu_archs) or '?'} ({built_for}), "
            f"but this Vulkan device is {name!r}; it would run and return wrong results: "
            f"compile for target=lavapipe")


def open_device(driver: str):
    """A HAL device of its own, never iree.runtime's process-wide cache: a Vulkan device on lavapipe
    keeps threads polling (about one core each, even idle) for as long as it lives, which is the life
    of the process once cached. Every timing taken in this process, and every build beside it, would
    run against that load; so a device lives as long as the session or runner that opened it."""
    import iree.runtime as rt

    return rt.get_device(driver, cache=False)


class RuntimeSession:
    """One loaded module in the Python runtime: call it with numpy arrays, get numpy arrays. It holds
    its device (open_device) unless given one to share (TargetRunner); dropping it releases both."""

    def __init__(self, artifact: Artifact, driver: str = "local-sync", device=None):
        import iree.runtime as rt

        check_runs_on(artifact, driver)
        self.artifact, self.driver, self.contract = artifact, driver, artifact.contract
        self._rt = rt
        instance = rt.VmInstance()
        module = rt.VmModule.mmap(instance, str(artifact.module))
        function = module.lookup_function(self.contract.function)
        if function is None:
            raise ContractError(f"{artifact.module} exports no function {self.contract.function!r}; "
                                f"it has {', '.join(module.function_names)}")
        check_signature(self.contract, function.reflection["iree.abi.declaration"])
        if artifact.parameters is None and artifact.manifest.get("parameters", {}).get("entries"):
            raise ContractError(f"{artifact.module} loads parameters but no parameter archive was given")
        self._instance, self._module, self._function = instance, module, function
        self.lost_device: list[str] = []  # the words of each load a Vulkan device lost on the way
        if device is not None:
            self.attach(device)  # on a loss, the device's owner opens another (TargetRunner)
        else:
            _, self.lost_device = load_until_kept(lambda: self.attach(open_device(driver)), artifact.module.parent.name)

    def attach(self, device) -> None:
        """Load the module on `device`, its parameter archive (if any) read into it: at construction,
        and again on a fresh device after the last one was lost. VulkanLost if this load is lost."""
        rt = self._rt
        self.device = device
        modules = [rt.create_hal_module(self._instance, device)]
        if self.artifact.parameters is not None:
            index = rt.ParameterIndex()
            index.load(str(self.artifact.parameters))
            scope = self.artifact.manifest.get("parameters", {}).get("scope", "model")
            modules.insert(0, rt.create_io_parameters_module(self._instance, index.create_provider(scope=scope)))
        try:
            self._context = rt.VmContext(self._instance, [*modules, self._module])
        except RuntimeError as e:
            if self.driver == "vulkan" and vulkan_lost(str(e)):
                raise VulkanLost(f"{self.artifact.module}: {e}") from None
            raise

    def __call__(self, *arrays: np.ndarray) -> list[np.ndarray]:
        rt = self._rt
        self.contract.check_inputs(arrays)
        args = rt.VmVariantList(len(arrays))
        for a in arrays:
            args.push_ref(self.device.allocator.allocate_buffer_copy(
                memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT,
                device=self.device, buffer=np.ascontiguousarray(a),
                element_type=rt.array_interop.map_dtype_to_element_type(a.dtype)))
        results = rt.VmVariantList(len(self.contract.results))
        self._context.invoke(self._function, args, results)
        return [self._read_back(results.get_as_object(i, rt.HalBufferView), spec.dtype)
                for i, spec in enumerate(self.contract.results)]

    def _read_back(self, view, dtype: str) -> np.ndarray:
        """Copy a result to the host: map it if the host may, else stage it through a host-visible
        buffer on the device's queue (lavapipe's device-local memory cannot be imported)."""
        rt = self._rt
        buffer = view.get_buffer()
        mappable = (buffer.memory_type() & int(rt.MemoryType.HOST_VISIBLE)
                    and buffer.allowed_usage() & int(rt.BufferUsage.MAPPING_SCOPED))
        if not mappable:
            staging = self.device.allocator.allocate_buffer(
                memory_type=rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE,
                allowed_usage=rt.BufferUsage.TRANSFER | rt.BufferUsage.MAPPING,
                allocation_size=buffer.byte_length())
            semaphore = self.device.create_semaphore(0)
            self.device.queue_copy(buffer, staging, [], [(semaphore, 1)])
            rt.HalFence.create_at(semaphore, 1).wait()
            buffer = staging
        shape = tuple(view.shape)
        return np.array(buffer.map().asarray(shape, np.dtype(dtype)), copy=True)


# --- the command-line tools (what a device runs) ---------------------------------------------------


def runtime_tool(name: str) -> str:
    """iree-run-module / iree-benchmark-module / iree-dump-module from iree-base-runtime."""
    import iree._runtime_libs as libs

    return str(Path(libs.__file__).parent / name)


def tool_command(artifact: Artifact, driver: str, inputs: Sequence[str], outputs: Sequence[str] = (),
                 tool: str = "iree-run-module", module: str | None = None, parameters: str | None = None,
                 extra: Sequence[str] = ()) -> list[str]:
    """The argv for one call, with paths as the device sees them (`module`/`parameters` override the
    artifact's local paths, e.g. a phone's work folder)."""
    command = [tool, f"--module={module or artifact.module}", f"--device={driver}",
               f"--function={artifact.contract.function}"]
    if artifact.parameters is not None or parameters:
        scope = artifact.manifest.get("parameters", {}).get("scope", "model")
        command.append(f"--parameters={scope}={parameters or artifact.parameters}")
    command += [f"--input=@{p}" for p in inputs] + [f"--output=@{p}" for p in outputs]
    return command + list(extra)


def run_tool(artifact: Artifact, driver: str, arrays: Sequence[np.ndarray],
             work_dir: str | Path | None = None) -> list[np.ndarray]:
    """One call through iree-run-module on this host, inputs and outputs as .npy files."""
    check_runs_on(artifact, driver)
    contract = artifact.contract
    contract.check_inputs(arrays)
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        inputs, outputs = _npy_files(Path(tmp), arrays, len(contract.results))
        command = tool_command(artifact, driver, inputs, outputs)
        command[0] = runtime_tool(command[0])
        out = children.run(command, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"iree-run-module failed, exit {out.returncode}: {out.stderr.strip()[:2000]}")
        return [np.load(p) for p in outputs]


def benchmark_tool(artifact: Artifact, driver: str, arrays: Sequence[np.ndarray], reps: int = 5,
                   work_dir: str | Path | None = None) -> Figure:
    """Seconds per call from iree-benchmark-module (one repetition = google-benchmark's own loop of
    calls; its mean per call is one sample)."""
    check_runs_on(artifact, driver)
    artifact.contract.check_inputs(arrays)
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        inputs, _ = _npy_files(Path(tmp), arrays, 0)
        command = tool_command(artifact, driver, inputs, tool="iree-benchmark-module",
                               extra=[f"--benchmark_repetitions={reps}", "--benchmark_format=json",
                                      "--benchmark_min_time=0.05s"])
        command[0] = runtime_tool(command[0])
        out = children.run(command, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"iree-benchmark-module failed, exit {out.returncode}: {out.stderr.strip()[:2000]}")
    return parse_benchmark_json(out.stdout)


def _npy_files(folder: Path, arrays: Sequence[np.ndarray], n_outputs: int) -> tuple[list[str], list[str]]:
    inputs = []
    for i, a in enumerate(arrays):
        path = folder / f"input{i}.npy"
        np.save(path, np.ascontiguousarray(a))
        inputs.append(str(path))
    return inputs, [str(folder / f"output{i}.npy") for i in range(n_outputs)]


def compile_progress_on_terminal(msg: str) -> None:
    """Where compile progress goes when the caller has no progress line of its own (a backend
    built outside an experiment's context): one updating line on an interactive stderr."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K" + msg[:120] + ("\n" if "done in" in msg else ""))
        sys.stderr.flush()


class TargetRunner:
    """Graphs compiled on first use (through the artifact cache) and kept loaded: call a Graph on
    arrays on one target and driver."""

    def __init__(self, target: str, driver: str | None = None, progress=None, cache_dir: Path | None = None):
        from testbed.backends.iree.artifacts import load_target

        self.target = load_target(target)
        self.driver = driver or self.target.drivers[0]
        if self.driver not in self.target.drivers:
            raise ContractError(f"driver {self.driver!r} does not load {target} modules; accepted: "
                                f"{', '.join(self.target.drivers)}")
        self.progress, self.cache_dir = progress or compile_progress_on_terminal, cache_dir
        self.artifacts: dict[str, Artifact] = {}
        self._device = None  # one device for all its sessions, opened at the first (open_device)
        self._sessions: dict[tuple, RuntimeSession] = {}
        self._digests: dict[int, tuple] = {}

    def session(self, graph) -> RuntimeSession:
        """The loaded module for `graph`. A graph's name says everything its text depends on (the
        graph builders put every shape and option in it), so it is exported once per runner."""
        from testbed.backends.iree.artifacts import compile_graph

        key = (graph.name, self._digest(graph.weights))
        if key not in self._sessions:
            artifact = compile_graph(graph, self.target, self.cache_dir, self.progress)
            self.artifacts[graph.name] = artifact
            self._load(key, artifact)
        return self._sessions[key]

    def _load(self, key: tuple, artifact: Artifact) -> None:
        """A session for `artifact` on the runner's device. A Vulkan device that loses a load takes
        every session on it along: the next attempt opens a fresh device and loads them all again
        there (in place: a caller's session stays good), at most VULKAN_LOST_RETRIES times."""

        def attempt() -> RuntimeSession:
            try:
                if self._device is None:
                    self._device = open_device(self.driver)
                    for session in self._sessions.values():
                        session.attach(self._device)
                return RuntimeSession(artifact, self.driver, self._device)
            except VulkanLost:
                self._device = None
                raise

        self._sessions[key], _ = load_until_kept(attempt, artifact.module.parent.name, self.progress)

    def _digest(self, weights) -> str:
        """The weights' digest, once per weights object (hashing a gigabyte per call would cost
        more than the call); the object is kept so its id cannot be reused."""
        from testbed.backends.iree.artifacts import weights_digest

        if id(weights) not in self._digests:
            self._digests[id(weights)] = (weights, weights_digest(weights))
        return self._digests[id(weights)][1]

    def __call__(self, graph, *arrays: np.ndarray) -> list[np.ndarray]:
        return self.session(graph)(*arrays)


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
