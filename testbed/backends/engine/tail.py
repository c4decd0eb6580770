"""backend=engine for experiment tail: a prompt prefilled by the engine under test with its last partial
chunk padded (tail.mode padded: padded to C rows, the pad rows then removed) or run scalar (tail.mode
scalar), on sliding-window caches. What the oracles compare is what the contract returns: the first
token's logits and the sequence's state bytes (state.bin), compared byte for byte between the two
modes and never interpreted; the bench times the prefill by the engine's own clock."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from refimpl import gemma
from testbed.backends import NotSupported
from testbed.backends.engine import build, spec as specs
from testbed.backends.engine.gemma import model_config
from testbed.backends.engine.models import GemmaModel
from testbed.backends.engine.runner import Expect, Request, Response, call
from testbed.backends.native import build as kernel_build
from testbed.devices import Device

MODES = ("padded", "scalar")


def program(device: Device, spec: specs.EngineSpec) -> Path:
    target = kernel_build.target_for_abi(device.profile.abi)
    if (why := spec.refusal("tail", target)) is not None:
        raise NotSupported(why)
    return build.program_for(spec, target)


def prefill(device: Device, spec: specs.EngineSpec, cfg: gemma.GemmaConfig, w: dict, tokens, settings, mode: str,
            state: bool = True, bench: dict | None = None, count: bool = False,
            engine_program: Path | None = None) -> Response:
    """One request: `tokens` prefilled with the tail `mode`; settings: the native backend's TailSettings
    (chunk, cache dtype, group, sink, weights). A refusal raises NotSupported."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    # in a format the engine reads (a GGUF or a Hugging Face folder holds the model's window as the cfg says)
    model, fmt = GemmaModel(cfg, w, weights=settings.weights_dtype, group=settings.weights_group).file_for(spec)
    request = Request("tail", tokens, model, fmt, settings.weights_dtype,
                      model_config(cfg, settings.weights_dtype, settings.weights_group), 0, settings.chunk,
                      [tokens.size - 1], mode,
                      {"dtype": settings.cache_dtype, "window": cfg.window, "sink": settings.sink,
                       "group": settings.cache_group},
                      state, settings.threads, bench, count and bench is not None)
    response = call(device, spec, request, Expect(cfg.vocab), engine_program or program(device, spec),
                    measured=bench is not None)
    if response.refused:
        raise NotSupported(f"engine {spec.name} refused: {response.reason}")
    return response


def native_state_bytes(cfg: gemma.GemmaConfig, run) -> bytes:
    """testbed-c's state.bin order from a backend=native tail run (testbed.backends.native.engine.TailRun):
    per layer k, v, (int8) k_scale, v_scale, positions; for the tests that show the two bit-equal."""
    out = b""
    for layer in run.prefill.caches.layers:
        rows = layer.rows
        parts = [rows.k, rows.v] + ([rows.k_scale, rows.v_scale] if rows.dtype == "int8" else []) + [rows.positions]
        out += b"".join(np.ascontiguousarray(p).tobytes() for p in parts)
    return out
