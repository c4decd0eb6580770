"""Prompts as token-id sequences: from a JSON file (a list of ids, or {"tokens": [...]}), a .npy file,
or drawn from a seed. No tokenizer is involved: the oracles compare token ids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from testbed.errors import UsageError


def seeded_prompt(length: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, length).astype(np.int64)


def read_prompt(path: str | Path) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"prompt file {str(path)!r} does not exist; accepted: a .json or .npy file of token ids")
    if path.suffix == ".npy":
        ids = np.load(path, allow_pickle=False)
    elif path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UsageError(f"prompt file {path} is not JSON ({e.msg} at line {e.lineno})") from None
        ids = data["tokens"] if isinstance(data, dict) and "tokens" in data else data
        try:
            ids = np.asarray(ids)
        except ValueError:
            ids = np.asarray([None])
    else:
        raise UsageError(f"prompt file {path} has suffix {path.suffix!r}; accepted: .json, .npy")
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise UsageError(f"prompt file {path} does not hold a non-empty list of integer token ids")
    return ids.astype(np.int64)


def load_prompt(source: str, length: int, vocab: int, seed: int) -> np.ndarray:
    """`source` is "seed" (draw `length` ids) or a file path; a file must hold at least `length` ids,
    all below `vocab`. Returns the first `length` ids."""
    ids = seeded_prompt(length, vocab, seed) if source == "seed" else read_prompt(source)
    if ids.size < length:
        raise UsageError(f"prompt {source!r} has {ids.size} tokens; the cases need at least {length}")
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.size:
        raise UsageError(f"prompt {source!r} holds token id {int(bad[0])}; accepted: ids from 0 to {vocab - 1}")
    return ids[:length]
