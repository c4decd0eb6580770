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


def mutant_program(target: str, file: str, find: str, replace: str, program: str = "tb_model_bench") -> Path:
    """The device programs built for `target` from a copy of kernels/ with `find` replaced by `replace`
    in kernels/FILE (exactly once), cached by content hash under .cache/kernels/mutants/."""
    text = (kernel_build.KERNELS_DIR / file).read_text()
    assert text.count(find) == 1, f"the planted edit must match kernels/{file} exactly once: {find!r}"
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "kernels"
        shutil.copytree(kernel_build.KERNELS_DIR, copy)
        (copy / file).write_text(text.replace(find, replace))
        return kernel_build.build_programs(target, cache_dir=MUTANTS_DIR, kernels_dir=copy) / program
