"""Building the native kernels (kernels/): the host library for Python and the device programs.

Standard library only: setup.py loads this file by path during `pip install`, before numpy or the
package are importable.

  host library   kernels/*.c compiled into testbed/_tb_kernels*.so by setup.py (a setuptools
                 extension without Python bindings, loaded with ctypes by testbed/backends/native/library.py). The
                 sha256 of the kernel sources is compiled in, so a library older than its sources is
                 detected instead of silently measured.
  programs       static benchmark-and-dump programs per target (host, arm32, aarch64) built by
                 kernels/Makefile into .cache/kernels/TARGET-HASH/, where HASH covers the sources,
                 the Makefile and the toolchain choice: unchanged inputs are never rebuilt.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
KERNELS_DIR = ROOT / "kernels"
LIBRARY_NAME = "_tb_kernels"
PROGRAMS = ("tb_gdn_bench", "tb_attention_bench", "tb_cache_bench", "tb_model_bench", "tb_gemm_bench")
TARGETS = ("host", "arm32", "aarch64")
# A device profile's ABI -> the programs' build target (the host profile's ABI is "host").
TARGET_FOR_ABI = {"host": "host", "armeabi-v7a": "arm32", "arm64-v8a": "aarch64"}
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


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def host_vector_flags() -> list[str]:
    """Instruction-set flags for the host library: none. The library is portable (SSE2 on x86-64, NEON
    on aarch64: each architecture's baseline), so a wheel built on an AVX-512 machine runs on any
    x86-64; its matrix products choose their micro-kernel (AVX-512, AVX2, portable) at run time by
    CPUID, from translation units that carry their own target attributes (kernels/tb_gemm.h).
    TB_ISA=avx512|avx2|scalar in the environment forces one; build_info() says which runs."""
    return []


# -ffp-contract=off: the compiler never fuses a multiply and an add on its own; the kernels decide
# (TB_FUSED in tb_simd.h), so builds that disable fusing are bit-exact with one another. The library
# fuses (TB_FUSED=1) where the code's instruction set has an FMA: its matrix products on AVX2 /
# AVX-512 / aarch64; its portable element-wise code on x86-64 (SSE2) has none and stays unfused.
LIBRARY_CFLAGS = ["-std=c11", "-O3", "-ffp-contract=off", "-fno-math-errno", "-DTB_FUSED=1"]


def library_extension_args() -> dict:
    """Keyword arguments of the setuptools Extension that is the host library."""
    return {
        "name": f"testbed.{LIBRARY_NAME}",
        "sources": [str(p.relative_to(ROOT)) for p in library_sources() if p.suffix == ".c"],
        "include_dirs": [str(KERNELS_DIR.relative_to(ROOT))],
        "depends": [str(p.relative_to(ROOT)) for p in library_sources() if p.suffix == ".h"],
        "define_macros": [("TB_SOURCE_HASH", f'"{source_hash()}"')],
        "extra_compile_args": LIBRARY_CFLAGS + host_vector_flags(),
        "extra_link_args": ["-pthread"],
        "libraries": ["m"],
    }


# --- device programs -------------------------------------------------------------------------------


class BuildError(RuntimeError):
    """A toolchain is missing or a compile failed; the message says which and why."""


def _programs_hash(target: str, fused: bool, kernels_dir: Path = KERNELS_DIR, avx512: bool = True) -> str:
    h = hashlib.sha256(f"{target} fused={int(fused)}{'' if avx512 else ' avx512=0'}".encode())
    for path in sorted(kernels_dir.rglob("*")):
        if path.is_file() and (path.suffix in (".c", ".h") or path.name == "Makefile"):
            h.update(str(path.relative_to(kernels_dir)).encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(os.environ.get("ANDROID_NDK_HOME", "").encode())
    return h.hexdigest()


def target_for_abi(abi: str) -> str:
    """The build target whose programs run on a device of this ABI."""
    if abi == "x86_64" and platform.machine() == "x86_64":
        return "host"
    if abi not in TARGET_FOR_ABI:
        raise BuildError(f"no program build for ABI {abi!r}; the programs build for: {', '.join(TARGET_FOR_ABI)}")
    return TARGET_FOR_ABI[abi]


def build_programs(target: str, fused: bool = False, cache_dir: Path | None = None,
                   kernels_dir: Path = KERNELS_DIR, avx512: bool = True) -> Path:
    """Build (or reuse) the static programs for `target`; returns the folder holding them.
    fused=False (the default) gives the builds that are bit-exact across targets. kernels_dir: a copy
    of kernels/, possibly altered (the tests' planted bugs), or another revision's (testbed ab).
    avx512=False: the host build without AVX-512, which valgrind can run (host instruction counts)."""
    if target not in TARGETS:
        raise ValueError(f"target {target!r} is not one of {', '.join(TARGETS)}")
    cache_dir = cache_dir or ROOT / ".cache" / "kernels"
    variant = ("-fused" if fused else "") + ("" if avx512 else "-noavx512")
    out = cache_dir / f"{target}{variant}-{_programs_hash(target, fused, kernels_dir, avx512)[:16]}"
    if all((out / p).is_file() for p in PROGRAMS):
        return out
    if shutil.which("make") is None:
        raise BuildError("`make` is not installed (Debian: apt-get install make)")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    argv = ["make", "-s", f"-j{os.cpu_count() or 1}", "-C", str(kernels_dir), f"TARGET={target}", f"OUT={tmp}",
            f"SOURCE_HASH={source_hash(kernels_dir)}", f"FUSED={int(fused)}", *([] if avx512 else ["AVX512=0"]),
            "programs"]
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise BuildError(f"building the {target} programs failed: {' | '.join(tail)}")
    shutil.rmtree(tmp / "obj")
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
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        raise BuildError(f"compiling {kernels_dir} failed: {p.stderr.strip().splitlines()[-1:]}")
    return out
