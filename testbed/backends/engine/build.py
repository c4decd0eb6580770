"""An engine's program for a build target: its yaml's build command run in its source folder (cached by
content: the source tree's hash, the command and the target), or its prebuilt file for that ABI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from testbed import children
from testbed.backends.engine.spec import EngineSpec
from testbed.backends.native.build import ROOT, BuildError, target_for_abi, tree_hash
from testbed.errors import DeviceError, ToolMissing, UsageError

CACHE_DIR = ROOT / ".cache" / "engines"


class EngineBuildFailed(DeviceError):
    """The engine's build command failed: exit 4, quoting its first error."""


def build_key(spec: EngineSpec, target: str) -> str:
    """What a build is cached by: the source tree's hash, the command and the target."""
    h = hashlib.sha256(json.dumps({"command": list(spec.command or ()), "target": target,
                                   "program": spec.program}, sort_keys=True).encode())
    h.update(tree_hash(spec.source).encode())
    return h.hexdigest()


def check(spec: EngineSpec, target: str) -> None:
    """What is refused before a run starts (exit 2, nothing stored): an engine not built for `target`, or
    whose prebuilt program for it is not a file."""
    if target not in spec.abis:
        raise UsageError(f"engine={spec.name} is not built for {target} ({spec.path}: abis={list(spec.abis)}); "
                         f"accepted devices: those of ABI {', '.join(spec.abis)}")
    if spec.prebuilt is not None:
        path = spec.prebuilt.get(target)
        if path is None or not path.is_file():
            raise UsageError(f"{spec.path}: build.prebuilt.{target}={str(path) if path else None!r} is not a file")


def check_device(spec: EngineSpec, profile) -> None:
    """`check` for the build target of a device profile's ABI."""
    try:
        target = target_for_abi(profile.abi)
    except BuildError:
        raise UsageError(f"engine={spec.name} has no build for device={profile.name} (ABI {profile.abi}); accepted "
                         f"devices: those of ABI {', '.join(spec.abis)}") from None
    check(spec, target)


def program_for(spec: EngineSpec, target: str) -> Path:
    """The program that runs on a device of build target `target` (host, arm32, aarch64, hexagon)."""
    check(spec, target)
    if spec.prebuilt is not None:
        return spec.prebuilt[target]
    out = CACHE_DIR / f"{spec.name}-{target}-{build_key(spec, target)[:16]}"
    if (out / spec.program).is_file():
        return out / spec.program
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill = {"abi": target, "out": str(tmp), "source": str(spec.source), "jobs": str(os.cpu_count() or 1),
            "python": sys.executable}
    argv = [part.format(**fill) for part in spec.command]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:  # a child of testbed's (testbed.children): a stop or testbed's end ends the build too
        p = children.run(argv, cwd=spec.source, capture_output=True, text=True, env=env)
    except FileNotFoundError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ToolMissing(f"engine={spec.name}: its build command's tool {argv[0]!r} is not installed "
                          f"({spec.path}: build.command)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    lines = (p.stderr + "\n" + p.stdout).strip().splitlines()
    if p.returncode != 0 or not (tmp / spec.program).is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        first = next((line.strip() for line in lines if "error" in line.lower()), None) or " | ".join(lines[-3:])
        if p.returncode == 3 or p.returncode == 127:  # testbed's builders and the shell say "tool missing" so
            raise ToolMissing(f"engine={spec.name}: building for {target}: {first}")
        said = f"exited {p.returncode}" if p.returncode else f"left no {spec.program} in {{out}}"
        raise EngineBuildFailed(f"engine={spec.name}: the build command for {target} {said}: {first or 'no output'} "
                                f"({spec.path}: build.command)")
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same build first
    return out / spec.program
