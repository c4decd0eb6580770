"""Running the benchmark-and-dump programs (kernels/bench/) on the host or under qemu-user.

Each call writes the inputs as .npy into a fresh folder, runs the program for the target (natively
for `host`, through `qemu-arm` / `qemu-aarch64` / `qemu-hexagon` for the ARM and Hexagon builds,
whichever toolchain built them), and reads back the outputs and
the timings JSON. Timings under emulation are only a sign of life, never a device figure.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from testbed import children

EMULATORS = {"host": [], "arm32": ["qemu-arm"], "aarch64": ["qemu-aarch64"], "hexagon": ["qemu-hexagon"]}


class ProgramError(RuntimeError):
    """A benchmark-and-dump program exited with an error; the message carries its stderr."""


def emulator_missing(target: str) -> str | None:
    """Why `target` programs cannot run here (a missing qemu-user), or None."""
    prefix = EMULATORS[target]
    if prefix and shutil.which(prefix[0]) is None:
        return f"{prefix[0]} is not installed (Debian: qemu-user)"
    return None


def run_program(programs: Path, target: str, name: str, inputs: dict[str, np.ndarray], args: dict,
                timeout: float = 120.0, env: dict[str, str] | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """Run programs/NAME on `inputs`; returns ({output name: array}, timings). env: variables added to
    this process's environment for the program (TB_ISA=avx2 forces the matrix products' kernel)."""
    with tempfile.TemporaryDirectory(prefix="tb-native-") as tmp:
        in_dir, out_dir = Path(tmp, "in"), Path(tmp, "out")
        in_dir.mkdir(), out_dir.mkdir()
        for key, a in inputs.items():
            np.save(in_dir / f"{key}.npy", np.ascontiguousarray(a))
        argv = [*EMULATORS[target], str(programs / name), str(in_dir), str(out_dir),
                *(f"{k}={v}" for k, v in args.items())]
        p = children.run(argv, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **env} if env else None)
        if p.returncode != 0:
            raise ProgramError(f"{name} ({target}) exited {p.returncode}: {p.stderr.strip()[-300:]}")
        timings = json.loads((out_dir / "timings.json").read_text())
        outputs = {f.stem: np.load(f) for f in out_dir.glob("*.npy")}
    return outputs, timings


def gdn(programs: Path, target: str, x, form: str, chunk: int = 64, head_map: str = "tiled", env=None, **args):
    """refimpl.gdn inputs (GDNInputs) -> (out, state, timings) from tb_gdn_bench."""
    names = ("q", "k", "v", "g", "beta", "state")
    outputs, timings = run_program(programs, target, "tb_gdn_bench", dict(zip(names, x.arrays())),
                                   {"form": form, "chunk": chunk, "head_map": head_map, **args}, env=env)
    return outputs["out"], outputs["state"], timings


def attention(programs: Path, target: str, q, k, v, mask, scale: float, env=None, **args):
    outputs, timings = run_program(programs, target, "tb_attention_bench",
                                   {"q": q, "k": k, "v": v, "mask": mask}, {"scale": repr(float(scale)), **args},
                                   env=env)
    return outputs["out"], timings


def gemm(programs: Path, target: str, a, b, c, form: str = "gemm", trans: bool = False, accumulate: bool = False,
         lower: bool = False, transa: bool = False, env=None, **args):
    """C = (accumulate ? c : 0) + a b (a given as [K, M] when transa, b as [N, K] when trans) from
    tb_gemm_bench -> (c, timings)."""
    outputs, timings = run_program(programs, target, "tb_gemm_bench", {"a": a, "b": b, "c": c},
                                   {"form": form, "trans": int(trans), "transa": int(transa),
                                    "accumulate": int(accumulate),
                                    "lower": int(lower), **args}, env=env)
    return outputs["c"], timings


def cache_ops(programs: Path, target: str, cache: np.ndarray, rows: np.ndarray, count: int, sink: int, n_pad: int,
              empty_byte: int = 0, **args):
    """Exact append, and snapshot + padded append + rollback, of one uint8 cache -> outputs, timings."""
    return run_program(programs, target, "tb_cache_bench", {"cache": cache, "rows": rows},
                       {"count": count, "sink": sink, "n_pad": n_pad, "empty_byte": empty_byte, **args})
