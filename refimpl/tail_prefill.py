"""Chunked prefill with a padded tail (seed 003) over the reference model, on real caches.

A prompt of N tokens runs as N // C full chunks through the chunk graph (C rows, 128 by default),
then the tail of N mod C tokens either

  scalar  one step-graph call per token, or
  padded  one chunk-graph call with the tail padded to C rows. The pads evict real rows of the
          sliding caches, so every KV cache is snapshotted before the call and rolled back after it
          (refimpl.sliding_cache). The chunk graph only emits its last row's logits, a pad's, so the
          last real token is rolled back as well and re-run through the step graph for the logits
          of the first generated token.

The policy (TailPolicy) pads only when it is safe and pays: there is a sliding cache, no conv or
recurrent state (its rows cannot be restored), every window > chunk + sink (the padded chunk fits
the tail capacity), the tail exceeds the threshold (8 by default: a padded chunk costs more than a
few steps; or derived from a measured breakeven), and the kill switch
TESTBED_DISABLE_PREFILL_TAIL_PAD=1 is not set. Every prefill reports its telemetry.

The step graph is the chunk graph's computation with one row, so both go through
`gemma.prefill_with_past`; they are numerically distinct (a 1-row and a C-row matrix product round
differently), which is why padded and scalar tails agree on the first token but not necessarily on
every later one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from refimpl import gemma
from refimpl import sliding_cache as sc

KILL_SWITCH = "TESTBED_DISABLE_PREFILL_TAIL_PAD"
DEFAULT_THRESHOLD = 8  # tails of up to 8 tokens stay scalar: the seed's measured breakeven is 9-10
DEFAULT_CHUNK = 128


def batched_attention(q, k, v, mask, scale):
    """gemma.attention's formula (grouped KV heads, additive mask, max-subtracted softmax) with
    batched matrix products instead of einsum, which numpy runs as plain loops: ~20x faster at
    C = 128, so the chunk graph's cost is its arithmetic, not the interpreter's."""
    heads, c, d = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    scores = (q.reshape(kv_heads, group * c, d) @ k.transpose(0, 2, 1)).reshape(heads, c, -1)
    scores = scores * np.float32(scale) + mask[0]
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    return (probs.reshape(kv_heads, group * c, -1) @ v).reshape(heads, c, d).astype(np.float32)


# --- caches -----------------------------------------------------------------------------------------


@dataclass
class ModelCaches:
    """Per layer its KV cache (sliding for local layers, full for global ones), and any conv or
    recurrent states, which are fed the embedded input rows (what a short-conv layer reads)."""

    layers: list
    states: list = field(default_factory=list)

    def positions(self, layer_types: tuple[str, ...]) -> dict[str, np.ndarray]:
        """The positions held by each layer type's caches (all layers of a type share one layout)."""
        first_layer = {t: layer_types.index(t) for t in dict.fromkeys(layer_types)}
        return {t: self.layers[i].rows.positions[:self.layers[i].length].copy() for t, i in first_layer.items()}


def model_caches(cfg: gemma.GemmaConfig, dtype: str = "float32", sink: int = 0, group: int = 16,
                 conv_kernel: int = 0) -> ModelCaches:
    """Empty caches for the model: sliding (window cfg.window, `sink` sinks) for local layers, full
    for global ones; with conv_kernel > 0 also one conv state (a hybrid model's conv layer)."""
    layers = [sc.sliding_cache(cfg.kv_heads, cfg.head_dim, cfg.window, sink, dtype, group) if t == "local"
              else sc.full_cache(cfg.kv_heads, cfg.head_dim, dtype, group) for t in cfg.layer_types]
    states = [sc.conv_state(conv_kernel, cfg.hidden)] if conv_kernel else []
    return ModelCaches(layers, states)


# --- the chunk graph --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkGraph:
    """A built chunk graph: it takes exactly `rows` tokens and emits the logits of its last row."""

    rows: int


def trace_chunk_graph(chunk: int, calibration_prompt) -> ChunkGraph:
    """Build the chunk graph from a trace input. A graph's row count is its trace input's length, so
    the calibration prompt is tiled up to the configured chunk size: a short calibration prompt (46
    tokens by default in the seed's converter) must not yield a 46-row graph."""
    prompt = np.asarray(calibration_prompt).reshape(-1)
    if chunk < 1 or prompt.size == 0:
        raise ValueError(f"chunk={chunk} must be >= 1 and the calibration prompt non-empty")
    return ChunkGraph(rows=np.resize(prompt, chunk).size)


# --- policy and telemetry ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TailPolicy:
    """Whether a tail runs padded. `threshold`: pad only tails longer than this."""

    threshold: int = DEFAULT_THRESHOLD

    def state_guard(self, caches: ModelCaches) -> str | None:
        """Why the caches' state forbids padding, or None."""
        if caches.states:
            return "conv/recurrent state cannot be rolled back"
        return None

    def window_guard(self, caches: ModelCaches, chunk: int) -> str | None:
        sliding = [c for c in caches.layers if c.kind == "sliding"]
        if not sliding:
            return "no sliding cache"
        for c in sliding:
            if c.window <= chunk + c.sink:
                return f"window {c.window} <= chunk {chunk} + sink {c.sink}"
        return None

    def decide(self, tail: int, chunk: int, caches: ModelCaches) -> tuple[bool, str]:
        """(pad?, why): the first reason not to pad, or 'padded'."""
        if tail == 0:
            return False, "no tail"
        if os.environ.get(KILL_SWITCH) == "1":
            return False, f"kill switch {KILL_SWITCH}=1"
        if tail <= self.threshold:
            return False, f"tail {tail} <= threshold {self.threshold}"
        reason = self.state_guard(caches) or self.window_guard(caches, chunk)
        return (False, reason) if reason else (True, "padded")


@dataclass
class Telemetry:
    """What one prefill did. chunk_tokens + tail_chunk_tokens + scalar_tail_tokens = prompt_tokens."""

    prompt_tokens: int
    chunk_size: int          # rows of the chunk graph used
    chunk_tokens: int        # tokens run in full chunks
    tail_chunk_tokens: int   # real tokens kept from the padded tail chunk
    padding_tokens: int      # pad rows in the padded tail chunk
    scalar_tail_tokens: int  # tokens run through the step graph
    tail_mode: str           # none | scalar | padded
    reason: str              # the policy's reason

    @property
    def tail(self) -> int:
        return self.prompt_tokens - self.chunk_tokens


@dataclass
class Prefill:
    """A finished prefill: logits of the last prompt token, its telemetry, the caches it filled."""

    logits: np.ndarray
    telemetry: Telemetry
    caches: ModelCaches
    position: int  # the next token's position

    @property
    def first_token(self) -> int:
        return int(np.argmax(self.logits))


# --- the engine ------------------------------------------------------------------------------------


def run_rows(w: dict, cfg: gemma.GemmaConfig, caches: ModelCaches, tokens, rows: int, position: int,
             attention=batched_attention, ops: sc.CacheOps = sc.CacheOps()) -> np.ndarray:
    """One graph call: `tokens` (<= rows) at positions from `position`, zero-padded to `rows`, against
    the caches; every row (pads at position -1) is appended to every cache and state. Returns the
    logits of the last row, as the graphs do."""
    tokens = np.asarray(tokens).reshape(-1)
    past = caches.positions(cfg.layer_types)
    inp = gemma.chunk_inputs(cfg, tokens, 0, rows, select_row=rows - 1, start=position)
    masks = {t: gemma.attention_mask(inp.positions, np.concatenate([past[t], inp.positions]), cfg.window,
                                     cfg.heads, t) for t in cfg.types_in_use}
    held = [sc.read(c) for c in caches.layers]
    logits, ks, vs = gemma.prefill_with_past(w, cfg, inp.tokens, inp.tables, [h[0] for h in held],
                                             [h[1] for h in held], masks, inp.select, attention)
    for cache, k, v in zip(caches.layers, ks, vs):
        ops.append(cache, k[:, -rows:], v[:, -rows:], inp.positions)
    for state in caches.states:
        sc.push_conv(state, gemma.embed(w, cfg, inp.tokens))
    return logits


def prefill(w: dict, cfg: gemma.GemmaConfig, tokens, graph: ChunkGraph, caches: ModelCaches,
            policy: TailPolicy = TailPolicy(), attention=batched_attention, ops: sc.CacheOps = sc.CacheOps()) -> Prefill:
    """Prefill `tokens` from position 0 into empty `caches` (filled in place)."""
    tokens = np.asarray(tokens).reshape(-1)
    n, c = tokens.size, graph.rows
    if n == 0:
        raise ValueError("cannot prefill an empty prompt")
    full = n // c
    tail = n - full * c
    logits = None
    for b in range(full):
        logits = run_rows(w, cfg, caches, tokens[b * c:(b + 1) * c], c, b * c, attention, ops)
    pad, reason = policy.decide(tail, c, caches)
    start = full * c
    if pad:
        # The last real token is rolled back with the pads: its row in the chunk yields no logits.
        real, pads = tail - 1, c - (tail - 1)
        snapshots = [ops.snapshot(cache, real, pads) for cache in caches.layers]
        run_rows(w, cfg, caches, tokens[start:], c, start, attention, ops)  # logits of a pad row: unused
        for cache, snap in zip(caches.layers, snapshots):
            ops.rollback(cache, snap)
        logits = run_rows(w, cfg, caches, tokens[n - 1:], 1, n - 1, attention, ops)
        telemetry = Telemetry(n, c, start, real, c - tail, 1, "padded", reason)
    else:
        for p in range(start, n):
            logits = run_rows(w, cfg, caches, tokens[p:p + 1], 1, p, attention, ops)
        telemetry = Telemetry(n, c, start, 0, 0, tail, "scalar" if tail else "none", reason)
    return Prefill(logits, telemetry, caches, n)


def generate(w: dict, cfg: gemma.GemmaConfig, state: Prefill, steps: int,
             attention=batched_attention, ops: sc.CacheOps = sc.CacheOps()) -> list[int]:
    """Greedy continuation: the first token from the prefill's logits, then `steps - 1` step-graph
    calls (the caches grow)."""
    out = [state.first_token]
    position = state.position
    for _ in range(steps - 1):
        logits = run_rows(w, cfg, state.caches, [out[-1]], 1, position, attention, ops)
        out.append(int(np.argmax(logits)))
        position += 1
    return out
