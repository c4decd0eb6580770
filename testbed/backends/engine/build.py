"""An engine's program for a build target: its yaml's build command run in its source folder, cached by
every file the build reads; or its prebuilt file for that ABI.

A build is reused only while every file it read is unchanged. What a build reads is found three ways,
by what the command is:

  a C/C++ compiler called directly   (cc, gcc, clang, g++, c++, a cross gcc such as aarch64-linux-gnu-gcc,
                                     `python -m ziglang cc`): the compiler is asked for the files its
                                     compile reads (the same argv with `-M`: every source and header,
                                     system headers included, wherever they lie), before building; the
                                     cache key covers their bytes, so the README's yaml, which compiles
                                     testbed's kernels by absolute path outside `source`, rebuilds when
                                     any of them changes
  a command that says what it read  any other command (testbed's own builders, make, a script) that
                                     leaves `{out}/PROGRAM.d`, a make-style dependency list (what
                                     `cc -MD -MF {out}/PROGRAM.d` writes): the build is reused while every
                                     file it lists is unchanged, checked at each use
  anything else                      run again at every use: testbed cannot know before building what
                                     it reads, and a stale program that passes is worse than a build
                                     step that costs what the tool's own up-to-date check costs (make's
                                     timestamps, cmake's, a builder's own cache)

Always covered besides: the source tree (every file of `source`), the command, the target and the
program's name, and every file the command names (an argument, or the value of an `--opt=VALUE`, that
is a file, relative to `source` or absolute; the command's own program found on PATH). Refusing a
build that reads outside `source` was the other choice; it would refuse the README's own example and
llama.cpp's adapter (whose build reads the llama.cpp tree and kernels/bench/), which a lab expects to
work.

Each build's folder holds build-inputs.json: how its inputs were found and each file's sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from testbed import children
from testbed.backends.engine.spec import EngineSpec
from testbed.backends.native.build import ROOT, BuildError, target_for_abi, tree_hash
from testbed.devices.transport import sha256_file
from testbed.errors import DeviceError, ToolMissing, UsageError
from testbed.heartbeat import say

CACHE_DIR = ROOT / ".cache" / "engines"
INPUTS_FILE = "build-inputs.json"

# a compiler driver's name: cc, gcc, g++, c++, clang, clang++, with a target prefix (aarch64-linux-gnu-)
# and a version suffix (-12) allowed
COMPILER = re.compile(r"^(?:[\w.]+-)*(?:cc|c\+\+|gcc|g\+\+|clang|clang\+\+)(?:-[\d.]+)?$")
# what a dependency pre-pass leaves out of the compile's argv: the output and any dependency output it asks for
DROP_WITH_VALUE = {"-o", "-MF", "-MT", "-MQ"}
DROP_ALONE = {"-MD", "-MMD", "-MP", "-c", "-S", "-E"}


class EngineBuildFailed(DeviceError):
    """The engine's build command failed: exit 4, quoting its first error."""


def build_key(spec: EngineSpec, target: str) -> str:
    """What every build of the yaml's command shares: the command, the target, the program, the source
    tree's hash (the files it reads besides are keyed by `program_for`)."""
    h = hashlib.sha256(json.dumps({"command": list(spec.command or ()), "target": target,
                                   "program": spec.program}, sort_keys=True).encode())
    h.update(tree_hash(spec.source).encode())
    return h.hexdigest()


def _fill(spec: EngineSpec, target: str, out: Path) -> list[str]:
    fill = {"abi": target, "out": str(out), "source": str(spec.source), "jobs": str(os.cpu_count() or 1),
            "python": sys.executable}
    return [part.format(**fill) for part in spec.command]


def named_files(argv: list[str], cwd: Path, out: Path) -> list[Path]:
    """The files `argv` names: arguments (or `--opt=VALUE` values) that are files, relative to `cwd` or
    absolute, and its program as PATH finds it; never what lies in the output folder `out`."""
    found = []
    program = shutil.which(argv[0], path=os.environ.get("PATH")) if argv else None
    if program:
        found.append(Path(program).resolve())
    for arg in argv[1:]:
        for value in {arg, arg.partition("=")[2]} - {""}:
            path = (cwd / value) if not os.path.isabs(value) else Path(value)
            if path.is_file() and not path.resolve().is_relative_to(out.resolve()):
                found.append(path.resolve())
    return sorted(set(found))


def compile_argv(argv: list[str]) -> list[str] | None:
    """The compiler driver's part of argv when the command calls a C/C++ compiler directly (`cc ...`,
    `python -m ziglang cc ...`), else None."""
    if argv and COMPILER.match(Path(argv[0]).name):
        return argv
    if len(argv) > 3 and argv[1:3] == ["-m", "ziglang"] and argv[3] in ("cc", "c++"):
        return argv
    return None


def parse_depfile(text: str, cwd: Path) -> list[Path]:
    """The prerequisites of a make-style dependency list (`target: dep dep \\` lines, as `cc -M` writes),
    resolved against `cwd`."""
    deps = []
    for rule in text.replace("\\\n", " ").splitlines():
        colon = re.search(r"(?<!\\):(?:\s|$)", rule)  # the colon that ends the rule's targets
        if colon is None or rule.lstrip().startswith("#"):
            continue
        for word in re.split(r"(?<!\\)\s+", rule[colon.end():].strip()):
            if word:
                path = Path(word.replace("\\ ", " ").replace("\\#", "#").replace("$$", "$"))
                deps.append(path if path.is_absolute() else cwd / path)
    return deps


def compiler_inputs(argv: list[str], cwd: Path) -> list[Path] | None:
    """Every file the compile in `argv` reads, by the compiler's own word (`-M`: sources and headers,
    system headers too), or None when the compiler will not say (the build then runs every time)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in DROP_WITH_VALUE:
            skip = True
            continue
        if arg in DROP_ALONE or (arg.startswith("-o") and len(arg) > 2) or arg.startswith(("-MF", "-MT", "-MQ")):
            continue
        kept.append(arg)
    try:
        p = children.run([*kept, "-M"], cwd=cwd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0 or ":" not in p.stdout:
        return None
    return sorted({path.resolve() for path in parse_depfile(p.stdout, cwd) if path.is_file()})


def digests(paths) -> dict[str, str]:
    return {str(p): sha256_file(p) for p in sorted(set(paths))}


def inputs_hash(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def unchanged(files: dict[str, str]) -> bool:
    """Every file as it was when the build read it."""
    for path, digest in files.items():
        p = Path(path)
        if not p.is_file() or sha256_file(p) != digest:
            return False
    return True


def check(spec: EngineSpec, target: str) -> None:
    """What is refused before a run starts (exit 2, nothing stored): a prebuilt program for `target` that is
    not a file. (A target the engine is not built for is the engine's own refusal, recorded "not supported":
    EngineSpec.refusal.)"""
    if target in spec.abis and spec.prebuilt is not None:
        path = spec.prebuilt.get(target)
        if path is None or not path.is_file():
            raise UsageError(f"{spec.path}: build.prebuilt.{target}={str(path) if path else None!r} is not a file")


def check_device(spec: EngineSpec, profile) -> None:
    """`check` for the build target of a device profile's ABI (one testbed builds nothing for: exit 2)."""
    try:
        target = target_for_abi(profile.abi)
    except BuildError:
        raise UsageError(f"engine={spec.name} has no build for device={profile.name} (ABI {profile.abi}); accepted "
                         f"devices: those of ABI {', '.join(spec.abis)}") from None
    check(spec, target)


def program_for(spec: EngineSpec, target: str) -> Path:
    """The program that runs on a device of build target `target` (host, arm32, aarch64, hexagon)."""
    if target not in spec.abis:  # the experiments record this as the engine's refusal before they ask
        raise UsageError(f"engine={spec.name} is not built for {target} ({spec.path}: abis={list(spec.abis)}); "
                         f"accepted devices: those of ABI {', '.join(spec.abis)}")
    check(spec, target)
    if spec.prebuilt is not None:
        return spec.prebuilt[target]
    prefix = f"{spec.name}-{target}-{build_key(spec, target)[:16]}"
    tmp = CACHE_DIR / f"{prefix}.tmp{os.getpid()}"
    argv = _fill(spec, target, tmp)
    named = digests(named_files(argv, spec.source, tmp))
    compiler = compile_argv(argv)
    if compiler is not None:
        read = compiler_inputs(compiler, spec.source)
        if read is not None:  # every input known before building: the key covers them all
            files = {**named, **digests(read)}
            out = CACHE_DIR / f"{prefix}-{inputs_hash(files)[:16]}"
            if (out / spec.program).is_file():
                return out / spec.program
            return _build(spec, target, argv, tmp, out, {"how": "the compiler's dependency list (-M)", "files": files})
    for folder in sorted(CACHE_DIR.glob(f"{prefix}-*")):  # builds that listed what they read (PROGRAM.d)
        recorded = _recorded(folder)
        if recorded and recorded.get("complete") and (folder / spec.program).is_file() and \
                unchanged(recorded["files"]):
            return folder / spec.program
    return _build(spec, target, argv, tmp, None, {"files": named})


def _recorded(folder: Path) -> dict | None:
    try:
        recorded = json.loads((folder / INPUTS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) and isinstance(recorded.get("files"), dict) else None


def _build(spec: EngineSpec, target: str, argv: list[str], tmp: Path, out: Path | None, inputs: dict) -> Path:
    """Run the build command into `tmp`, then move it to `out` (or, where `out` is None, to a folder named
    by what the build says it read, or by the program's bytes when it says nothing)."""
    say(f"building engine {spec.name} for {target} ({spec.path.name}: build.command; cached by what it reads)")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
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
    prefix = tmp.name.rpartition(".tmp")[0]
    if out is None:
        depfile = tmp / f"{spec.program}.d"
        if depfile.is_file():
            listed = [p.resolve() for p in parse_depfile(depfile.read_text(), spec.source)]
            inputs = {"how": f"the build's own list ({{out}}/{spec.program}.d)", "complete": True,
                      "files": {**inputs["files"], **digests(p for p in listed if p.is_file())}}
            out = CACHE_DIR / f"{prefix}-{inputs_hash(inputs['files'])[:16]}"
        else:  # nothing says what it read: kept for the evidence, never reused
            inputs = {"how": "not known: the command is run at every use", "complete": False, "files": inputs["files"]}
            out = CACHE_DIR / f"{prefix}-run-{sha256_file(tmp / spec.program)[:16]}"
    else:
        inputs = {**inputs, "complete": True}
    (tmp / INPUTS_FILE).write_text(json.dumps({**inputs, "command": shlex.join(argv)}, indent=1) + "\n")
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same build first
    return out / spec.program
