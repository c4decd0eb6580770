"""Oracles for the padded prefill tail (seed 003).

Byte-identical cache: over a grid of (prefix rows, real rows, pads, window, sink, storage dtype), a
cache given a padded append plus rollback, and one given the exact append, must both equal, byte for
byte (data, scales, positions, length, and the empty slots), the layout the cache contract defines
for the chronological row list: built here directly from that list, not by the cache code under test.

First token: for a prompt, the padded-tail prefill and the scalar-tail prefill (the kill switch set)
must give the same first token; each mode must be deterministic run to run; the telemetry must add
up, with the expected tail derived from the chunk size the telemetry reports, which must be the
configured one, and the padding decision must be the design's rule recomputed here from the
configured threshold, the tail length and the caches' layout (padding_expected), never read from the
engine's policy; and the states that are exact in both modes (every cache's positions, conv states)
must be identical. How many generated tokens agree is reported beside the verdict, not judged: chunk
and step graphs round differently, so a near-tie may flip a later token. Where asked (naive_atol), both
modes' logits are also judged against the model written out in float64 (refimpl.naive_gemma), which
shares no code with refimpl.gemma: padded and scalar tails would agree on a bug of the model itself.

Byte-identical cache of an engine run (check_engine_rollback): a whole prefill whose tail was padded
and rolled back, against the same prefill whose padded call appended only its real rows, every cache
byte of every layer, and the positions those the cache contract gives (engine_grid: prompt lengths
that meet the windows empty, unevicted, evicted by the pads only, and full).

Cache encoding (check_cache_encoding): the byte-identical oracle compares the engine with itself, so
an encoder that writes wrong bytes the same way twice (a scale in the next group's slot, read back
from there) passes it. So an engine's float16 or int8 cache is also judged against refimpl's encoding
(refimpl.sliding_cache.encode_rows: float16 rounding, int8 groups of `group`, one float32 scale each,
in refimpl's layout) of the rows it encoded: the first layer's K and V do not depend on any cache, so
the same prompt run with a float32 cache gives exactly the rows the encoder was given there, and the
stored bytes must equal refimpl's encoding of them, every byte.
"""

from __future__ import annotations

import copy
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import numpy as np

from refimpl import naive_gemma, sliding_cache as sc, tail_prefill as tp
from testbed.oracles.numerical import Verdict, check_bitexact, digest

# --- byte-identical cache grid -----------------------------------------------------------------------

KV_HEADS, HEAD_DIM, GROUP = 2, 8, 4  # small rows: the grid is about slot bookkeeping, not arithmetic


@dataclass(frozen=True)
class GridCase:
    prefix: int
    real: int
    pads: int
    window: int
    sink: int
    dtype: str

    @property
    def covers(self) -> str:
        """Which situation the case exercises."""
        if self.prefix == 0:
            return "empty cache"
        if self.prefix + self.real > self.window:
            return "overshoot"
        if self.prefix + self.real + self.pads > self.window:
            return "eviction by pads only"
        return "no eviction"

    @property
    def name(self) -> str:
        return (f"prefix={self.prefix},real={self.real},pads={self.pads},window={self.window},"
                f"sink={self.sink},dtype={self.dtype}")


def grid(windows=(16, 24), sinks=(0, 3), dtypes=sc.STORAGE_DTYPES) -> list[GridCase]:
    """For each window, sink and dtype: an empty cache, no eviction, eviction caused only by the pads,
    a full cache overshooting, the exact append itself evicting, no real row at all (the engine rolls
    the last real token back too), and the largest padded append the tail capacity allows."""
    cases = []
    for window in windows:
        for sink in sinks:
            tail = window - sink
            shapes = [
                (0, 3, tail - 3),                 # empty cache
                (2, 3, window - 5 - 1),           # no eviction (one slot spare)
                (window - 4, 3, tail - 3),        # pads alone cause the eviction
                (window + 5, 3, tail - 3),        # already full: every append evicts
                (window - 1, 4, tail - 4),        # the exact append evicts too
                (window + 2, 0, tail),            # no real row kept from the chunk
                (2 * window + 1, tail - 1, 1),    # largest real part, one pad
            ]
            for dtype in dtypes:
                cases += [GridCase(p, r, max(pd, 0), window, sink, dtype) for p, r, pd in shapes]
    return cases


def _rows(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    k = rng.standard_normal((KV_HEADS, n, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((KV_HEADS, n, HEAD_DIM)).astype(np.float32)
    return k, v


def expected_layout(case: GridCase, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
    """The cache contract applied to the chronological rows: at most `window` kept, the first `sink`
    rows forever and the newest window - sink, oldest first, then empty slots (zero, position -1)."""
    n = positions.size
    kept = np.arange(n) if n <= case.window else np.r_[0:case.sink, n - (case.window - case.sink):n]
    rows = sc.encode_rows(case.dtype, GROUP, k[:, kept], v[:, kept], positions[kept])
    out = {}
    for name, a in rows.arrays().items():
        axis = 0 if name == "positions" else 1
        width = [(0, 0)] * a.ndim
        width[axis] = (0, case.window - kept.size)
        out[name] = np.pad(a, width, constant_values=sc.EMPTY if name == "positions" else 0)
    out["length"] = np.array([kept.size], np.int64)
    return out


def check_padded_rollback(case: GridCase, ops: sc.CacheOps = sc.CacheOps(), seed: int = 0) -> Verdict:
    """Padded append + rollback == exact append == the contract's layout, every byte."""
    rng = np.random.default_rng([seed, case.prefix, case.real, case.pads, case.window, case.sink,
                                 sc.STORAGE_DTYPES.index(case.dtype)])
    cache = sc.sliding_cache(KV_HEADS, HEAD_DIM, case.window, case.sink, case.dtype, GROUP)
    k, v = _rows(rng, case.prefix + case.real)
    positions = np.arange(case.prefix + case.real, dtype=np.int64)
    piece = max(1, (case.window - case.sink) // 2)  # the prefix arrives in several appends
    for start in range(0, case.prefix, piece):
        stop = min(start + piece, case.prefix)
        ops.append(cache, k[:, start:stop], v[:, start:stop], positions[start:stop])
    real = slice(case.prefix, case.prefix + case.real)

    exact = copy.deepcopy(cache)
    ops.append(exact, k[:, real], v[:, real], positions[real])
    padded = copy.deepcopy(cache)
    pad_k, pad_v = _rows(rng, case.pads)  # whatever a pad row computes: it must not survive
    try:
        snap = ops.snapshot(padded, case.real, case.pads)
        ops.append(padded, np.concatenate([k[:, real], pad_k], axis=1), np.concatenate([v[:, real], pad_v], axis=1),
                   np.r_[positions[real], np.full(case.pads, sc.EMPTY)])
        ops.rollback(padded, snap)
    except (ValueError, IndexError) as e:
        return Verdict("cache_bytes", False, None, {"covers": case.covers},
                       f"padded append + rollback raised {type(e).__name__}: {e}")

    expected = expected_layout(case, k, v, positions)
    got_exact, got_padded = check_bitexact(expected, sc.cache_bytes(exact)), check_bitexact(expected, sc.cache_bytes(padded))
    problems = [f"{label}: {v.detail}" for label, v in (("exact append", got_exact), ("padded+rollback", got_padded))
                if not v.passed]
    metrics = {"covers": case.covers, "sha256": digest(*sc.cache_bytes(padded).values()),
               "sha256_expected": digest(*expected.values()), "differing_exact": -got_exact.margin,
               "differing_padded": -got_padded.margin}
    return Verdict("cache_bytes", not problems, got_exact.margin + got_padded.margin, metrics, "; ".join(problems))


# --- first token, determinism, telemetry, exact state ------------------------------------------------


@contextmanager
def kill_switch(on: bool):
    """TESTBED_DISABLE_PREFILL_TAIL_PAD=1 while inside (or unset), restored afterwards."""
    before = os.environ.get(tp.KILL_SWITCH)
    if on:
        os.environ[tp.KILL_SWITCH] = "1"
    else:
        os.environ.pop(tp.KILL_SWITCH, None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(tp.KILL_SWITCH, None)
        else:
            os.environ[tp.KILL_SWITCH] = before


@dataclass
class Engine:
    """What the first-token oracle drives: weights and config, the chunk graph, the policy, how
    caches are made, the attention the graphs use."""

    w: dict
    cfg: object
    graph: tp.ChunkGraph
    policy: tp.TailPolicy
    make_caches: Callable[[], tp.ModelCaches]
    attention: Callable = tp.batched_attention
    ops: sc.CacheOps = sc.CacheOps()

    def prefill(self, tokens) -> tp.Prefill:
        return tp.prefill(self.w, self.cfg, tokens, self.graph, self.make_caches(), self.policy, self.attention,
                          self.ops)

    def generate(self, state: tp.Prefill, steps: int) -> list[int]:
        return tp.generate(self.w, self.cfg, state, steps, self.attention, self.ops)


def greedy_continuation(engine: Engine, tokens, steps: int) -> tuple[list[int], np.ndarray]:
    """The reference's continuation of a prompt: its prefill, then `steps` step-graph calls, each fed the
    previous call's argmax. (The tokens fed, their logits [steps, vocab] at positions n .. n + steps - 1.)"""
    state = engine.prefill(tokens)
    logits, position, fed, rows = state.logits, state.position, [], []
    for _ in range(steps):
        fed.append(int(np.argmax(logits)))
        logits = tp.run_rows(engine.w, engine.cfg, state.caches, [fed[-1]], 1, position, engine.attention, engine.ops)
        rows.append(np.asarray(logits))
        position += 1
    return fed, np.stack(rows)


def logit_margin(logits: np.ndarray) -> float:
    """Top-1 minus top-2 logit: how far the argmax is from flipping."""
    top = np.sort(np.asarray(logits, np.float64))[-2:]
    return float(top[1] - top[0])


def _exact_state(p: tp.Prefill) -> dict[str, np.ndarray]:
    """What must not differ at all between the modes: each cache's positions and length, each conv
    state (fed exact embedding rows)."""
    out = {}
    for i, c in enumerate(p.caches.layers):
        out[f"layer{i}.positions"] = c.rows.positions[:c.length].copy()
    for i, s in enumerate(p.caches.states):
        out[f"state{i}.ring"] = s.ring.copy()
    return out


def padding_expected(tail: int, chunk: int, threshold: int, caches: tp.ModelCaches) -> bool:
    """The design's padding rule (seed 003), written out here rather than asked of the engine's policy:
    a tail runs padded iff it is longer than the threshold, a sliding cache exists, every sliding
    window exceeds chunk + sink (the padded chunk fits the tail capacity) and no conv or recurrent state
    is present. The kill switch is the caller's to apply."""
    sliding = [c for c in caches.layers if c.kind == "sliding"]
    fits = bool(sliding) and all(c.window > chunk + c.sink for c in sliding)
    return tail > threshold and fits and not caches.states


def _telemetry_problems(t: tp.Telemetry, configured_chunk: int, padded_allowed: bool,
                        decision: tuple[int, bool] | None = None) -> list[str]:
    """What is wrong with one prefill's telemetry. decision: (threshold, padding expected) where the
    kill switch is off, so the mode the engine chose is judged against the rule."""
    problems = []
    if decision is not None:
        threshold, expected = decision
        tail = t.prompt_tokens % configured_chunk
        want = "none" if tail == 0 else "padded" if expected else "scalar"
        if t.tail_mode != want:
            problems.append(f"a tail of {tail} ran {t.tail_mode} ({t.reason}); the rule (pad tails > threshold "
                            f"{threshold} where the caches allow it) says {want}")
    if t.chunk_size != configured_chunk:
        problems.append(f"chunk graph has {t.chunk_size} rows, configured chunk is {configured_chunk}")
    tail = t.prompt_tokens % t.chunk_size  # from the chunk size the telemetry reports
    if t.chunk_tokens != t.prompt_tokens - tail:
        problems.append(f"chunk_tokens {t.chunk_tokens} != {t.prompt_tokens - tail}")
    if t.tail_mode == "padded":
        if not padded_allowed:
            problems.append(f"padded with the kill switch set ({t.reason})")
        if (t.tail_chunk_tokens, t.padding_tokens, t.scalar_tail_tokens) != (tail - 1, t.chunk_size - tail, 1):
            problems.append(f"padded tail of {tail}: tail_chunk/padding/scalar = {t.tail_chunk_tokens}/"
                            f"{t.padding_tokens}/{t.scalar_tail_tokens}, expected {tail - 1}/{t.chunk_size - tail}/1")
    elif (t.tail_chunk_tokens, t.padding_tokens, t.scalar_tail_tokens) != (0, 0, tail):
        problems.append(f"scalar tail of {tail}: tail_chunk/padding/scalar = {t.tail_chunk_tokens}/"
                        f"{t.padding_tokens}/{t.scalar_tail_tokens}, expected 0/0/{tail}")
    return problems


def check_first_token(engine: Engine, tokens, configured_chunk: int, threshold: int, generate_steps: int = 8,
                      naive_atol: float | None = None) -> list[Verdict]:
    """Four verdicts for one prompt: first_token, determinism, telemetry, exact_state; a fifth, naive,
    where naive_atol is given (the float64 model costs seconds per prompt at the experiment's shape).
    threshold: the configured padding threshold the decision is judged by."""
    runs = {}
    for mode, off in (("padded", False), ("scalar", True)):
        with kill_switch(off):
            runs[mode] = [engine.prefill(tokens) for _ in range(2)]
    padded, scalar = runs["padded"][0], runs["scalar"][0]
    # Read before generating, which grows the caches.
    exact_state = {m: _exact_state(r[0]) for m, r in runs.items()}
    cache_digests = {m: [digest(*(a for c in r.caches.layers + r.caches.states for a in sc.cache_bytes(c).values()))
                         for r in rs] for m, rs in runs.items()}
    k_diffs = [float(np.max(np.abs(sc.read(a)[0] - sc.read(b)[0]), initial=0.0))
               for a, b in zip(padded.caches.layers, scalar.caches.layers) if a.length == b.length]
    tel = {m: r[0].telemetry for m, r in runs.items()}
    info = {"prompt_tokens": len(tokens), "padded_mode": tel["padded"].tail_mode, "reason": tel["padded"].reason,
            **{f"{m}.{k}": v for m, t in tel.items() for k, v in vars(t).items() if k not in ("reason",)}}

    generated = {m: [engine.generate(r, generate_steps) for r in rs] for m, rs in runs.items()}
    agree = 0
    for a, b in zip(generated["padded"][0], generated["scalar"][0]):
        if a != b:
            break
        agree += 1
    diff = float(np.max(np.abs(padded.logits.astype(np.float64) - scalar.logits)))
    margins = min(logit_margin(padded.logits), logit_margin(scalar.logits))
    same = padded.first_token == scalar.first_token
    gap = float(scalar.logits[scalar.first_token] - scalar.logits[padded.first_token])
    first = Verdict("first_token", same, margins if same else -gap,
                    {**info, "padded_token": padded.first_token, "scalar_token": scalar.first_token,
                     "logit_margin": margins, "max_abs_logit_diff": diff,
                     "sequence_agree": agree, "sequence_len": generate_steps,
                     "padded_tokens": generated["padded"][0], "scalar_tokens": generated["scalar"][0]},
                    "" if same else f"first token padded {padded.first_token} != scalar {scalar.first_token}")

    problems = []
    for mode, (a, b) in runs.items():
        if digest(a.logits) != digest(b.logits):
            problems.append(f"{mode}: logits differ run to run")
        if cache_digests[mode][0] != cache_digests[mode][1]:
            problems.append(f"{mode}: cache bytes differ run to run")
        if generated[mode][0] != generated[mode][1]:
            problems.append(f"{mode}: generated tokens differ run to run")
    determinism = Verdict("determinism", not problems, float(-len(problems)),
                          {**info, "cache_sha256": cache_digests["padded"][0]}, "; ".join(problems))

    expected = padding_expected(len(tokens) % configured_chunk, configured_chunk, threshold, engine.make_caches())
    problems = _telemetry_problems(tel["padded"], configured_chunk, True, (threshold, expected)) + \
        _telemetry_problems(tel["scalar"], configured_chunk, False)
    telemetry = Verdict("telemetry", not problems, float(-len(problems)),
                        {**info, "threshold": threshold, "padding_expected": expected}, "; ".join(problems))

    state = check_bitexact(exact_state["scalar"], exact_state["padded"])
    exact = Verdict("exact_state", state.passed, state.margin,
                    {**info, "max_abs_k_diff": max(k_diffs) if k_diffs else None}, state.detail)
    verdicts = [first, determinism, telemetry, exact]
    if naive_atol is not None:
        verdicts.append(check_naive(engine, tokens, {"padded": padded.logits, "scalar": scalar.logits}, naive_atol, info))
    return verdicts


def check_naive(engine: Engine, tokens, logits: dict[str, np.ndarray], atol: float, info: dict) -> Verdict:
    """Each mode's logits after the prompt within atol of the float64 model written out independently
    (refimpl.naive_gemma), and its first token one the naive model accepts (its best, or one within
    atol of it). Margin: log10(atol / worst difference), null where a difference is not finite."""
    reference = naive_gemma.logits(engine.w, engine.cfg, tokens, len(tokens) - 1)
    accepted = np.flatnonzero(reference >= reference.max() - atol).tolist()
    diffs = {mode: float(np.max(np.abs(np.asarray(x, np.float64) - reference))) for mode, x in logits.items()}
    worst = max(diffs.values())
    problems = [f"{mode} first token {int(np.argmax(x))}, the naive float64 model {int(np.argmax(reference))}"
                for mode, x in logits.items() if int(np.argmax(x)) not in accepted]
    if not worst <= atol:  # NaN fails too
        problems.append(f"max |logit - naive float64 model| {worst:.3g} > {atol:g}")
    margin = None if not np.isfinite(worst) else 30.0 if worst == 0 else min(30.0, float(np.log10(atol / worst)))
    if problems and margin is not None:
        margin = min(margin, 0.0)  # a token outside the naive model's within tolerance: no headroom
    metrics = {**info, "token_naive": int(np.argmax(reference)), "naive_atol": atol,
               **{f"max_abs_{mode}_naive_diff": d for mode, d in diffs.items()},
               "naive_reference": "refimpl.naive_gemma, float64"}
    return Verdict("naive", not problems, margin, metrics, "; ".join(problems))


def prompt_lengths(chunk: int, around: list[tuple[int, int]]) -> list[int]:
    """Prompt lengths blocks * chunk + offset (e.g. (1, 2) -> C + 2, (8, -1) -> 8C - 1)."""
    return [b * chunk + o for b, o in around]


# --- byte-identical cache of a whole engine run --------------------------------------------------------


@dataclass(frozen=True)
class EngineGridCase:
    """A model prefill whose tail runs padded, on caches of `window` rows with `sink` sinks: what the
    sliding caches hold when the tail arrives decides which rows the pads evict."""

    prompt: int
    chunk: int
    window: int
    sink: int
    dtype: str

    @property
    def held(self) -> int:
        """Rows a sliding cache holds when the tail arrives (the full chunks, at most the window)."""
        return min(self.prompt // self.chunk * self.chunk, self.window)

    @property
    def covers(self) -> str:
        real, padded = self.prompt % self.chunk - 1, self.chunk  # the last real token is rolled back
        return GridCase(self.held, real, padded - real, self.window, self.sink, self.dtype).covers

    @property
    def name(self) -> str:
        return f"N={self.prompt},C={self.chunk},window={self.window},sink={self.sink},dtype={self.dtype}"


def engine_grid(chunk: int = 7, windows=(16, 24), sinks=(0, 3), dtypes=sc.STORAGE_DTYPES) -> list[EngineGridCase]:
    """Prompt lengths that put each window's caches in the situations of `grid` when the padded tail
    arrives: empty, no eviction, eviction by the pads only, already full (overshoot); a window that
    is not a multiple of the chunk (chunk 7 for windows 16 and 24) reaches all of them."""
    cases = []
    for window in windows:
        for sink in sinks:
            if window <= chunk + sink:
                raise ValueError(f"window {window} <= chunk {chunk} + sink {sink}: the tail would not be padded")
            # window + 1: the pads alone evict when window % chunk < chunk - 1; window + 3: the real
            # rows evict too; 3 * window + ...: the cache is full long before the tail
            lengths = [chunk - 1, chunk + 3, window + 1, window + 3, 3 * window + chunk // 2 + 1]
            for dtype in dtypes:
                cases += [EngineGridCase(n, chunk, window, sink, dtype) for n in dict.fromkeys(lengths)
                          if n % chunk >= 2]
    return cases


def contract_positions(case: EngineGridCase, layer_type: str) -> np.ndarray:
    """The positions a cache must hold after prefilling case.prompt tokens, from the cache contract
    alone: a full cache every position; a sliding one the first `sink` and the newest window - sink,
    then empty slots (-1)."""
    positions = np.arange(case.prompt, dtype=np.int64)
    if layer_type != "local":
        return positions
    if case.prompt > case.window:
        positions = np.r_[positions[:case.sink], positions[case.prompt - (case.window - case.sink):]]
    return np.r_[positions, np.full(case.window - positions.size, sc.EMPTY, np.int64)]


def check_engine_rollback(case: EngineGridCase, layer_types, padded: tp.Prefill, exact: tp.Prefill) -> Verdict:
    """An engine's prefill with its tail padded then rolled back, against the same prefill whose
    padded call appended only its real rows: every cache byte equal (data, scales, positions, length,
    empty slots), and the positions those of the cache contract. The padded run must have padded."""
    problems = []
    if padded.telemetry.tail_mode != "padded":
        problems.append(f"the tail was not padded ({padded.telemetry.reason}): nothing was rolled back")
    want, got = {}, {}
    for i, (t, a, b) in enumerate(zip(layer_types, exact.caches.layers, padded.caches.layers)):
        want.update({f"layer{i}.{k}": x for k, x in sc.cache_bytes(a).items()})
        got.update({f"layer{i}.{k}": x for k, x in sc.cache_bytes(b).items()})
        if not np.array_equal(b.rows.positions, contract_positions(case, t)):
            problems.append(f"layer {i} holds positions {b.rows.positions.tolist()}, the contract "
                            f"{contract_positions(case, t).tolist()}")
    same = check_bitexact(want, got)
    if not same.passed:
        problems.append(f"padded+rollback != exact append: {same.detail}")
    metrics = {"covers": case.covers, "sha256": digest(*got.values()), "sha256_expected": digest(*want.values()),
               "differing": -same.margin}
    return Verdict("cache_bytes", not problems, same.margin - (len(problems) - (not same.passed)), metrics,
                   "; ".join(problems))


def check_cache_encoding(float_run: tp.Prefill, got: tp.Prefill) -> Verdict:
    """An engine's float16 / int8 cache against refimpl's encoding (see the module's docstring):
    `float_run` is the same engine's prefill of the same prompt with a float32 cache, `got` the run
    judged. Its first layer's stored rows (data and scales) must be refimpl's encoding of the float32
    run's first-layer rows, byte for byte, at the same positions."""
    want_rows, rows = float_run.caches.layers[0].rows, got.caches.layers[0].rows
    n = rows.length
    metrics = {"dtype": rows.dtype, "group": rows.group, "rows": n}
    if want_rows.dtype != "float32" or want_rows.length != n or \
            not np.array_equal(want_rows.positions[:n], rows.positions[:n]):
        return Verdict("cache_encoding", False, -1.0, metrics,
                       f"the float32 run is not the same prefill (dtype {want_rows.dtype}, rows {want_rows.length} "
                       f"at {want_rows.positions[:want_rows.length].tolist()}; judged: {n} at "
                       f"{rows.positions[:n].tolist()})")
    want = sc.encode_rows(rows.dtype, rows.group, want_rows.k[:, :n], want_rows.v[:, :n], rows.positions[:n])
    same = check_bitexact({name: a[:n] if name == "positions" else a[:, :n] for name, a in want.arrays().items()},
                          {name: a[:n] if name == "positions" else a[:, :n] for name, a in rows.arrays().items()})
    return Verdict("cache_encoding", same.passed, same.margin, metrics | {"differing": -same.margin},
                   "" if same.passed else f"layer 0's {rows.dtype} rows are not refimpl's encoding of them: {same.detail}")
