"""An engine's state.bin on the host: pulled to a file and kept there, never read whole, and compared in
bounded memory (blocks of BLOCK bytes), byte for byte or, where the engine's yaml declares a float layout,
as float32 values within its tolerance.

A state.bin is whatever the engine chose to write (engine contract v1: its own bytes, never interpreted
by testbed beyond the layout its yaml declares), and it can be as large as the model's caches: a 1 GB
state compared as Python bytes took minutes and twice its size in memory. Here a StateFile is a path and
a size; the file is removed when the StateFile is collected."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 1 << 20  # bytes per block compared: bounded memory whatever the state's size
LAYOUTS = {"bytes": np.uint8, "float32": np.dtype("<f4"), "float16": np.dtype("<f2")}


class StateFile:
    """A state file pulled from an engine (response/state.bin): where it is kept on the host and its size.
    The file belongs to this object and is deleted with it."""

    def __init__(self, pulled: Path, name: str = "state.bin"):
        fd, kept = tempfile.mkstemp(prefix="testbed-state-", suffix=".bin")
        os.close(fd)
        shutil.move(str(pulled), kept)
        self.path = Path(kept)
        self.name = name  # what the engine called it (response/state.bin, response/state_before_last.bin)
        self.size = self.path.stat().st_size
        self._remove = weakref.finalize(self, _unlink, self.path)

    def read_bytes(self) -> bytes:
        """The whole file: for tests on small states only (oracles compare with `compare`)."""
        return self.path.read_bytes()

    def __repr__(self) -> str:
        return f"StateFile({self.name}, {self.size} bytes)"


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


@dataclass(frozen=True)
class StateDiff:
    """How two states differ: `same` when they are equal (bytes) or within tolerance (a float layout);
    otherwise how many bytes or values differ, the first (offset in bytes, or index of the value), and for
    a float layout the largest |a - b| among finite values."""

    same: bool
    unit: str              # "bytes" | "float32 values" | "float16 values"
    sizes: tuple[int, int]
    differing: int = 0
    first: int | None = None
    max_abs: float = 0.0
    tolerance: float = 0.0

    def says(self, a: str, b: str) -> str:
        """One clause for a verdict's detail; `a`, `b` name the two states."""
        if self.sizes[0] != self.sizes[1]:
            return f"{a} holds {self.sizes[0]} bytes, {b} {self.sizes[1]}"
        if self.same:
            return f"{a} and {b} are equal" + (f" within {self.tolerance:g}" if self.tolerance else "")
        if self.unit == "bytes":
            return f"{a} and {b} differ in {self.differing} bytes, the first at offset {self.first}"
        return (f"{a} and {b} differ in {self.differing} {self.unit} by more than {self.tolerance:g} (max "
                f"{self.max_abs:.3g}), the first at index {self.first}")


def _blocks(path: Path, block: int):
    with open(path, "rb") as f:
        while True:
            chunk = f.read(block)
            if not chunk:
                return
            yield chunk


def compare(a: StateFile, b: StateFile, layout: str = "bytes", tolerance: float = 0.0,
            block: int = BLOCK) -> StateDiff:
    """a against b in blocks of `block` bytes (bounded memory). layout bytes: every byte equal; float32 /
    float16: the files as little-endian arrays of that dtype, compared as float32 values, each within
    `tolerance` (a NaN or an infinity equals nothing)."""
    if layout not in LAYOUTS:
        raise ValueError(f"state layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    dtype = np.dtype(LAYOUTS[layout])
    unit = "bytes" if layout == "bytes" else f"{layout} values"
    sizes = (a.size, b.size)
    if sizes[0] != sizes[1]:
        return StateDiff(False, unit, sizes, tolerance=tolerance)
    if sizes[0] % dtype.itemsize:
        return StateDiff(False, unit, sizes, first=0, tolerance=tolerance)  # not a whole number of values
    step = max(dtype.itemsize, block - block % dtype.itemsize)
    differing, first, max_abs, seen = 0, None, 0.0, 0
    for x, y in zip(_blocks(a.path, step), _blocks(b.path, step)):
        if layout == "bytes":
            bad = np.frombuffer(x, np.uint8) != np.frombuffer(y, np.uint8)
        else:
            u = np.frombuffer(x, dtype).astype(np.float32)
            v = np.frombuffer(y, dtype).astype(np.float32)
            with np.errstate(invalid="ignore", over="ignore"):
                d = np.abs(u - v)
            finite = np.isfinite(d)
            bad = ~finite | (d > tolerance)
            if finite.any():
                max_abs = max(max_abs, float(d[finite].max()))
        n = int(np.count_nonzero(bad))
        if n and first is None:
            first = seen + int(np.argmax(bad))  # in bytes, or in values of the layout
        differing += n
        seen += bad.size
    return StateDiff(differing == 0, unit, sizes, differing, first, max_abs, tolerance)
