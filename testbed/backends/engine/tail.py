"""backend=engine for experiment tail: a prompt prefilled by the engine under test with its last partial
chunk padded (tail.mode padded: padded to C rows, the pad rows then removed) or run scalar (tail.mode
scalar), on sliding-window caches. What the oracles compare is what the contract returns: the first
token's logits and the sequence's state bytes (state.bin: compared between runs byte for byte, or as the
float layout the engine's yaml declares, never interpreted beyond that); for an engine that restores a
state (supports.state_in), the tokens it decodes after restoring one in a fresh process; the bench times
the prefill by the engine's own clock.

What the model's caches hold bounds what a state.bin may be (CacheBytes): at least the K/V rows a cache
must keep to decode the next token (every row in a global layer, the last window - 1 in a local one), at
most every layer holding every row of the request (a local one its whole window, if more) in float32 (or
the cache dtype's own rows, when wider) with ROW_OVERHEAD bytes of bookkeeping per row and layer and
HEADER_OVERHEAD bytes of headers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refimpl import gemma
from testbed.backends import NotSupported
from testbed.backends.engine import build, spec as specs
from testbed.backends.engine.gemma import model_config
from testbed.backends.engine.models import GemmaModel
from testbed.backends.engine.runner import Expect, Request, Response, call
from testbed.backends.engine.state import StateFile
from testbed.backends.native import build as kernel_build
from testbed.devices import Device

MODES = ("padded", "scalar")

# what an engine may spend besides K/V rows in its state: positions, sequence ids and cell flags per row
# and layer (testbed-c: 8, llama.cpp: 12 per cell), and headers (llama.cpp: a few per layer)
ROW_OVERHEAD = 64
HEADER_OVERHEAD = 1 << 20
ELEMENT_BYTES = {"float32": 4, "float16": 2, "int8": 1}


@dataclass(frozen=True)
class CacheBytes:
    """The bytes the model's K/V caches hold, from the model's shape and the cache dtype alone."""

    cfg: gemma.GemmaConfig
    dtype: str = "float32"
    group: int = 16

    @property
    def row(self) -> int:
        """One row of one layer's cache: K and V over the KV heads, in the cache dtype (int8: with its
        float32 scale per `group` elements)."""
        c = self.cfg
        per_head = c.head_dim * ELEMENT_BYTES[self.dtype] + (4 * (c.head_dim // self.group) if self.dtype == "int8" else 0)
        return 2 * c.kv_heads * per_head

    def held(self, positions: int) -> dict[str, int]:
        """Rows each layer type's cache must hold after `positions` positions to decode the next one: a global
        layer every one, a local layer the last window - 1 (the next token's window holds itself too)."""
        return {"global": positions, "local": min(positions, self.cfg.window - 1)}

    def floor(self, positions: int) -> int:
        """The fewest bytes a state holding the caches after `positions` positions can have."""
        held = self.held(positions)
        return sum(held[t] * self.row for t in self.cfg.layer_types)

    def growth(self, shorter: int, longer: int) -> tuple[int, int]:
        """(least, most) bytes a state may grow by from `shorter` to `longer` positions: at least every global
        layer's new rows (a local layer's cache may be kept at its window's size from the start); at most
        every layer adding every row, in float32 or the cache dtype's own rows if wider, with its bookkeeping."""
        rows = longer - shorter
        return rows * self.row * self.cfg.layer_types.count("global"), rows * self.cfg.layers * (self.widest + ROW_OVERHEAD)

    @property
    def widest(self) -> int:
        """A row as the widest an engine may store it: float32, or the cache dtype's own rows if wider (int8
        with small scale groups)."""
        return max(self.row, CacheBytes(self.cfg, "float32").row)

    def ceiling(self, rows: int) -> int:
        """The most a state.bin may hold for a request of `rows` rows (pads included): every global layer
        holding every row, every local one its whole window if that is more (a sliding cache may be kept
        at its window's size), in float32 or the cache dtype's own rows if wider, with bookkeeping and headers."""
        slots = sum(rows if t == "global" else max(rows, self.cfg.window) for t in self.cfg.layer_types)
        return slots * (self.widest + ROW_OVERHEAD) + HEADER_OVERHEAD


def program(device: Device, spec: specs.EngineSpec) -> Path:
    target = kernel_build.target_for_abi(device.profile.abi)
    if (why := spec.refusal("tail", target)) is not None:
        raise NotSupported(why)
    return build.program_for(spec, target)


def _request(spec: specs.EngineSpec, cfg: gemma.GemmaConfig, w: dict, tokens: np.ndarray, settings, chunk: int,
             logits_at: list[int], mode: str, state: bool, bench: dict | None = None, count: bool = False) -> Request:
    # in a format the engine reads (a GGUF or a Hugging Face folder holds the model's window as the cfg says)
    model, fmt = GemmaModel(cfg, w, weights=settings.weights_dtype, group=settings.weights_group).file_for(spec)
    return Request("tail", tokens, model, fmt, settings.weights_dtype,
                   model_config(cfg, settings.weights_dtype, settings.weights_group), 0, chunk, logits_at, mode,
                   {"dtype": settings.cache_dtype, "window": cfg.window, "sink": settings.sink,
                    "group": settings.cache_group},
                   state, settings.threads, bench, count and bench is not None)


def _expect(cfg: gemma.GemmaConfig, settings, rows: int) -> Expect:
    return Expect(cfg.vocab, state_max_bytes=CacheBytes(cfg, settings.cache_dtype, settings.cache_group).ceiling(rows))


def prefill(device: Device, spec: specs.EngineSpec, cfg: gemma.GemmaConfig, w: dict, tokens, settings, mode: str,
            state: bool = True, bench: dict | None = None, count: bool = False,
            engine_program: Path | None = None, state_before_last: bool = False) -> Response:
    """One request: `tokens` prefilled with the tail `mode`; settings: the native backend's TailSettings
    (chunk, cache dtype, group, sink, weights). `state_before_last`: ask for the state after every call but
    the last too (an engine may leave it out). A refusal raises NotSupported."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    request = _request(spec, cfg, w, tokens, settings, settings.chunk, [tokens.size - 1], mode, state, bench, count)
    request.state_before_last = state and state_before_last
    response = call(device, spec, request, _expect(cfg, settings, tokens.size + settings.chunk),
                    engine_program or program(device, spec), measured=bench is not None)
    if response.refused:
        raise NotSupported(f"engine {spec.name} refused: {response.reason}")
    return response


def continue_from(device: Device, spec: specs.EngineSpec, cfg: gemma.GemmaConfig, w: dict, tokens, settings,
                  state: StateFile, positions: int, engine_program: Path | None = None,
                  state_out: bool = False) -> Response:
    """One request with state_in (an engine whose yaml says supports.state_in): a fresh engine process
    restores `state`, which holds tokens[0:positions], then decodes tokens[positions:] one token per call;
    the logits of every one of them. `state_out`: the state after them too. A refusal raises NotSupported."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if not 0 < positions < tokens.size:
        raise ValueError(f"a state of {positions} positions continued by {tokens.size - positions} tokens")
    request = _request(spec, cfg, w, tokens, settings, 1, list(range(positions, tokens.size)), "none", state_out)
    request.state_in, request.state_in_positions = state.path, positions
    response = call(device, spec, request, _expect(cfg, settings, tokens.size + settings.chunk),
                    engine_program or program(device, spec))
    if response.refused:
        raise NotSupported(f"engine {spec.name} refused to continue from its state: {response.reason}")
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
