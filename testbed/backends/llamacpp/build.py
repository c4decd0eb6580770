"""llama.cpp's tools built from real source for a device's ABI, cached by content.

The source is a llama.cpp tree given by path, or by default the one the `llama-cpp-python` sdist
vendors (SDIST), which `pip download` fetches from the package index into .cache/llamacpp/sdist/ the
first time. Neither is part of this repository; testbed only holds the CMake project that builds
what it runs (CMakeLists.txt beside this file):

  test-backend-ops  llama.cpp's op harness (tests/test-backend-ops.cpp), linked against ggml alone
  tb_ggml_gdn       testbed's own program running ggml's GATED_DELTA_NET on .npy inputs, so that
                    testbed's float64 reference judges ggml's CPU op (test-backend-ops cannot: it
                    compares a backend with ggml's CPU backend, with itself when it is the CPU)
  llama-bench       llama.cpp's benchmark (compiles libllama too: only built when asked for)
  tb_llama_logits   testbed's own program: libllama's logits for every position of a token sequence,
                    llama.cpp's answer for a GGUF model (a third reference; libllama, only when asked)
  tb_llama_engine   testbed's adapter putting libllama under engine contract v1 (engines/llamacpp.yaml):
                    chunked prefill with past, padded tail with rollback, state bytes (libllama)

Targets, chosen from the device profile (target_for):

  host          the machine itself, GGML_NATIVE on (what this CPU has)
  host-generic  the machine without GGML_NATIVE: x86-64 with ggml's default instruction sets (AVX2, no
                AVX-512), the build valgrind can run where this CPU has AVX-512 (`testbed ab` counts the
                host's instructions with it)
  aarch64       arm64-v8a Linux or Android CPU: Debian's aarch64-linux-gnu cross compiler, static
                binaries (no sysroot needed under qemu-aarch64 or on a phone), GGML_NATIVE off
  hexagon       a device of ABI hexagon (qemu-hexagon, adb-loopback-hexagon): ggml's CPU backend (generic
                C, no Hexagon-specific code) and the programs built with zig's clang and libc++ for
                hexagon-linux-musl (-mcpu=hexagonv67), static; zig, CMake's compiler wrappers and zig's
                caches are testbed's (.cache/llamacpp/zig/, .cache/zig/). Every program links
                tb_eh_globals.c, without which any C++ throw jumps to address 0 in a static Hexagon
                executable (the file says why; libllama throws while loading a GGUF). ggml's own
                Hexagon backend (GGML_HEXAGON: the HTP ops for a phone's NPU, built with Qualcomm's SDK
                and started over FastRPC) is not this build: it needs the SDK's toolchain and an Android host side
  android-htp   a phone whose profile has `htp`: the Android NDK with ggml's Hexagon backend
                (GGML_HEXAGON); needs ANDROID_NDK_HOME and HEXAGON_SDK_ROOT / HEXAGON_TOOLS_ROOT
                (Qualcomm's SDK, not in any registry here) and is refused with that message otherwise;
                not exercised on these machines, which have neither

Every build is CPU-only otherwise, without OpenMP (threads from ggml's own pool; OpenMP and static
glibc do not mix). The source is first copied to .cache/llamacpp/src/HASH/ (HASH = sha256 over the
files a build reads), so a build is of exactly the bytes it is cached under even if the checkout
changes meanwhile, and built in HASH/build-TARGET-OPTIONS/. The programs land in
.cache/llamacpp/TARGET-KEY/ (KEY covers the source hash, the target's CMake options and compilers,
and testbed's CMake project and program); a second request for the same key costs a hash. With ccache
installed, compiles are shared between sources too: a patched copy of llama.cpp recompiles only the
files it changed (CCACHE_BASEDIR makes paths relative to the snapshot).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from testbed import children
from testbed.backends.native.build import KERNELS_DIR, ROOT
from testbed.errors import ToolMissing, UsageError
from testbed.heartbeat import say

SDIST = ("llama-cpp-python", "0.3.36")
HERE = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "llamacpp"
ENGINE = "tb_llama_engine"
# the adapter with one planted fault each (tb_llama_engine.c): only the oracles' own tests build them
PLANTED_ENGINES = ("tb_llama_engine_plant_chunk_off_by_one", "tb_llama_engine_plant_keep_pad_row",
                   "tb_llama_engine_plant_state_wrong_sequence", "tb_llama_engine_plant_state_before_last_call")
PROGRAMS = ("test-backend-ops", "tb_ggml_gdn", "llama-bench", "tb_llama_logits", ENGINE, *PLANTED_ENGINES)
TARGETS = ("host", "host-generic", "aarch64", "hexagon", "android-htp")
# Top-level entries of a llama.cpp tree a build never reads (the snapshot and its hash leave them out).
NOT_BUILT = ("models", "docs", "media", "examples", "pocs", "gguf-py", "scripts", "benches", "skills")
# testbed's own inputs to the build: the CMake project, the program and the .npy harness it links.
OWN_FILES = (HERE / "CMakeLists.txt", HERE / "tb_eh_globals.c", HERE / "tb_ggml_gdn.c", HERE / "tb_llama_logits.c",
             HERE / "tb_llama_engine.c",
             KERNELS_DIR / "bench" / "tb_engine.c", KERNELS_DIR / "bench" / "tb_engine.h", KERNELS_DIR / "bench" / "harness.c",
             KERNELS_DIR / "bench" / "harness.h", KERNELS_DIR / "tb_parallel.c", KERNELS_DIR / "tb_parallel.h",
             KERNELS_DIR / "tb_kernels.h", KERNELS_DIR / "tb_simd.h")


class BuildError(RuntimeError):
    """A source, toolchain or SDK is missing, or a build step failed; the message says which."""


@dataclass(frozen=True)
class Built:
    """The programs of one build, on the host."""

    target: str
    folder: Path
    source_hash: str
    info: dict

    def program(self, name: str) -> Path:
        return self.folder / name


# --- the source ------------------------------------------------------------------------------------


def sdist_source(cache: Path = CACHE, progress: Callable[[str], None] = say) -> Path:
    """The llama.cpp tree vendored by the llama-cpp-python sdist, downloaded once by pip."""
    name, version = SDIST
    archive_dir = cache / "sdist"
    stem = f"{name.replace('-', '_')}-{version}"
    tree = archive_dir / stem / "vendor" / "llama.cpp"
    if tree.is_dir():
        return tree
    archive_dir.mkdir(parents=True, exist_ok=True)
    archive = archive_dir / f"{stem}.tar.gz"
    if not archive.is_file():
        progress(f"downloading the {name}=={version} sdist (76 MB) with pip")
        p = children.run(["python3", "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                          "--disable-pip-version-check", "-d", str(archive_dir), f"{name}=={version}"],
                         capture_output=True, text=True)
        if p.returncode != 0 or not archive.is_file():
            tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-2:]) or "no output"
            raise ToolMissing(f"llama.cpp's source is not here and pip could not download {name}=={version} "
                              f"(offline?): {tail}; get it with `pip download --no-deps --no-binary :all: -d "
                              f"{archive_dir} {name}=={version}` where the index is reachable, or name a llama.cpp "
                              "tree with llamacpp.source=DIR")
    progress(f"extracting {archive.name}")
    tmp = archive_dir / f".{stem}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    try:
        (tmp / stem).rename(archive_dir / stem)
    except OSError:
        pass  # another process extracted it first
    shutil.rmtree(tmp, ignore_errors=True)
    return tree


def resolve_source(source: str, progress: Callable[[str], None] = say) -> Path:
    """`source`: empty for the sdist's llama.cpp, or the path of a llama.cpp tree."""
    if not source:
        return sdist_source(progress=progress)
    tree = Path(source).expanduser().resolve()
    if not (tree / "ggml" / "include" / "ggml.h").is_file() or not (tree / "tests" / "test-backend-ops.cpp").is_file():
        raise UsageError(f"llamacpp.source={source!r} is not a llama.cpp tree; accepted: a folder holding "
                         "ggml/include/ggml.h and tests/test-backend-ops.cpp, or empty for the "
                         f"{SDIST[0]}=={SDIST[1]} sdist")
    try:
        built_files(tree)  # no symbolic link among what a build reads
    except UsageError as e:
        raise UsageError(f"llamacpp.source={source!r}: {e}") from None
    return tree


def built_path(relative: str) -> bool:
    """Whether a build may read the file at `relative` (a path inside a llama.cpp tree): everything but the
    top-level folders NOT_BUILT, hidden ones and earlier build folders."""
    top = relative.split("/", 1)[0]
    return not (top.startswith((".", "build")) or top in NOT_BUILT)


def built_files(tree: Path) -> list[Path]:
    """Every file a build may read (built_path), in a fixed order. A symbolic link among them is refused
    (UsageError: bad input, exit 2), as in a kernels/ tree: its bytes would come from outside the tree."""
    files = []
    for folder, subfolders, names in os.walk(tree):
        here = Path(folder)
        inside = [n for n in subfolders + names if built_path((here / n).relative_to(tree).as_posix())]
        for name in inside:
            if (here / name).is_symlink():
                raise UsageError(f"{(here / name).relative_to(tree)} is a symbolic link; accepted: a llama.cpp tree "
                                 "of plain files and folders (a link's bytes would come from outside the tree)")
        subfolders[:] = [d for d in subfolders if d in inside]
        files += [here / n for n in names if n in inside]
    return sorted(files, key=lambda f: f.relative_to(tree).parts)  # the order source_hash has always had


def source_hash(tree: Path) -> str:
    """sha256 over the relative names and bytes of every file a build may read."""
    h = hashlib.sha256()
    for path in built_files(tree):
        h.update(str(path.relative_to(tree)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def snapshot(tree: Path, digest: str, cache: Path = CACHE) -> Path:
    """A copy of the built files under src/HASH/ (made once; `.complete` marks a whole copy)."""
    dest = cache / "src" / digest[:16]
    if (dest / ".complete").is_file():
        return dest
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for path in built_files(tree):
        target = tmp / path.relative_to(tree)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    (tmp / ".complete").write_text(digest + "\n")
    try:
        tmp.rename(dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process made the same copy first
    return dest


# --- targets ---------------------------------------------------------------------------------------


def target_for(name: str, abi: str, capabilities) -> str:
    """The build whose programs run on the device of this profile name, ABI and capabilities."""
    if abi == "host":
        return "host"
    if abi == "arm64-v8a":
        return "android-htp" if "htp" in (capabilities or ()) else "aarch64"
    if abi == "hexagon":
        return "hexagon"
    raise BuildError(f"device={name} has ABI {abi!r}; llama.cpp's tools are built for: host, arm64-v8a "
                     "(aarch64, or android-htp where the profile has htp), hexagon")


def _require(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise ToolMissing(f"`{tool}` is not installed (Debian: apt-get install {package})")
    return path


def cmake_options(target: str) -> list[str]:
    """The target's CMake cache settings (its toolchain given on the command line)."""
    common = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_OPENMP=OFF",
              "-DGGML_CCACHE=OFF", "-DLLAMA_BUILD_NUMBER=0"]
    if target == "host":
        return common + ["-DGGML_NATIVE=ON"]
    if target == "host-generic":
        return common + ["-DGGML_NATIVE=OFF"]
    if target == "aarch64":
        return common + ["-DGGML_NATIVE=OFF", "-DCMAKE_SYSTEM_NAME=Linux", "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
                         f"-DCMAKE_C_COMPILER={_require('aarch64-linux-gnu-gcc', 'gcc-aarch64-linux-gnu')}",
                         f"-DCMAKE_CXX_COMPILER={_require('aarch64-linux-gnu-g++', 'g++-aarch64-linux-gnu')}",
                         "-DCMAKE_EXE_LINKER_FLAGS=-static"]
    if target == "hexagon":
        wrappers = zig_wrappers("hexagon")
        return common + ["-DGGML_NATIVE=OFF", "-DCMAKE_SYSTEM_NAME=Linux", "-DCMAKE_SYSTEM_PROCESSOR=hexagon",
                         f"-DCMAKE_C_COMPILER={wrappers['cc']}", f"-DCMAKE_CXX_COMPILER={wrappers['c++']}",
                         f"-DCMAKE_AR={wrappers['ar']}", f"-DCMAKE_RANLIB={wrappers['ranlib']}",
                         "-DCMAKE_EXE_LINKER_FLAGS=-static", "-DGGML_CPU_REPACK=OFF", "-DGGML_LLAMAFILE=OFF"]
    if target == "android-htp":
        ndk, sdk, tools = (os.environ.get(v, "") for v in ("ANDROID_NDK_HOME", "HEXAGON_SDK_ROOT", "HEXAGON_TOOLS_ROOT"))
        if not (ndk and sdk and tools):
            raise BuildError("building for a Hexagon phone needs the Android NDK and Qualcomm's Hexagon SDK: set "
                             "ANDROID_NDK_HOME, HEXAGON_SDK_ROOT and HEXAGON_TOOLS_ROOT (unset here); or run on "
                             "an aarch64 device (device=qemu-aarch64, backend CPU)")
        return common + ["-DGGML_NATIVE=OFF", f"-DCMAKE_TOOLCHAIN_FILE={ndk}/build/cmake/android.toolchain.cmake",
                         "-DANDROID_ABI=arm64-v8a", "-DANDROID_PLATFORM=android-31", "-DGGML_HEXAGON=ON",
                         f"-DHEXAGON_SDK_ROOT={sdk}", f"-DHEXAGON_TOOLS_ROOT={tools}"]
    raise BuildError(f"target {target!r} is not accepted; accepted: {', '.join(TARGETS)}")


ZIG_TARGET = {"hexagon": ("hexagon-linux-musl", "-mcpu=hexagonv67")}


def zig_wrappers(target: str, cache: Path = CACHE) -> dict[str, Path]:
    """Executables CMake can take as its compilers, archiver and ranlib: each runs zig's (`zig cc
    -target ...`, `zig c++ ...`, `zig ar`, `zig ranlib`) with zig's caches under .cache/zig/. Written
    once per content (their text names zig's path and version)."""
    from testbed.backends.native.build import zig_binary, zig_env

    zig = zig_binary()  # ToolMissing, saying how to get zig
    triple, cpu = ZIG_TARGET[target]
    env = zig_env({})
    exports = "".join(f'export {k}="${{{k}:-{v}}}"\n' for k, v in sorted(env.items()))
    # -static on every call: CMake's compiler checks link too, and a static link reuses the musl the
    # kernels' build made (a dynamic one would build another libc first)
    commands = {"cc": f"cc -target {triple} {cpu} -static", "c++": f"c++ -target {triple} {cpu} -static", "ar": "ar",
                "ranlib": "ranlib"}
    texts = {name: f"#!/bin/sh\n# zig's {name} for {target} (testbed.backends.llamacpp.build)\n{exports}"
                   f'exec "{zig}" {command} "$@"\n' for name, command in commands.items()}
    digest = hashlib.sha256("".join(texts.values()).encode()).hexdigest()[:12]
    folder = cache / "zig" / f"{target}-{digest}"
    if not all((folder / name).is_file() for name in texts):
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            _write_whole(folder / name, lambda tmp, text=text: (tmp.write_text(text), tmp.chmod(0o755)))
    return {name: folder / name for name in texts}


def toolchain_of(target: str, options: list[str]) -> dict:
    """Which toolchain built a target's programs (stored in build.json, carried by the evidence)."""
    if target in ZIG_TARGET:
        triple, cpu = ZIG_TARGET[target]
        from testbed.backends.native.build import _first_line, zig_binary

        return {"toolchain": "zig", "compiler": f"zig {_first_line(str(zig_binary()), 'version')} cc/c++",
                "target": f"-target {triple} {cpu}", "libc": "musl (static), libc++"}
    return {"toolchain": "ndk" if target == "android-htp" else "gnu",
            "compiler": _toolchain_identity(options).splitlines()[0], "target": target}


def _toolchain_identity(options: list[str]) -> str:
    """The compilers' versions (a compiler upgrade is a different build)."""
    compilers = [o.split("=", 1)[1] for o in options if o.startswith(("-DCMAKE_C_COMPILER=", "-DCMAKE_CXX_COMPILER="))]
    versions = []
    for cc in compilers or ["cc", "c++"]:
        p = children.run([cc, "--version"], capture_output=True, text=True)
        versions.append(p.stdout.splitlines()[0] if p.returncode == 0 and p.stdout else cc)
        if "/zig/" in cc:  # the wrapper: its text names zig's path and target
            versions.append(Path(cc).read_text())
    return "\n".join(versions)


def build_key(target: str, digest: str, options: list[str]) -> str:
    h = hashlib.sha256(f"{target}\n{digest}\n{chr(10).join(options)}\n{_toolchain_identity(options)}\n".encode())
    if target == "host":
        h.update(_host_cpu().encode())  # GGML_NATIVE: what this CPU has
    for path in OWN_FILES:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _host_cpu() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


# --- building --------------------------------------------------------------------------------------


def build(target: str, source: str = "", programs: tuple[str, ...] = ("test-backend-ops", "tb_ggml_gdn"),
          progress: Callable[[str], None] = say, cache: Path = CACHE) -> Built:
    """Build (or reuse) `programs` for `target` from `source` (see resolve_source)."""
    unknown = [p for p in programs if p not in PROGRAMS]
    if unknown:
        raise BuildError(f"program {unknown[0]!r} is not accepted; accepted: {', '.join(PROGRAMS)}")
    options = cmake_options(target)
    tree = resolve_source(source, progress)
    digest = source_hash(tree)
    key = build_key(target, digest, options)
    out = cache / f"{target}-{key[:16]}"
    info_path = out / "build.json"
    if all((out / p).is_file() for p in programs):
        return Built(target, out, digest, json.loads(info_path.read_text()))
    _require("cmake", "cmake")
    _require("ninja", "ninja-build")
    snap = snapshot(tree, digest, cache)
    build_dir = snap / f"build-{target}-{key[:12]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per folder; a second process waits, then reuses
        missing = [p for p in programs if not (out / p).is_file()]
        if not missing:
            return Built(target, out, digest, json.loads(info_path.read_text()))
        env = dict(os.environ)
        launcher = []
        if shutil.which("ccache"):
            env |= {"CCACHE_DIR": str(cache / "ccache"), "CCACHE_BASEDIR": str(snap.parent),
                    "CCACHE_NOHASHDIR": "1", "CCACHE_SLOPPINESS": "time_macros"}
            launcher = ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        t0 = time.monotonic()
        if not (build_dir / "build.ninja").is_file():
            progress(f"llama.cpp for {target}: configuring {snap.name} ({tree})")
            _step(["cmake", "-S", str(HERE), "-B", str(build_dir), "-G", "Ninja", f"-DLLAMACPP_SOURCE={snap}",
                   f"-DTESTBED_KERNELS={KERNELS_DIR}", f"-DTESTBED_SOURCE_HASH={digest}", *options, *launcher],
                  env, build_dir / "configure.log", progress, f"configuring llama.cpp for {target}")
        jobs = min(2, os.cpu_count() or 1)
        _step(["nice", "-n", "10", "cmake", "--build", str(build_dir), f"-j{jobs}", "--target", *missing], env,
              build_dir / "build.log", progress, f"building {' '.join(missing)} for {target}")
        seconds = time.monotonic() - t0
        out.mkdir(parents=True, exist_ok=True)
        previous = json.loads(info_path.read_text()) if info_path.is_file() else {"builds": []}
        info = {"target": target, "source": str(tree), "source_sha256": digest, "key": key, "options": options,
                "ccache": bool(launcher), "toolchain": toolchain_of(target, options),
                "builds": previous["builds"] + [{"programs": missing, "seconds": round(seconds, 1)}]}
        # build.json first, then each program, each appearing whole or not at all
        _write_whole(info_path, lambda tmp: tmp.write_text(json.dumps(info, indent=1) + "\n"))
        for name in missing:
            _write_whole(out / name, lambda tmp: shutil.copy2(build_dir / "bin" / name, tmp))
        return Built(target, out, digest, info)


def _write_whole(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    tmp.rename(path)


def _step(argv: list[str], env: dict, log: Path, progress: Callable[[str], None], what: str) -> None:
    """Run a build step, its output to `log` and its progress lines ("[12/57] Building ...") to the
    terminal; a failure raises with the log's last lines."""
    # a child of testbed's (testbed.children): a stop or testbed's end ends the build too
    p = children.start(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with open(log, "w") as f:
            for line in children.lines(p):
                f.write(line)
                if line.startswith("["):
                    progress(f"{what}: {line.strip()[:100]}")
        p.wait()
    finally:
        children.end(p)
    if p.returncode != 0:
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        # the compiler's first error is the cause; what follows it (ninja's own lines among them) is its echo
        first_error = next((line.strip() for line in lines if "error:" in line or line.startswith("CMake Error")), None)
        said = f"first error: {first_error}" if first_error else " | ".join(lines[-4:])
        raise BuildError(f"{what} failed (exit {p.returncode}; log {log}): {said}")


# --- the engine's build command (engines/llamacpp.yaml) ------------------------------------------------

# engine contract ABIs -> the targets above (arm32 is not built: llama.cpp's ARMv7 path is not set up here)
CONTRACT_TARGETS = {"host": "host", "aarch64": "aarch64", "hexagon": "hexagon"}


def main(argv: list[str] | None = None) -> int:
    """python -m testbed.backends.llamacpp.build ABI OUT [PROGRAM ...] [--source DIR]

    Builds the programs (default: the engine adapter) for a contract ABI from the llama.cpp tree DIR
    (default: the sdist's), cached by content as above, and puts them and build.json in OUT."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m testbed.backends.llamacpp.build")
    parser.add_argument("abi")
    parser.add_argument("out")
    parser.add_argument("programs", nargs="*", default=[ENGINE])
    parser.add_argument("--source", default="")
    args = parser.parse_args(argv)
    if args.abi not in CONTRACT_TARGETS:
        print(f"error: abi={args.abi!r} is not built for llama.cpp; accepted: {', '.join(CONTRACT_TARGETS)}", file=sys.stderr)
        return 2
    try:
        built = build(CONTRACT_TARGETS[args.abi], args.source, tuple(args.programs),
                      progress=lambda line: print(line, file=sys.stderr, flush=True))
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    except (UsageError, ToolMissing) as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_status
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ["build.json", *args.programs]:
        _write_whole(out / name, lambda tmp, name=name: shutil.copy2(built.folder / name, tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
