"""Building the native kernels (kernels/): the host library for Python and the device programs.

Standard library only: setup.py loads this file by path during `pip install`, before numpy or the
package are importable.

  host library   kernels/*.c compiled into testbed/_tb_kernels*.so by setup.py (a setuptools
                 extension without Python bindings, loaded with ctypes by testbed/backends/native/library.py). The
                 sha256 of the kernel sources is compiled in, so a library older than its sources is
                 detected instead of silently measured.
  programs       static benchmark-and-dump programs per target (host, arm32, aarch64, hexagon) built
                 by kernels/Makefile into .cache/kernels/TARGET-HASH/, where HASH covers the sources,
                 the Makefile and the toolchain (its name, compiler version and flags): unchanged
                 inputs are never rebuilt. Each folder's build.json says which toolchain built it,
                 and every device run's evidence carries that and the program's ELF machine.

Toolchains (TOOLCHAINS): `gnu` (Debian's cross gcc, static glibc; the host's cc), `zig` (zig's clang
and musl from the `ziglang` package, the optional extra `testbed[cross]`: static musl programs for
arm32, aarch64 and hexagon, which also run on Android's kernel as they are), `ndk` (ANDROID_NDK_HOME's
clang). The default per target: hexagon zig (nothing else builds for it here), arm32 and aarch64 ndk
when ANDROID_NDK_HOME is set, else gnu. zig's caches live in .cache/zig/ (ZIG_GLOBAL_CACHE_DIR,
ZIG_LOCAL_CACHE_DIR, unless set): musl and compiler-rt are built once per machine, then reused.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

# A checkout holds kernels/ beside the package, and its caches go in it (.cache/). An installed wheel
# carries the kernel sources inside the package (testbed/_shipped/kernels, put there by setup.py) and
# builds its programs where it is run, as its results go (testbed.PROJECT_ROOT).
_PACKAGE = Path(__file__).resolve().parents[2]
if (_PACKAGE.parent / "kernels" / "Makefile").is_file():
    ROOT = _PACKAGE.parent
    KERNELS_DIR = ROOT / "kernels"
else:
    ROOT = Path.cwd()
    KERNELS_DIR = _PACKAGE / "_shipped" / "kernels"
LIBRARY_NAME = "_tb_kernels"
PROGRAMS = ("tb_gdn_bench", "tb_attention_bench", "tb_cache_bench", "tb_model_bench", "tb_hybrid_bench",
            "tb_gemm_bench", "tb_model_engine")
TARGETS = ("host", "arm32", "aarch64", "hexagon")
TOOLCHAINS = ("gnu", "zig", "ndk")
# A device profile's ABI -> the programs' build target (the host profile's ABI is "host").
TARGET_FOR_ABI = {"host": "host", "armeabi-v7a": "arm32", "arm64-v8a": "aarch64", "hexagon": "hexagon"}
# The Hexagon core the programs are built for: the newest qemu-hexagon 7.2 runs (it refuses an ELF
# flagged v68 or later). Hexagon cores run code built for an earlier core, so a phone's v73 or v79 DSP
# runs these too, without the newer cores' instructions (HVX floating point needs v68+).
HEXAGON_CORE = "v67"
# ELF e_machine of each target's programs, and its name as readelf prints it (evidence of what ran).
ELF_MACHINE = {"arm32": 40, "aarch64": 183, "hexagon": 164}
ELF_MACHINE_NAMES = {3: "Intel 80386", 40: "ARM", 62: "Advanced Micro Devices X86-64", 164: "QUALCOMM DSP6",
                     183: "AArch64"}
# The Debian packages of toolchain gnu's compiler and C library for each target.
GNU_PACKAGES = {"arm32": "gcc-arm-linux-gnueabihf libc6-dev-armhf-cross",
                "aarch64": "gcc-aarch64-linux-gnu libc6-dev-arm64-cross", "host": "gcc"}
ZIG_TRIPLES = {"arm32": "arm-linux-musleabihf", "aarch64": "aarch64-linux-musl", "hexagon": "hexagon-linux-musl"}
REBUILD_HINT = "rebuild with `pip install -e .` (or `python setup.py build_ext --inplace`) in the project root"


def library_sources(kernels_dir: Path = KERNELS_DIR) -> list[Path]:
    """The files the host library is compiled from (the programs add kernels/bench/)."""
    return sorted(p for p in kernels_dir.iterdir() if p.suffix in (".c", ".h"))


def source_hash(kernels_dir: Path = KERNELS_DIR) -> str:
    """sha256 over the library sources' names and bytes: what the library says it was built from."""
    h = hashlib.sha256()
    for path in library_sources(kernels_dir):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


# What a hand-run `make` in kernels/ leaves there (its default OUT is build/TARGET): outputs, never read
# by a build of the programs (their OUT is a cache folder), so neither hashed nor snapshotted.
BUILD_OUTPUTS = ("build", "*.o", "*.so")


def tree_files(kernels_dir: Path = KERNELS_DIR) -> list[Path]:
    """Every file a build of the programs can read: all of `kernels_dir` but BUILD_OUTPUTS, in a fixed
    order. A symbolic link anywhere in it is refused (BuildError): its bytes would come from outside
    the tree, or (`loop -> .`) without end."""
    import fnmatch

    kernels_dir = Path(kernels_dir)
    files = []
    for folder, subfolders, names in os.walk(kernels_dir):
        here = Path(folder)
        for name in subfolders + names:
            if (here / name).is_symlink():
                raise LinkInTree(here / name)
        subfolders[:] = sorted(d for d in subfolders if not any(fnmatch.fnmatch(d, p) for p in BUILD_OUTPUTS))
        files += [here / n for n in names if not any(fnmatch.fnmatch(n, p) for p in BUILD_OUTPUTS)]
    return sorted(files, key=lambda f: f.relative_to(kernels_dir).as_posix())


def tree_hash(kernels_dir: Path = KERNELS_DIR) -> str:
    """sha256 over every file of tree_files (relative names and bytes): what a build of the programs
    reads, the library, kernels/bench/ and the Makefile alike. The programs' cache and the A/B
    snapshots are keyed by it; source_hash covers the library's sources only."""
    h = hashlib.sha256()
    for path in tree_files(kernels_dir):
        h.update(path.relative_to(kernels_dir).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()



def whole_folder(out: Path, fill: Callable[[Path], None]) -> None:
    """`fill(tmp)` a fresh folder beside `out`, then rename it to `out`: a concurrent or interrupted
    filling never leaves half a folder under the final name (a tree's snapshot, a patched tree)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        fill(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process filled the same folder first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def host_vector_flags() -> list[str]:
    """The vector path for the machine doing the build: AVX2 + FMA + F16C on x86-64 when the CPU has
    them (and AVX-512 for the matrix products where it exists), NEON on aarch64 (always present), plain
    C otherwise. For what is built and run on one machine (programs, test libraries); the installed
    library is built for every x86-64 level instead (library_variants)."""
    machine = platform.machine().lower()
    flags = cpu_flags()
    if machine in ("x86_64", "amd64") and {"avx2", "fma", "f16c"} <= flags:
        return ["-mavx2", "-mfma", "-mf16c"] + (["-mavx512f"] if "avx512f" in flags else [])
    return []


# -ffp-contract=off: the compiler never fuses a multiply and an add on its own; the kernels decide
# (TB_FUSED in tb_simd.h), so builds that disable fusing are bit-exact with one another.
LIBRARY_CFLAGS = ["-std=c11", "-O3", "-ffp-contract=off", "-fno-math-errno"]


class LibraryVariant(NamedTuple):
    """One build of the host library: its file suffix, compiler flags, and the CPU flags
    (/proc/cpuinfo) a machine needs to run it."""

    suffix: str
    cflags: tuple[str, ...]
    needs: frozenset[str]


def library_variants(machine: str | None = None) -> tuple[LibraryVariant, ...]:
    """The host library is built once per x86-64 level, whatever CPU builds it, and the loader takes
    the best one the running CPU has (library.library_path): a wheel built on an AVX-512 machine runs
    on an AVX2-only or older x86-64 host instead of dying with SIGILL. Elsewhere one build (aarch64's
    NEON is always there)."""
    machine = (machine or platform.machine()).lower()
    baseline = LibraryVariant("", (), frozenset())
    if machine not in ("x86_64", "amd64"):
        return (baseline,)
    # x86-64-v3's vector part: AVX2, FMA and F16C (the f16 weights converted by one instruction)
    avx2, v3 = ("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"})
    return (LibraryVariant("_avx512", avx2 + ("-mavx512f",), v3 | {"avx512f"}),
            LibraryVariant("_avx2", avx2, v3),
            baseline)


def library_extension_args() -> list[dict]:
    """Keyword arguments of the setuptools Extensions that are the host library, one per variant."""
    return [{
        "name": f"testbed.{LIBRARY_NAME}{variant.suffix}",
        "sources": [str(p.relative_to(ROOT)) for p in library_sources() if p.suffix == ".c"],
        "include_dirs": [str(KERNELS_DIR.relative_to(ROOT))],
        "depends": [str(p.relative_to(ROOT)) for p in library_sources() if p.suffix == ".h"],
        "define_macros": [("TB_SOURCE_HASH", f'"{source_hash()}"')],
        "extra_compile_args": LIBRARY_CFLAGS + list(variant.cflags),
        "extra_link_args": ["-pthread"],
        "libraries": ["m"],
    } for variant in library_variants()]


# --- device programs -------------------------------------------------------------------------------


class BuildError(RuntimeError):
    """A toolchain is missing or a compile failed; the message says which and why."""


class LinkInTree(BuildError):
    """A symbolic link in a source tree: its bytes would come from outside the tree (tree_files)."""

    def __init__(self, link: Path):
        self.link = link
        super().__init__(f"{link} is a symbolic link; accepted: a kernels/ tree of plain files and folders (a link's "
                         "bytes would come from outside the tree)")


try:  # setup.py loads this file by path, before the package (and its errors) can be imported
    from testbed.errors import ToolMissing as _ToolMissing
except ImportError:
    _ToolMissing = Exception


class ToolMissing(BuildError, _ToolMissing):
    """A build tool is not installed (zig, make, a compiler): exit status 3, saying how to get it."""

    exit_status = 3


def default_toolchain(target: str) -> str:
    if target == "hexagon":
        return "zig"
    if target in ("arm32", "aarch64") and os.environ.get("ANDROID_NDK_HOME"):
        return "ndk"
    return "gnu"


def zig_binary() -> Path:
    """zig from the `ziglang` package (pip install 'testbed[cross]', or ziglang itself)."""
    try:
        import ziglang
    except ImportError:
        raise ToolMissing("zig is not installed: pip install 'testbed[cross]' (the ziglang package, ~100 MB), "
                         "which builds the hexagon programs and the static-musl arm32/aarch64 ones") from None
    path = Path(ziglang.__file__).parent / "zig"
    if not path.is_file():
        raise ToolMissing(f"the ziglang package has no zig binary at {path}; reinstall it (pip install ziglang)")
    return path


def zig_env(env: dict | None = None) -> dict:
    """The environment for zig: its caches under the project's .cache/zig/ (musl, libc++ and
    compiler-rt are built there once per target, then reused), unless the caller set them."""
    env = dict(os.environ if env is None else env)
    env.setdefault("ZIG_GLOBAL_CACHE_DIR", str(ROOT / ".cache" / "zig" / "global"))
    env.setdefault("ZIG_LOCAL_CACHE_DIR", str(ROOT / ".cache" / "zig" / "local"))
    return env


@functools.lru_cache(maxsize=None)
def _first_line(*argv: str) -> str:
    from testbed import children  # here: setup.py loads this file before the package

    try:
        p = children.run(list(argv), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (p.stdout or p.stderr).strip().splitlines()[0] if p.returncode == 0 and (p.stdout or p.stderr).strip() else ""


# arm32's floating point, FUSED=0 / FUSED=1 (kernels/Makefile: ARM32_FPU). FUSED=0 is ARMv7-A NEON with
# VFPv3, which has no fused multiply-add (every NEON core runs it; the builds bit-exact across targets);
# FUSED=1 targets VFPv4 (NEON VFMA.F32): Cortex-A5, A7, A12, A15, A17 and every ARMv8 core in 32-bit mode,
# not Cortex-A8 or A9.
ARM32_FPU = {False: "neon (VFPv3, no fused multiply-add)", True: "neon-vfpv4 (VFMA.F32)"}


def gnu_compiler(target: str) -> str:
    """The gcc that builds `target` with toolchain gnu (the host's: HOST_CC, default cc)."""
    return {"arm32": "arm-linux-gnueabihf-gcc", "aarch64": "aarch64-linux-gnu-gcc"}.get(target,
                                                                                   os.environ.get("HOST_CC", "cc"))


def toolchain_identity(target: str, toolchain: str, fused: bool = False) -> dict:
    """Which compiler builds `target` with `toolchain`: its name, command and version (and arm32's FPU,
    which FUSED chooses). Part of the programs' cache key and of the evidence of every run."""
    arm32 = {"fpu": ARM32_FPU[bool(fused)]} if target == "arm32" else {}
    if toolchain == "zig":
        zig = zig_binary()
        triple = ZIG_TRIPLES.get(target)
        if triple is None:
            raise BuildError(f"toolchain zig builds for {', '.join(ZIG_TRIPLES)}, not {target!r}")
        cpu = {"hexagon": f"-mcpu=hexagon{HEXAGON_CORE}",
               "arm32": f"-mcpu=generic+v7a+neon+{'vfp4' if fused else 'vfp3'}",
               "aarch64": "-mcpu=generic"}[target]
        return {"toolchain": "zig", "compiler": f"zig {_first_line(str(zig), 'version')} cc",
                "target": f"-target {triple} {cpu}", "libc": "musl (static)", **arm32}
    if toolchain == "ndk":
        ndk = os.environ.get("ANDROID_NDK_HOME", "")
        if not ndk:
            raise ToolMissing("toolchain ndk needs ANDROID_NDK_HOME (the Android NDK's folder)")
        return {"toolchain": "ndk", "compiler": f"Android NDK clang ({ndk})", "target": target, "libc": "bionic",
                **arm32}
    cc = gnu_compiler(target)
    if target == "hexagon":
        raise BuildError("the hexagon programs build with toolchain zig only (no gcc targets Hexagon)")
    if shutil.which(cc) is None:
        raise ToolMissing(f"`{cc}` builds the {target} programs and is not installed (Debian: apt-get install "
                          f"{GNU_PACKAGES.get(target, 'gcc')})")
    return {"toolchain": "gnu", "compiler": _first_line(cc, "--version") or cc, "target": target,
            "libc": "glibc (static)", **arm32}


def _programs_hash(target: str, fused: bool, kernels_dir: Path = KERNELS_DIR, avx512: bool = True,
                   toolchain: str | None = None) -> str:
    toolchain = toolchain or default_toolchain(target)
    h = hashlib.sha256(f"{target} fused={int(fused)}{'' if avx512 else ' avx512=0'}".encode())
    h.update(tree_hash(kernels_dir).encode())
    h.update(json.dumps(toolchain_identity(target, toolchain, fused), sort_keys=True).encode())
    h.update(os.environ.get("ANDROID_NDK_HOME", "").encode())
    return h.hexdigest()


def multiply_add(target: str, fused: bool) -> str:
    """How a build's multiply-adds round, whatever FUSED asked for: "fused" (one rounding: FMA) only
    where the target's flags have a fused multiply-add. arm32's FUSED=1 build targets VFPv4 (NEON
    VFMA.F32; ARM32_FPU), so it fuses (tb_simd.h: TB_MADD_FUSED 1; its micro-kernel says "neon-fma");
    the host's FUSED=1 build adds -mfma where the CPU has it."""
    if not fused:
        return "unfused"
    if target == "host" and platform.machine() in ("x86_64", "amd64") and "fma" not in cpu_flags():
        return "unfused (FUSED=1 asked; this CPU has no FMA)"
    return "fused"


def build_info(program: Path) -> dict:
    """What built a program: its folder's build.json (target, toolchain, compiler), or {}."""
    try:
        info = json.loads((Path(program).parent / "build.json").read_text())
    except (OSError, ValueError):
        return {}
    if "multiply_add" not in info and info.get("target") in TARGETS and "fused" in info:  # a build from before
        info["fused_requested"] = info["fused"]                                           # it was written
        info["multiply_add"] = multiply_add(info["target"], bool(info["fused"]))
        if info["target"] == "arm32" and info["fused"]:  # built then for VFPv3 (no FMA), whatever FUSED said
            info["multiply_add"] = "unfused (FUSED=1 asked; built for ARMv7-A NEON VFPv3, no fused multiply-add)"
        info["fused"] = info["multiply_add"] == "fused"
    return info


def valgrind_program(program: Path) -> Path:
    """The program valgrind runs for a host count: the same program from its build without AVX-512
    (valgrind 3.19 cannot decode it), when `program` is from a host build of kernels/; a program of
    another build (a copied, altered kernels/, another target) is counted as it is."""
    info = build_info(program)
    if info.get("target") != "host" or "-noavx512-" in Path(program).parent.name:
        return Path(program)
    fused = bool(info.get("fused"))
    if Path(program).parent != build_programs("host", fused=fused):
        return Path(program)
    return build_programs("host", fused=fused, avx512=False) / Path(program).name


def target_for_abi(abi: str) -> str:
    """The build target whose programs run on a device of this ABI."""
    if abi == "x86_64" and platform.machine() == "x86_64":
        return "host"
    if abi not in TARGET_FOR_ABI:
        raise BuildError(f"no program build for ABI {abi!r}; the programs build for: {', '.join(TARGET_FOR_ABI)}")
    return TARGET_FOR_ABI[abi]


# A build's temporary folder, OUT.tmpPID (build_programs renames it to OUT when whole): TARGET, the
# variant (toolchain, fused, noavx512), 16 hex digits of the hash, the building process's id.
TEMPORARY = re.compile(r"(?:%s)(?:-(?:%s))?(?:-fused)?(?:-noavx512)?-[0-9a-f]{16}\.tmp([0-9]+)"
                       % ("|".join(TARGETS), "|".join(TOOLCHAINS)))


def remove_stale_temporaries(cache_dir: Path) -> list[Path]:
    """Remove the half-built folders of builds whose process is gone (a SIGKILL mid-build leaves its
    OUT.tmpPID behind; nothing else ever would). Only testbed's own, by their exact name, and never
    through a link; a folder whose process is alive (another build now) is left to it."""
    import socket

    from testbed.devices.private import process_alive  # here: setup.py loads this file before the package

    removed = []
    for path in cache_dir.glob("*.tmp*") if cache_dir.is_dir() else ():
        match = TEMPORARY.fullmatch(path.name)
        if match and not path.is_symlink() and path.is_dir() \
                and process_alive(socket.gethostname(), int(match[1])) is False:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def build_programs(target: str, fused: bool = False, cache_dir: Path | None = None,
                   kernels_dir: Path = KERNELS_DIR, avx512: bool = True, toolchain: str | None = None) -> Path:
    """Build (or reuse) the static programs for `target`; returns the folder holding them.
    fused=False (the default) gives the builds that are bit-exact across targets. kernels_dir: a copy
    of kernels/, possibly altered (the tests' planted bugs), or another revision's (testbed ab).
    avx512=False: the host build without AVX-512, which valgrind can run (host instruction counts).
    toolchain: gnu, zig or ndk (default_toolchain(target) when None)."""
    if target not in TARGETS:
        raise ValueError(f"target {target!r} is not one of {', '.join(TARGETS)}")
    toolchain = toolchain or default_toolchain(target)
    if toolchain not in TOOLCHAINS:
        raise ValueError(f"toolchain {toolchain!r} is not one of {', '.join(TOOLCHAINS)}")
    identity = toolchain_identity(target, toolchain, fused)
    cache_dir = cache_dir or ROOT / ".cache" / "kernels"
    remove_stale_temporaries(cache_dir)
    variant = ("" if toolchain == default_toolchain(target) else f"-{toolchain}") + ("-fused" if fused else "") + \
        ("" if avx512 else "-noavx512")
    out = cache_dir / f"{target}{variant}-{_programs_hash(target, fused, kernels_dir, avx512, toolchain)[:16]}"
    if all((out / p).is_file() for p in PROGRAMS):
        return out
    if shutil.which("make") is None:
        raise ToolMissing("`make` is not installed (Debian: apt-get install make)")
    from testbed.heartbeat import say  # here: setup.py loads this file before the package

    say(f"building testbed's programs for {target} ({toolchain}{', for valgrind' if not avx512 else ''}; "
        "cached by content once built)")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    argv = ["make", "-s", f"-j{os.cpu_count() or 1}", "-C", str(kernels_dir), f"TARGET={target}", f"OUT={tmp}",
            f"TOOLCHAIN={toolchain}", f"SOURCE_HASH={source_hash(kernels_dir)}", f"FUSED={int(fused)}",
            *([] if avx512 else ["AVX512=0"]),
            *([f"ZIG={zig_binary()}", f"HEXAGON_CORE={HEXAGON_CORE}"] if toolchain == "zig" else []), "programs"]
    from testbed import children  # a child of testbed's: a stop or testbed's end ends the build too

    try:
        p = children.run(argv, capture_output=True, text=True, env=zig_env() if toolchain == "zig" else None)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if p.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        lines = (p.stderr or p.stdout).strip().splitlines()
        # the compiler's first error is the cause; what follows it (make's own lines among them) is its echo
        first_error = next((line.strip() for line in lines if "error:" in line), None)
        raise BuildError(f"building the {target} programs failed: {first_error or ' | '.join(lines[-3:])}")
    shutil.rmtree(tmp / "obj")
    computes = multiply_add(target, fused)
    (tmp / "build.json").write_text(json.dumps({"target": target, **identity, "fused": computes == "fused",
                                                "fused_requested": fused, "multiply_add": computes,
                                                "elf_machine": ELF_MACHINE.get(target)}, indent=1) + "\n")
    # a finished build appears at once, so a concurrent or interrupted one never leaves half a folder
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same build first
    return out


def compile_library(kernels_dir: Path, out: Path, optimize: str = "-O2") -> Path:
    """Compile the library sources in `kernels_dir` (a copy of kernels/, possibly altered) into the
    shared library `out` with the host library's flags. For checks that need a second library."""
    sources = [str(p) for p in library_sources(kernels_dir) if p.suffix == ".c"]
    flags = [f for f in LIBRARY_CFLAGS if not f.startswith("-O")] + [optimize] + host_vector_flags()
    argv = ["cc", *flags, "-shared", "-fPIC", "-pthread", f"-I{kernels_dir}",
            f'-DTB_SOURCE_HASH="{source_hash(kernels_dir)}"', "-o", str(out), *sources, "-lm"]
    from testbed import children

    p = children.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        raise BuildError(f"compiling {kernels_dir} failed: {p.stderr.strip().splitlines()[-1:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m testbed.backends.native.build --target=T --kernels=DIR --out=OUT --program=NAME [--fused]`:
    build (or reuse) the programs of DIR for T (--fused: the FMA build, as `fused=true` runs) and copy NAME
    and its build.json into OUT, the build command of engines/testbed-c.yaml and testbed-c-fused.yaml
    (engine contract v1). Exit 3 for a missing tool, 4 for a failed build."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m testbed.backends.native.build")
    parser.add_argument("--target", required=True, choices=TARGETS)
    parser.add_argument("--kernels", default=str(KERNELS_DIR))
    parser.add_argument("--out", required=True)
    parser.add_argument("--program", required=True, choices=PROGRAMS)
    parser.add_argument("--fused", action="store_true", help="the FMA build (FUSED=1), judged by tolerance")
    args = parser.parse_args(argv)
    try:
        folder = build_programs(args.target, fused=args.fused, kernels_dir=Path(args.kernels))
    except ToolMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(folder / args.program, out / args.program)
    shutil.copy2(folder / "build.json", out / "build.json")
    (out / f"{args.program}.d").write_text(depfile(out / args.program, args.target, Path(args.kernels)))
    return 0


def depfile(program: Path, target: str, kernels_dir: Path) -> str:
    """A make-style list of what a build of the programs reads: every file of the kernels tree, this
    builder and the compiler. Left beside the program it copies out, so an engine build of it
    (testbed.backends.engine.build) is reused while they are unchanged."""
    toolchain = default_toolchain(target)
    compiler = zig_binary() if toolchain == "zig" else shutil.which(gnu_compiler(target)) if toolchain == "gnu" \
        else None
    read = [*tree_files(kernels_dir), Path(__file__).resolve(), *([Path(compiler).resolve()] if compiler else [])]
    return f"{program}: " + " \\\n ".join(str(p).replace(" ", "\\ ") for p in read) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
