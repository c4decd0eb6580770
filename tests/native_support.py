"""Shared by the native kernel tests: the shape matrices and libraries with planted bugs.

A planted bug is a one-line edit of a copy of kernels/ (the edit must match exactly once, so a
refactor cannot silently turn a planted-bug test into a test of the correct code), compiled into a
separate library, or separate device programs, cached by the hash of its sources under
.cache/kernels/mutants/.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

from refimpl import gdn as ref
from testbed.backends.native import build as kernel_build, library as native
from testbed.experiments.gdn import AWKWARD_CASES, TBO_CASES

GDN_CASES = TBO_CASES + AWKWARD_CASES
MUTANTS_DIR = kernel_build.ROOT / ".cache" / "kernels" / "mutants"


def mutant_library(file: str, find: str, replace: str):
    """The kernels with `find` replaced by `replace` in kernels/FILE, loaded with ctypes."""
    text = (kernel_build.KERNELS_DIR / file).read_text()
    assert text.count(find) == 1, f"the planted edit must match kernels/{file} exactly once: {find!r}"
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "kernels"
        shutil.copytree(kernel_build.KERNELS_DIR, copy, ignore=shutil.ignore_patterns("bench", "Makefile"))
        (copy / file).write_text(text.replace(find, replace))
        out = MUTANTS_DIR / f"{kernel_build.source_hash(copy)[:16]}.so"
        if not out.exists():
            MUTANTS_DIR.mkdir(parents=True, exist_ok=True)
            partial = out.with_suffix(f".tmp{id(out)}.so")
            kernel_build.compile_library(copy, partial)
            partial.rename(out)
    return native.load_library(out)


def reference64(x: ref.GDNInputs, head_map: str) -> dict[str, np.ndarray]:
    """The float64 serial recurrence: what every form and build is measured against."""
    out, state = ref.gdn_serial(*(a.astype(np.float64) for a in x.arrays()), head_map=head_map)
    return {"out": out, "state": state}


def mutant_program(target: str, file: str, find: str, replace: str, program: str = "tb_model_bench",
                   also: tuple[tuple[str, str], ...] = ()) -> Path:
    """The device programs built for `target` from a copy of kernels/ with `find` replaced by `replace`
    in kernels/FILE (exactly once; `also`: more such edits in that file), cached by content hash under
    .cache/kernels/mutants/."""
    text = (kernel_build.KERNELS_DIR / file).read_text()
    for old, new in ((find, replace), *also):
        assert text.count(old) == 1, f"the planted edit must match kernels/{file} exactly once: {old!r}"
        text = text.replace(old, new)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "kernels"
        shutil.copytree(kernel_build.KERNELS_DIR, copy)
        (copy / file).write_text(text)
        return kernel_build.build_programs(target, cache_dir=MUTANTS_DIR, kernels_dir=copy) / program


def mutant_kernels(file: str, find: str, replace: str) -> Path:
    """A whole copy of kernels/ with `find` replaced by `replace` in kernels/FILE (exactly once), kept
    under .cache/kernels/mutants/src-HASH/ (by content): a source tree for `testbed ab` and the nightly."""
    text = (kernel_build.KERNELS_DIR / file).read_text()
    assert text.count(find) == 1, f"the planted edit must match kernels/{file} exactly once: {find!r}"
    digest = __import__("hashlib").sha256(f"{file}\0{find}\0{replace}\0{kernel_build.tree_hash()}".encode())
    out = MUTANTS_DIR / f"src-{digest.hexdigest()[:16]}" / "kernels"
    if not (out / "Makefile").is_file():
        MUTANTS_DIR.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=MUTANTS_DIR))
        shutil.copytree(kernel_build.KERNELS_DIR, tmp / "kernels")
        (tmp / "kernels" / file).write_text(text.replace(find, replace))
        try:
            tmp.rename(out.parent)
        except OSError:  # made by another process meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# A planted slowdown of the GDN chunkwise kernel: more instructions, the same output. Each chunk of
# each head runs WASTE iterations of a loop on a volatile counter, which the compiler must keep.
WASTE_AT = "static void chunk_step(chunk_scratch *w, const gdn_call *c, int seq, int h, int t0, int L) {\n"


def slowed_chunkwise(iterations: int) -> Path:
    """kernels/ with `iterations` wasted loop turns per chunk step of tb_gdn_chunkwise."""
    waste = (f"    {{ volatile unsigned planted_waste = 0; for (int i = 0; i < {iterations}; i++) "
             "planted_waste = planted_waste + (unsigned)i; }\n")
    return mutant_kernels("gdn.c", WASTE_AT, WASTE_AT + waste)


def cache_missing_chunkwise(reads: int) -> Path:
    """kernels/ whose tb_gdn_chunkwise reads `reads` bytes per chunk step scattered over a 32 MiB buffer
    (its pages touched once, in the warm-up call): a few instructions per read, each a cache and TLB
    miss, so the time grows and the instructions hardly do (the cache-miss kind of slowdown)."""
    plant = ("    { static unsigned char planted_lines[32u << 20]; static int planted_ready; volatile unsigned char sink;\n"
             "      if (!planted_ready) { for (unsigned i = 0; i < sizeof planted_lines; i += 4096) planted_lines[i] = 1; "
             "planted_ready = 1; }\n"
             f"      for (unsigned i = 0; i < {reads}u; i++) sink = planted_lines[(i * 2654435761u) % sizeof planted_lines]; }}\n")
    return mutant_kernels("gdn.c", WASTE_AT, WASTE_AT + plant)


# The hybrid engine program needs only these of the library's sources (GDN, the matrix product; no
# Gemma engine, attention or sliding cache): a planted bug in them rebuilds this one program alone.
HYBRID_SOURCES = "gdn.c tb_parallel.c hybrid.c gemm.c gemm_avx2.c gemm_avx512.c"
# The Gemma-like model engine program's (tb_model_bench): no GDN, no hybrid.
MODEL_SOURCES = "attention.c sliding_cache.c tb_parallel.c model.c model_cache.c model_prefill.c gemm.c gemm_avx2.c " \
                "gemm_avx512.c"


def mutant_hybrid_program(target: str, file: str, find: str, replace: str) -> Path:
    """tb_hybrid_bench for `target` from a copy of kernels/ with one planted edit (mutant_one_program)."""
    return mutant_one_program(target, file, find, replace, "tb_hybrid_bench", HYBRID_SOURCES)


def mutant_one_program(target: str, file: str, find: str, replace: str, program: str, sources: str,
                       avx512: bool = True) -> Path:
    """One program (kernels/bench/PROGRAM.c linked with the library's `sources` only) for `target`, built by
    kernels/Makefile (its compilers and flags; avx512=False: the host build without AVX-512, whose vector code
    is the 8-lane path ARM's NEON runs too) from a copy of kernels/ with `find` replaced by `replace` in
    kernels/FILE (exactly once), cached by content hash under .cache/kernels/mutants/: a planted bug costs one
    program's compile, not every program's."""
    import hashlib
    import os
    import subprocess

    text = (kernel_build.KERNELS_DIR / file).read_text()
    assert text.count(find) == 1, f"the planted edit must match kernels/{file} exactly once: {find!r}"
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "kernels"
        shutil.copytree(kernel_build.KERNELS_DIR, copy)
        (copy / file).write_text(text.replace(find, replace))
        variant = "" if avx512 else " avx512=0"
        key = f"{target} {program} {sources}{variant} {kernel_build.tree_hash(copy)}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        out = MUTANTS_DIR / f"{target}-{program}-{digest}"
        if not (out / program).is_file():
            work = out.with_name(out.name + f".tmp{os.getpid()}")
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            p = subprocess.run(["make", "-s", f"-j{os.cpu_count() or 1}", "-C", str(copy), f"TARGET={target}",
                                f"OUT={work}", f"SOURCE_HASH={kernel_build.source_hash(copy)}", "FUSED=0",
                                *([] if avx512 else ["AVX512=0"]), f"LIB_SRC={sources}", f"PROGRAMS={program}",
                                "programs"], capture_output=True, text=True)
            assert p.returncode == 0, f"building the planted {target} {program} failed: {p.stderr[-500:]}"
            shutil.rmtree(work / "obj")
            try:
                work.rename(out)
            except OSError:  # built by another process meanwhile
                shutil.rmtree(work, ignore_errors=True)
    return out / program
