"""Compiled IREE modules ON a device: iree-run-module and iree-benchmark-module run there, through the
device's transport, on .npy files in a run folder on the device.

What a device needs, and where it comes from:
  target, HAL device   the profile's `iree: {target, hal_device}`; a run's `target=` may override the
                       target but must fit the device's kind (check_target_fits, before anything runs)
  the runtime tools    the profile's tools.iree-run-module / tools.iree-benchmark-module (a device
                       path) if it names them; otherwise the IREE release the host compiles with:
                       the host's own iree-base-runtime tools for an ABI `host` device, the aarch64
                       manylinux wheel of the same version for arm64-v8a (glibc: qemu-aarch64, the
                       loopback adbd, Linux boards; Android's bionic needs profile tools). No armv7
                       wheel exists: an armeabi-v7a device without profile tools is refused, saying
                       how to build them (ToolMissing). A runtime of another version than the
                       compiler is refused too (a module only loads on the runtime it was built for).
  staging              tools, modules and parameter archives are pushed once per content hash into
                       the device's work folder (tools/SHA/NAME, artifacts/SHA/NAME) and reused while
                       the device holds the same bytes; a run's inputs and outputs live in
                       runs/ID/ and are removed with it.

Every run adds Evidence (module name and sha256, the argv, seconds) to the caller's EvidenceLog, so a
record can show it was computed there. Nothing trusts "it ran": a non-zero exit (a crash, a kill, a
module the runtime refuses) is an IreeRunFailed with the tool's stderr tail, and outputs go to the
oracles. One failure is the driver's, not the module's: a Vulkan device that loses the call while
the module loads its parameters (runtime.vulkan_lost). The tools write outputs only on success and
leave the run folder's inputs as they were, so the call is made again in a fresh process, at most
VULKAN_LOST_RETRIES times, and each loss is kept in the call's evidence (detail.lost_device).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import secrets
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from testbed import PROJECT_ROOT, children
from testbed.backends import Evidence, EvidenceLog
from testbed.backends.iree.runtime import (HOST_ELF, VULKAN_LOST_RETRIES, ModuleRequirements, parse_benchmark_json,
                                          vulkan_lost)
from testbed.devices import CommandResult, Device
from testbed.devices.transport import sha256_file
from testbed.errors import DeviceError, UsageError
from testbed.results import Figure

HAL_DEVICES = ("local-task", "local-sync", "vulkan")
RUNTIME_TOOLS = ("iree-run-module", "iree-benchmark-module")
TOOLS_CACHE = PROJECT_ROOT / ".cache" / "iree-tools"
# A profile's ABI -> the ELF format IREE's llvm-cpu backend emits for that CPU.
ABI_ELF = {"armeabi-v7a": "embedded-elf-arm_32", "arm64-v8a": "embedded-elf-arm_64", "x86_64": "embedded-elf-x86_64"}
# --iree-llvmcpu-target-triple's architecture -> the same
TRIPLE_ELF = {"armv7a": "embedded-elf-arm_32", "armv7": "embedded-elf-arm_32", "aarch64": "embedded-elf-arm_64",
              "arm64": "embedded-elf-arm_64", "x86_64": "embedded-elf-x86_64"}


class ToolMissing(DeviceError):
    """The device lacks a runtime tool the backend needs (or has one of another IREE version).
    Exit status 3, like an unreachable device: as configured, the device cannot run this; nothing ran."""

    exit_status = 3


class IreeRunFailed(DeviceError):
    """iree-run-module or iree-benchmark-module exited non-zero on the device (crashed, killed,
    refused the module or its inputs)."""


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


# --- which target fits which device ----------------------------------------------------------------


def device_elf(profile) -> str:
    return HOST_ELF.get(platform.machine(), f"embedded-elf-{platform.machine()}") if profile.abi == "host" \
        else ABI_ELF[profile.abi]


def _flag(flags: Sequence[str], name: str) -> str | None:
    return next((f.split("=", 1)[1] for f in flags if f.startswith(f"--{name}=")), None)


def check_target_fits(target_name: str, profile) -> None:
    """Refuse (UsageError, before anything compiles or runs) a target whose modules the device cannot
    run: a Vulkan target on a CPU device or the reverse, a CPU target for another architecture, a
    Vulkan target for another GPU than the profile's (valhall4 code runs wrongly on lavapipe)."""
    from testbed.backends.iree.artifacts import load_target

    if not profile.iree:
        raise UsageError(f"device={profile.name} names no IREE target (devices/{profile.name}.yaml has no "
                         f"iree: {{target, hal_device}})")
    target, own = load_target(target_name), load_target(profile.iree["target"])
    hal = profile.iree["hal_device"]
    kind = "vulkan" if hal == "vulkan" else "local"
    if target.device_kind != kind:
        raise UsageError(f"target={target_name} builds {target.device_kind} modules; device={profile.name} runs "
                         f"{kind} ones ({hal}): use target={own.name}")
    if kind == "vulkan":
        want, got = _flag(own.flags, "iree-vulkan-target"), _flag(target.flags, "iree-vulkan-target")
        if want != got:
            raise UsageError(f"target={target_name} builds Vulkan code for {got}; device={profile.name}'s GPU "
                             f"is {want}: use target={own.name}")
        return
    triple = _flag(target.flags, "iree-llvmcpu-target-triple")
    built = TRIPLE_ELF.get(triple.split("-")[0], triple) if triple else HOST_ELF.get(platform.machine())
    if built != device_elf(profile):
        raise UsageError(f"target={target_name} builds {built} code; device={profile.name} ({profile.abi}) "
                         f"runs {device_elf(profile)}: use target={own.name}")
    if target.name == "host" and profile.abi != "host":
        raise UsageError(f"target=host builds for this host's CPU; device={profile.name} is another machine: "
                         f"use target={own.name}")


def module_format_for(profile) -> str:
    """The executable format a device runs: vulkan-spirv-fb where its HAL device is Vulkan, else its
    CPU's embedded ELF."""
    return "vulkan-spirv-fb" if profile.iree.get("hal_device") == "vulkan" else device_elf(profile)


def check_module_fits(module: Path, profile) -> None:
    """The same, read from the module's own bytes (its embedded executable formats and GPU
    architecture): a module brought from elsewhere is refused before it is pushed."""
    need = ModuleRequirements.of(module)
    if profile.iree.get("hal_device") == "vulkan":
        from testbed.backends.iree.artifacts import load_target

        arch = _flag(load_target(profile.iree["target"]).flags, "iree-vulkan-target")
        if "vulkan-spirv-fb" not in need.formats or list(need.gpu_archs) not in ([arch], []):
            raise UsageError(f"{module.name} holds {', '.join(need.formats + need.gpu_archs) or 'nothing known'}; "
                             f"device={profile.name} runs Vulkan {arch} code")
        return
    if device_elf(profile) not in need.formats:
        raise UsageError(f"{module.name} holds {', '.join(need.formats) or 'no CPU code'}; device={profile.name} "
                         f"({profile.abi}) runs {device_elf(profile)}")


# --- the runtime tools -----------------------------------------------------------------------------


def compiler_release() -> tuple[str, str]:
    """(version, IREE revision) of the compiler that builds the modules."""
    from iree.compiler import version

    return version.VERSION, version.REVISIONS.get("IREE", "?")


def _release_of(version_py: Path) -> str:
    found = re.search(r'VERSION\s*=\s*"([^"]+)"', version_py.read_text())
    return found.group(1) if found else "unknown"


def host_tools_folder() -> Path:
    import iree._runtime_libs as libs

    return Path(libs.__file__).parent


def aarch64_tools_folder(progress: Callable[[str], None] = lambda msg: None) -> Path:
    """iree-run-module and iree-benchmark-module for aarch64 glibc, from the manylinux wheel of
    iree-base-runtime at the host's installed version: downloaded and unpacked once into
    .cache/iree-tools/VERSION-aarch64/ (with the wheel's version.py, to check the release)."""
    version = importlib.metadata.version("iree-base-runtime")
    folder = TOOLS_CACHE / f"{version}-aarch64"
    wanted = [*RUNTIME_TOOLS, "version.py"]
    if all((folder / name).is_file() for name in wanted):
        return folder
    pip = ["pip", "download", "--no-deps", "--only-binary=:all:", "--platform", "manylinux_2_28_aarch64",
           "--python-version", "3.11", f"iree-base-runtime=={version}"]
    progress(f"fetching the aarch64 IREE runtime tools (iree-base-runtime=={version}) ...")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        out = children.run([sys.executable, "-m", *pip, "-d", tmp], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if out.returncode != 0 or not wheels:
            raise ToolMissing(f"cannot fetch the aarch64 IREE runtime tools: `{' '.join(pip)}` failed: "
                              f"{out.stderr.strip()[-300:]}")
        staging = Path(tmp) / "tools"
        staging.mkdir()
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wanted:
                (staging / name).write_bytes(wheel.read(f"iree/_runtime_libs/{name}"))
                (staging / name).chmod(0o755)
        try:
            os.rename(staging, folder)  # atomic: the folder exists only complete
        except OSError:  # another process unpacked the same wheel first
            pass
    progress(f"aarch64 IREE runtime tools in {folder}")
    return folder


@dataclass(frozen=True)
class ToolSource:
    """Where a device's IREE tools come from: `local` (host files, staged to the device) or `device`
    (paths on the device, from its profile); `release` the IREE version they are, if known."""

    origin: str
    paths: dict[str, str]
    release: str | None
    how: str


def arm32_instructions(profile) -> str:
    version, revision = compiler_release()
    return (f"device={profile.name} ({profile.abi}) has no IREE runtime: no armv7 build of iree-base-runtime exists. "
            f"Cross-build iree-run-module and iree-benchmark-module from IREE's source at the compiler's revision "
            f"{revision} ({version}; github.com/iree-org/iree with its flatcc submodule; runtime only: "
            f"-DIREE_BUILD_COMPILER=OFF, local-sync and local-task drivers; the Android NDK for a phone), copy them "
            f"to the device and name them in devices/{profile.name}.yaml as tools.iree-run-module and "
            f"tools.iree-benchmark-module")


def tool_source(profile, progress: Callable[[str], None] = lambda msg: None) -> ToolSource:
    """The runtime tools for this profile, or ToolMissing saying what is missing and how to get it."""
    named = {t: profile.tools[t] for t in RUNTIME_TOOLS if profile.tools.get(t)}
    if named:
        missing = [t for t in RUNTIME_TOOLS if t not in named]
        if missing:
            raise ToolMissing(f"devices/{profile.name}.yaml names {', '.join(named)} but not "
                              f"{', '.join('tools.' + t for t in missing)}")
        return ToolSource("device", named, None, "the profile's tools")
    if profile.abi == "host":
        folder, how = host_tools_folder(), "the host's iree-base-runtime"
    elif profile.abi == "arm64-v8a":
        folder, how = aarch64_tools_folder(progress), "the aarch64 manylinux iree-base-runtime wheel"
    elif profile.abi == "armeabi-v7a":
        raise ToolMissing(arm32_instructions(profile))
    else:
        raise ToolMissing(f"device={profile.name} ({profile.abi}): no IREE runtime build is known for this ABI; "
                          f"name tools.iree-run-module and tools.iree-benchmark-module in devices/{profile.name}.yaml")
    release = _release_of(folder / "version.py")
    version, _ = compiler_release()
    if release != version:
        raise ToolMissing(f"{how} is IREE {release}, the compiler {version}: a module loads only on the runtime of "
                          f"its release; install iree-base-runtime and iree-base-compiler of one version")
    return ToolSource("local", {t: str(folder / t) for t in RUNTIME_TOOLS}, release, how)


# --- staging ---------------------------------------------------------------------------------------


@lru_cache(maxsize=256)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    """A file's sha256, once per (path, size, mtime): parameter archives of a real model are a gigabyte."""
    return sha256_file(Path(path))


def file_digest(path: Path) -> str:
    st = path.stat()
    return _digest(str(path), st.st_size, st.st_mtime_ns)


def stage(device: Device, local: Path, folder: str, mode: int = 0o644) -> str:
    """`local`'s path on the device, pushed once per content: FOLDER/SHA/NAME is reused while the device
    still holds those exact bytes (size and sha256, computed on the device)."""
    digest = file_digest(local)
    remote = f"{folder}/{digest[:16]}/{local.name}"
    if device.transport.remote_digest(remote) != (local.stat().st_size, digest):
        device.push(local, remote, mode)
    return remote


@dataclass(frozen=True)
class StagedModule:
    module: str               # paths in the device's work folder
    parameters: str | None
    scope: str
    function: str
    name: str                 # the module's file name and sha256, for the evidence
    sha256: str
    n_results: int
    formats: tuple[str, ...] = ()  # the executable formats it holds (embedded-elf-arm_64, vulkan-spirv-fb)


# --- runs ------------------------------------------------------------------------------------------

class IreeDevice:
    """IREE on one connected device: its HAL device and tools, the modules staged on it, and run
    folders in which one call's outputs are the next call's inputs without leaving the device."""

    def __init__(self, device: Device, evidence: EvidenceLog | None = None, threads: int = 1,
                 progress: Callable[[str], None] = lambda msg: None, hal_device: str | None = None):
        """hal_device: another HAL device than the profile's (local-task instead of local-sync)."""
        profile = device.profile
        if not profile.iree:
            raise UsageError(f"device={profile.name} names no IREE target (devices/{profile.name}.yaml has no "
                             f"iree: {{target, hal_device}})")
        self.device, self.threads, self.progress = device, threads, progress
        self.hal_device = hal_device or profile.iree["hal_device"]
        if (self.hal_device == "vulkan") != (profile.iree["hal_device"] == "vulkan"):
            raise UsageError(f"HAL device {self.hal_device} does not run on device={profile.name} "
                             f"(its profile's: {profile.iree['hal_device']})")
        self.evidence = evidence if evidence is not None else EvidenceLog()
        self.source = tool_source(profile, progress)
        self._tools: dict[str, str] = {}
        self._modules: dict[tuple[str, str | None], StagedModule] = {}

    def tool(self, name: str) -> str:
        """The tool's path as a run folder (runs/ID/) sees it: a profile's device path as it is, a host
        file staged once per content into tools/SHA/NAME."""
        if self.source.origin == "device":
            return self.source.paths[name]
        if name not in self._tools:
            self._tools[name] = "../../" + stage(self.device, Path(self.source.paths[name]), "tools", 0o755)
        return self._tools[name]

    def stage(self, artifact) -> StagedModule:
        """An artifact's module (and its parameter archive) on the device, refused first if the module
        was compiled for another kind of device."""
        key = (str(artifact.module), str(artifact.parameters) if artifact.parameters else None)
        if key not in self._modules:
            check_module_fits(artifact.module, self.device.profile)
            module = stage(self.device, artifact.module, "artifacts")
            params = stage(self.device, artifact.parameters, "artifacts") if artifact.parameters else None
            self._modules[key] = StagedModule(
                module, params, artifact.manifest.get("parameters", {}).get("scope", "model"),
                artifact.contract.function, artifact.module.name, file_digest(artifact.module),
                len(artifact.contract.results), ModuleRequirements.of(artifact.module).formats)
        return self._modules[key]

    def _argv(self, tool: str, m: StagedModule, inputs: Sequence[str]) -> list[str]:
        return [self.tool(tool), f"--module=../../{m.module}", f"--function={m.function}",
                *device_flags(self.hal_device, self.threads),
                *([f"--parameters={m.scope}=../../{m.parameters}"] if m.parameters else []),
                *[f"--input=@{name}" for name in inputs]]

    def run(self, run: "RunFolder", m: StagedModule, inputs: Sequence[str], outputs: Sequence[str]) -> CommandResult:
        """One call: inputs and outputs are .npy file names in the run folder (an empty output name
        discards that result on the device)."""
        if len(outputs) != m.n_results:
            raise ValueError(f"{m.function} has {m.n_results} results; {len(outputs)} output names given")
        argv = self._argv("iree-run-module", m, inputs) + [f"--output=@{o}" if o else "--output=" for o in outputs]
        result, lost = self._run_tool(run, argv)
        self.evidence.add(Evidence(self.device.name, m.name, m.sha256, " ".join(argv), result.seconds,
                                   {"timer": "the transport's wall clock around the command",
                                    "module_formats": list(m.formats), **lost}))
        return result

    def benchmark(self, run: "RunFolder", m: StagedModule, inputs: Sequence[str], reps: int = 1,
                  min_time: str = "1x") -> Figure:
        """Seconds per call, from iree-benchmark-module's own timer (Google Benchmark real_time, the
        device's clock) over `reps` repetitions of `min_time` ("<N>x" iterations or "<T>s"). Each
        process first makes one untimed call: a fresh process's first dispatch pays one-time costs
        (lavapipe builds its pipelines then; the parameter file is paged in) that no later call does."""
        argv = self._argv("iree-benchmark-module", m, inputs) + [
            f"--benchmark_repetitions={reps}", "--benchmark_format=json", f"--benchmark_min_time={min_time}",
            "--benchmark_min_warmup_time=1e-6"]
        result, lost = self._run_tool(run, argv)
        figure = parse_benchmark_json(result.stdout)
        self.evidence.add(Evidence(self.device.name, m.name, m.sha256, " ".join(argv), figure.median,
                                   {"timer": "iree-benchmark-module real_time (the device's clock)",
                                    "reps": figure.reps, "module_formats": list(m.formats), **lost}))
        return figure

    def _run_tool(self, run: "RunFolder", argv: list[str]) -> tuple[CommandResult, dict]:
        """The tool's result once it exits 0, and {"lost_device": [each loss's words]} if the Vulkan
        device lost the call on the way (made again in a fresh process)."""
        losses: list[str] = []
        while True:
            result = self.device.run(argv, cwd=run.path)
            if result.returncode == 0:
                return result, ({"lost_device": losses} if losses else {})
            words = self._words(result)
            if not (self.hal_device == "vulkan" and vulkan_lost(words)):
                raise IreeRunFailed(f"{self.device.name}: {Path(argv[0]).name} exited {result.returncode} "
                                    f"({argv[2]}): {words}")
            losses.append(words)
            if len(losses) > VULKAN_LOST_RETRIES:
                raise IreeRunFailed(f"{self.device.name}: {Path(argv[0]).name} lost the Vulkan device on each of "
                                    f"{len(losses)} attempts ({argv[2]}): " + " | ".join(losses))
            self.progress(f"{self.device.name}: {Path(argv[0]).name} lost the Vulkan device ({argv[2]}); "
                          f"making the call again ({len(losses)} of {VULKAN_LOST_RETRIES} retries)")

    @staticmethod
    def _words(result: CommandResult) -> str:
        return (result.stderr or result.stdout).strip()[-600:] or "no output"

    def folder(self) -> "RunFolder":
        return RunFolder(self.device)


class RunFolder:
    """runs/ID/ on the device for one sequence of calls; `put` pushes a host array as NAME.npy, `get`
    pulls one. Removed on exit (with its outputs)."""

    def __init__(self, device: Device):
        self.device, self.path = device, f"runs/iree-{secrets.token_hex(6)}"
        self._tmp = Path(tempfile.mkdtemp(prefix="testbed-iree-"))

    def put(self, name: str, array: np.ndarray) -> str:
        local = self._tmp / name
        np.save(local, np.ascontiguousarray(array))
        self.device.push(local, f"{self.path}/{name}")
        return name

    def get(self, name: str) -> np.ndarray:
        local = self._tmp / name
        self.device.pull(f"{self.path}/{name}", local)
        try:
            return np.load(local, allow_pickle=False)
        except ValueError as e:
            raise IreeRunFailed(f"{self.device.name}: {name} is not a valid .npy file: {e}") from None

    def __enter__(self) -> "RunFolder":
        self.device.run(["mkdir", "-p", self.path], timeout=60)
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)
        try:
            self.device.run(["rm", "-rf", self.path], timeout=60)
        except Exception:  # noqa: BLE001 -- cleanup must not hide the run's own error
            pass
