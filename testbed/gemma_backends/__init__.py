"""Backends that run the Gemma graphs: one module per backend, `testbed/gemma_backends/NAME.py`.

A module provides `backend(w, cfg, run_cfg, device) -> GemmaBackend`. Experiments accept any NAME
found here (`backend=NAME`), so a new backend (native C, IREE) is one new file and no experiment
changes. Masks, tables and the select vector are built on the host by refimpl.gemma.chunk_inputs and
handed over as ChunkInputs, so every backend is fed the same bytes (see testbed.contract for the
flat argument order a compiled graph takes).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

import numpy as np

from refimpl.gemma import ChunkInputs
from testbed.errors import UsageError

KV = list[np.ndarray]


@dataclass
class GemmaBackend:
    name: str
    # tokens [N], selected row -> (logits [vocab], K list, V list) for positions 0..N-1
    prefill_at: Callable[[np.ndarray, int], tuple[np.ndarray, KV, KV]]
    # chunk inputs (C rows), past K, past V -> (logits of the selected row, K/V extended by C rows)
    prefill_with_past: Callable[[ChunkInputs, KV, KV], tuple[np.ndarray, KV, KV]]
    # one-row chunk inputs, past K, past V -> (logits, K/V extended by one row)
    decode_with_past: Callable[[ChunkInputs, KV, KV], tuple[np.ndarray, KV, KV]]


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__))


def make(name: str, w: dict, cfg, run_cfg, device) -> GemmaBackend:
    if name not in available():
        raise UsageError(f"backend={name!r} is not available for the Gemma graphs; accepted: {', '.join(available())}")
    return importlib.import_module(f"{__name__}.{name}").backend(w, cfg, run_cfg, device)
