"""backend=engine for experiment hybrid: the Qwen3.5 hybrid (GDN layers with conv and recurrent state,
gated full attention with its KV cache) served by an engine under test that reads GGUF (llama.cpp
through tb_llama_engine) or a Hugging Face folder (an exporter's input). testbed writes the GGUF
(testbed.models.gguf_files) or the folder (testbed.models.hybrid_checkpoints.hf_folder_of) and owns the plan: one
request per prefill, its calls of C rows over the engine's recurrent state, the logits rows the
oracles judge, and for a padded tail the state bytes after the pad rows are removed. A refusal is
returned as it is (the experiment records "not supported" with the engine's words), never raised
past the oracle that asked.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np

from refimpl import qwen35
from testbed.backends.engine import build, spec as specs
from testbed.backends.engine.runner import Expect, Request, Response, call
from testbed.backends.native import build as kernel_build
from testbed.devices import Device
from testbed.errors import UsageError


def program(device: Device, spec: specs.EngineSpec) -> Path:
    """The engine's program for the device, if it serves the hybrid from a GGUF."""
    if "hybrid" not in spec.techniques:
        raise UsageError(f"engine={spec.name} does not support hybrid ({spec.path}: supports.techniques="
                         f"{list(spec.techniques)})")
    if not {"gguf", "hf"} & set(spec.model_formats):
        raise UsageError(f"engine={spec.name} reads {', '.join(spec.model_formats)}; experiment hybrid gives an "
                         f"engine a GGUF or a Hugging Face folder ({spec.path}: supports.model_formats)")
    return build.program_for(spec, kernel_build.target_for_abi(device.profile.abi))


def call_ends(past: int, total: int, chunk: int) -> list[int]:
    """The last position of every call of the plan: the past in calls of C rows, then the rest."""
    ends = [min(s + chunk, past) - 1 for s in range(0, past, chunk)]
    return ends + [min(s + chunk, total) - 1 for s in range(past, total, chunk)]


def prefill(device: Device, spec: specs.EngineSpec, engine_program: Path, model: Path, cfg: qwen35.HybridConfig,
            tokens, past: int, chunk: int, logits_at: list[int], tail: str = "none", state: bool = False,
            threads: int = 1, rs_snapshots: int = 0, model_format: str = "gguf") -> Response:
    """One request: tokens[0:past], then the rest, in calls of `chunk` rows, the last one as `tail` says;
    `rs_snapshots` recurrent states kept for a rollback (0: the engine's default). `model`: a GGUF, or a
    Hugging Face folder (model_format hf)."""
    request = Request("hybrid", np.asarray(tokens, np.int32).reshape(-1), model, model_format, "f32", asdict(cfg), past,
                      chunk, logits_at, tail, {"dtype": "float32", "window": 0, "sink": 0}, state, threads,
                      rs_snapshots=rs_snapshots)
    return call(device, spec, request, Expect(cfg.vocab), engine_program)
