"""Backends: one package per way of computing a technique, `testbed/backends/NAME/`.

  refimpl   the numpy references, on the host only (the ground truth the oracles use)
  native    kernels/ in C: benchmark-and-dump programs built for the device's ABI, pushed, run there
  iree      jax graphs compiled by IREE for the device's target, run there by iree-run-module
  llamacpp  llama.cpp's own tools (test-backend-ops, llama-bench) on the device

Each package holds everything it needs (building or compiling its artifacts, staging them on a device,
running them, parsing its tools' output) behind the same small interface, one entry point per
technique it implements, each given the run's config and the connected Device:

  gdn.runner(cfg, device, progress) -> GDNRunner                 experiment gdn
  gemma.backend(w, model, cfg, device, progress) -> GemmaRunner  experiment chunk_prefill

An experiment asks `backends.load(name)` for the entry point and never asks where it runs: a runner
computes ON the device it was given, and every result it returns carries `Evidence` of that (what ran,
its sha256, the command, the device's own time), which the records store. So adding a backend is one
new package and no experiment changes.

Masks, RoPE tables and the select vector are built on the host by refimpl.gemma.chunk_inputs and fed
to every backend as the same bytes (testbed.models.contract gives the flat argument order a compiled graph
takes): the graphs stay position-agnostic.
"""

from __future__ import annotations

import importlib
import math
import importlib.util
import pkgutil
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Protocol

import numpy as np

from refimpl import gemma
from refimpl.gemma import ChunkInputs
from testbed.config import PREFERENCE
from testbed.errors import UsageError

KV = list[np.ndarray]


# A chunk-prefill case, the shape every Gemma runner is asked to run and the token oracle judges:
# `tokens` new tokens after `past` cached positions, fed `chunk` rows per call.
@dataclass(frozen=True)
class TokenCase:
    past: int
    tokens: int
    chunk: int

    @property
    def position(self) -> int:
        return self.past + self.tokens - 1

    @property
    def calls(self) -> int:
        return math.ceil(self.tokens / self.chunk)

    @property
    def name(self) -> str:
        return f"P={self.past},n={self.tokens},C={self.chunk}"


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)


def implementing(technique: str) -> list[str]:
    """Backends with an entry point for `technique` (a module of that name in their package)."""
    return [n for n in names() if importlib.util.find_spec(f"{__name__}.{n}.{technique}") is not None]


def load(name: str, technique: str) -> ModuleType:
    accepted = implementing(technique)
    if name not in accepted:
        raise UsageError(f"backend={name!r} does not implement {technique}; accepted: {', '.join(accepted)}")
    return importlib.import_module(f"{__name__}.{name}.{technique}")


def refuse_mismatch(backend: str, device: str, capabilities) -> None:
    """Before anything runs: a backend the device cannot run is refused with one line, naming what the
    device can run instead. refimpl never runs anywhere but the host: a record under a device's name
    must have been computed there."""
    caps = list(capabilities or ())
    if backend in caps or (backend == "engine" and {"native", "llamacpp"} & set(caps)):
        return  # an engine under test is a program: it runs wherever native programs do
    others = [n for n in PREFERENCE if n in caps and n != "refimpl"]
    if backend == "refimpl":
        raise UsageError(f"backend=refimpl runs on the host; for device={device} use "
                         + (" or ".join(f"backend={n}" for n in others) or "a backend its profile lists"))
    raise UsageError(f"device={device} cannot run backend={backend} (its profile's capabilities: "
                     f"{', '.join(caps)}); accepted: {', '.join(others) or 'none'}")


# --- evidence --------------------------------------------------------------------------------------


@dataclass
class Evidence:
    """That a result was computed on a device: what ran there (program or module and its sha256), the
    command, and the seconds the device's own clock measured. Records carry a list of these."""

    device: str
    ran: str
    sha256: str
    command: str
    device_seconds: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"device": self.device, "ran": self.ran, "sha256": self.sha256, "command": self.command,
                "device_seconds": self.device_seconds, **({"detail": self.detail} if self.detail else {})}


class EvidenceLog:
    """What a runner ran since the experiment last asked: each record takes the evidence of the runs
    its figures or verdict came from."""

    def __init__(self):
        self._runs: list[Evidence] = []

    def add(self, evidence: Evidence) -> None:
        self._runs.append(evidence)

    def take(self) -> list[dict]:
        runs, self._runs = self._runs, []
        return [e.as_dict() for e in runs]


# --- GDN -------------------------------------------------------------------------------------------


class GDNRunner(Protocol):
    """The forms under test on one device. Each takes refimpl.gdn.GDNInputs and returns (out, final
    state) as float32 arrays; `bench` times the forms interleaved and returns {form: Figure (s)}."""

    artifacts: dict
    evidence: EvidenceLog

    def serial(self, x) -> tuple[np.ndarray, np.ndarray]: ...
    def chunkwise(self, x, chunk: int) -> tuple[np.ndarray, np.ndarray]: ...
    def serial_chunk_loop(self, x, chunk: int) -> tuple[np.ndarray, np.ndarray]: ...
    def bench(self, x, chunk: int, reps: int, warmup: int, between=None) -> dict: ...


# --- Gemma graphs (chunk prefill with past) --------------------------------------------------------


class NotSupported(Exception):
    """The implementation under test refused the request (an engine's status "refused", engine contract
    v1): the experiment records "not supported", never a pass."""


class ContractBroken(Exception):
    """A graph returned results of the wrong shape: the case fails without running further."""


@dataclass
class PaddedTail:
    """An engine under test's chunk path again with its last, partial call padded to C and the pad rows then
    dropped (engine contract v1's tail.mode=padded), or its refusal of it:

      logits         the selected row's logits [vocab]
      k, v           per layer, every row the engine's cache holds after it [kv_heads, rows, head_dim]: the
                     P + n real rows, no pad (None where the engine exposes no cache)
      refused        the engine's words where it does not serve tail.mode=padded ("": it did)
    """

    logits: np.ndarray | None = None
    k: KV = None
    v: KV = None
    refused: str = ""


@dataclass
class Utterance:
    """What a device returns for one chunk-prefill case (P cached positions, then n tokens in
    ceil(n/C) chunk calls), and what the token oracle compares on the host:

      chunk_logits   the selected row's logits of the last chunk call [vocab]
      decode_logits  the token-by-token path's last logits: n decode steps from the same cache
      k, v           per layer, the cache of real rows after the utterance [kv_heads, P + n, head_dim]
      pad_k, pad_v   per layer, the last call's pad rows [kv_heads, C - n_last, head_dim]
      last           the last call's inputs (built on the host), to rebuild what its pad rows must hold
      padded         an engine under test, a case whose last call is partial: the chunk path with that call
                     padded and its pads dropped (PaddedTail); None elsewhere
    """

    chunk_logits: np.ndarray
    decode_logits: np.ndarray
    k: KV
    v: KV
    pad_k: KV
    pad_v: KV
    last: ChunkInputs
    padded: PaddedTail | None = None


class GemmaRunner(Protocol):
    name: str
    evidence: EvidenceLog

    def utterance(self, prompt: np.ndarray, case, build: Callable = gemma.chunk_inputs) -> Utterance: ...
    def bench(self, prompt: np.ndarray, past: int, chunk: int, reps: int, warmup: int) -> dict: ...


@dataclass
class GemmaBackend:
    """The three graphs as host callables (refimpl, and IREE in this process): the utterance and the
    benchmark are driven call by call from here, with K/V handed back and forth as arrays."""

    name: str
    # tokens [N], selected row -> (logits [vocab], K list, V list) for positions 0..N-1
    prefill_at: Callable[[np.ndarray, int], tuple[np.ndarray, KV, KV]]
    # chunk inputs (C rows), past K, past V -> (logits of the selected row, K/V extended by C rows)
    prefill_with_past: Callable[[ChunkInputs, KV, KV], tuple[np.ndarray, KV, KV]]
    # one-row chunk inputs, past K, past V -> (logits, K/V extended by one row)
    decode_with_past: Callable[[ChunkInputs, KV, KV], tuple[np.ndarray, KV, KV]]
    cfg: gemma.GemmaConfig | None = None
    evidence: EvidenceLog = field(default_factory=EvidenceLog)

    def utterance(self, prompt, case, build: Callable = gemma.chunk_inputs) -> Utterance:
        from testbed.models.contract import prefill_with_past_contract

        cfg = self.cfg
        _, past_k, past_v = self.prefill_at(prompt[: case.past], case.past - 1)
        positions = np.arange(case.past, dtype=np.int64)
        ks, vs = past_k, past_v
        for start in range(case.past, case.past + case.tokens, case.chunk):
            part = prompt[start: min(start + case.chunk, case.past + case.tokens)]
            inp = build(cfg, part, positions.size, case.chunk, past_positions=positions)
            logits, raw_k, raw_v = self.prefill_with_past(inp, ks, vs)
            spec = prefill_with_past_contract(cfg, case.chunk, positions.size).results
            for i, (k, v) in enumerate(zip(raw_k, raw_v)):
                for a, s in ((k, spec[1 + 2 * i]), (v, spec[2 + 2 * i])):
                    if tuple(a.shape) != s.shape:
                        raise ContractBroken(f"{s.name} has shape {tuple(a.shape)}, the contract says {s.shape} "
                                             f"(K/V must be extended by the chunk's {case.chunk} rows)")
            keep = positions.size + inp.n
            ks, vs = [k[:, :keep] for k in raw_k], [v[:, :keep] for v in raw_v]
            positions = np.concatenate([positions, inp.positions[: inp.n]])
        pads = slice(keep, keep + case.chunk - inp.n)
        dk, dv = past_k, past_v
        for pos in range(case.past, case.past + case.tokens):
            step = build(cfg, prompt[pos: pos + 1], pos, 1, start=pos)
            decode_logits, dk, dv = self.decode_with_past(step, dk, dv)
        return Utterance(logits, decode_logits, ks, vs, [k[:, pads] for k in raw_k], [v[:, pads] for v in raw_v],
                         inp)

    def bench(self, prompt, past: int, chunk: int, reps: int, warmup: int) -> dict:
        """One chunk call of C rows and one decode step, both against `past` cached positions,
        interleaved; seconds per call measured here, around the call."""
        from testbed.measure.timing import time_alternating

        _, past_k, past_v = self.prefill_at(prompt[:past], past - 1)
        chunk_in = gemma.chunk_inputs(self.cfg, prompt[past:past + chunk], past, chunk)
        decode_in = gemma.chunk_inputs(self.cfg, prompt[past:past + 1], past, 1)
        return time_alternating({"chunk_call": lambda: self.prefill_with_past(chunk_in, past_k, past_v),
                                 "decode_step": lambda: self.decode_with_past(decode_in, past_k, past_v)},
                                reps=reps, warmup=warmup)
