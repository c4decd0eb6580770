"""backend=engine for experiment hybrid: the Qwen3.5 hybrid (GDN layers with conv and recurrent state,
gated full attention with its KV cache) served by an engine under test: llama.cpp through tb_llama_engine
from a GGUF, testbed's own C engine (testbed-c: kernels/tb_hybrid.h) from the safetensors file
backend=native reads, or any engine whose yaml lists hybrid, each handed the model in a format it reads
(testbed.backends.engine.models.HybridModel). testbed owns the plan: one request per prefill, its calls of
C rows over the engine's recurrent state, the logits rows the oracles judge, and for a padded tail the
state bytes after the pad rows are removed. request.json's model.config is the shape as
tb_hybrid_bench's arguments (testbed.backends.native.hybrid.model_args). A refusal is returned as it is
(the experiment records "not supported" with the engine's words), never raised past the oracle that asked.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from refimpl import qwen35
from testbed.backends import NotSupported
from testbed.backends.engine import build, spec as specs
from testbed.backends.engine.runner import Expect, Request, Response, call
from testbed.backends.native import build as kernel_build
from testbed.backends.native.hybrid import model_args
from testbed.devices import Device


def program(device: Device, spec: specs.EngineSpec) -> Path:
    """The engine's program for the device; NotSupported where its yaml does not serve the hybrid there."""
    target = kernel_build.target_for_abi(device.profile.abi)
    if (why := spec.refusal("hybrid", target)) is not None:
        raise NotSupported(why)
    return build.program_for(spec, target)


def model_config(cfg: qwen35.HybridConfig) -> dict:
    """request.json's model.config: the hybrid's shape as tb_hybrid_bench takes it (its arguments' keys)."""
    return dict(a.split("=", 1) for a in model_args(cfg))


def call_ends(past: int, total: int, chunk: int) -> list[int]:
    """The last position of every call of the plan: the past in calls of C rows, then the rest."""
    ends = [min(s + chunk, past) - 1 for s in range(0, past, chunk)]
    return ends + [min(s + chunk, total) - 1 for s in range(past, total, chunk)]


def prefill(device: Device, spec: specs.EngineSpec, engine_program: Path, model: tuple[Path, str],
            cfg: qwen35.HybridConfig, tokens, past: int, chunk: int, logits_at: list[int], tail: str = "none",
            state: bool = False, threads: int = 1, rs_snapshots: int = 0) -> Response:
    """One request: tokens[0:past], then the rest, in calls of `chunk` rows, the last one as `tail` says;
    `model` the (file, format) the engine reads (HybridModel.file_for); `rs_snapshots` recurrent states kept
    for a rollback (0: the engine's default)."""
    model_file, model_format = model
    request = Request("hybrid", np.asarray(tokens, np.int32).reshape(-1), model_file, model_format, "f32",
                      model_config(cfg), past, chunk, logits_at, tail, {"dtype": "float32", "window": 0, "sink": 0},
                      state, threads, rs_snapshots=rs_snapshots)
    return call(device, spec, request, Expect(cfg.vocab), engine_program)
