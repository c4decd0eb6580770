"""A small tmpfs for the tests of a full or read-only results store (mounting needs root)."""

import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(where: Path, size: str, read_only: bool = False):
    """Mount a tmpfs of `size` at `where` for the block; skip the test, saying why, if mounting is refused."""
    where.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0755" + (",ro" if read_only else "")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                       capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount permission): {p.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)
