"""Experiment `tail`: padded vs scalar prefill tail on sliding-window caches (seed 003).

bench    for each prompt length N (blocks * chunk + each tail of the list, or prompt_tokens): time to
         first token of the prefill with the tail padded (padding forced wherever the guards allow,
         threshold 0) and with the scalar tail (kill switch set). All (N, mode) are measured in one
         job, interleaved: each repetition runs every (N, mode) once, in an order shuffled per
         repetition (seeded by `seed`, recorded), so load drift falls on every point alike and the
         breakeven comes from one job. One record per (N, mode) with TTFT by wall and CPU clock,
         tokens/s (N / TTFT), GFLOP/s, the telemetry and where it ran in each repetition.
oracle   the byte-identical cache grid and the first-token suite (C+2, C+9, 2C-1, 8C-1 by default,
         and C + threshold, C + threshold + 1 for the padding decision); the shortest prompt's logits
         also against the float64 model written out independently (refimpl.naive_gemma, verdict
         naive, within oracle.naive_atol of the cache dtype). backend=engine: the grid's state.bin
         padded against unpadded, judged only beside what the state holds (the state restored and
         continued, or its properties: engine_state_records), and the suite's first token within the
         engine's declared tolerance (engine_atol).
fixture  the seed's measured sweep (M4 Pro, gemma-4-e2b-it) as records, so the same table shows it.

backend=refimpl runs the numpy model on the host; backend=native runs the model engine in C
(kernels/tb_model.h) on the device: every prefill, its cache bytes pulled for the host's oracles,
the grid as whole engine prefills (padded + rollback against the exact append), the bench timed
by the program's own clock; on a device that counts, each bench record also holds the prefill's
exact instructions (the program marks it; testbed.measure.counts).

`testbed run tail` measures the default list of tails in one job; `testbed sweep experiment=tail
tail=0,2,4,...` does too (a sweep over tails is one measurement: SWEEP_TOGETHER) and sweeps the other
keys as jobs (chunk=64,128: one interleaved tail sweep per chunk), one row per job with its
breakeven. `testbed table tail` prints the reviewer's table and breakeven of each source's latest run.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Iterator

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from refimpl import gemma, sliding_cache as sc, tail_prefill as tp
from testbed.config import Choice, Float, Int, IntList, as_list
from testbed.errors import UsageError
from testbed.measure import breakeven, emulation, seed as seeds
from testbed.measure.decisions import MIN_REPS as MIN_DECIDING_REPS
from testbed.measure.timing import host_clocks, time_interleaved
from testbed.results import Figure, Record
from testbed.oracles.numerical import Verdict
from testbed.oracles.tail import (Engine, check_cache_encoding, check_engine_rollback, check_first_token,
                                  check_padded_rollback, engine_grid, grid, kill_switch, prompt_lengths)
from testbed.verdicts import Tally

PARAMS = {
    "backend": Choice(("refimpl", "native", "engine")),
    "fused": Choice((False, True)),
    "mode": Choice(("bench", "oracle", "all", "fixture")),
    "chunk": Int(1, 4096),
    "calibration_tokens": Int(1, 1 << 16),
    "blocks": Int(0, 1 << 12),
    "tail": IntList(0, 4095),
    "threads": Int(1, 256),
    "counts": Choice((False, True)),
    "reps": Int(1, 1000),
    "warmup": Int(0, 100),
    "seed": Int(0),
    "cache.dtype": Choice(sc.STORAGE_DTYPES),
    "cache.sink": Int(0),
    "cache.group": Int(1),
    "cache.conv_kernel": Int(0, 64),
    "shape.vocab": Int(2),
    "shape.hidden": Int(1),
    "shape.layers": Int(1),
    "shape.heads": Int(1),
    "shape.kv_heads": Int(1),
    "shape.head_dim": Int(2),
    "shape.mlp": Int(1),
    "shape.window": Int(1),
    "oracle.generate": Int(1, 1000),
    "oracle.grid_windows": IntList(2, 4096),
    "oracle.grid_sinks": IntList(0, 4096),
    "oracle.grid_chunk": Int(2, 4096),
    "oracle.continuation": Int(1, 1000),
    "oracle.engine_tolerance": Choice((True, False)),
    **{f"oracle.naive_atol.{dtype}": Float(0.0) for dtype in sc.STORAGE_DTYPES},
}


# Keys a sweep measures in one job, interleaved, instead of one job per value (testbed.config.expand_sweep).
SWEEP_TOGETHER = ("tail",)


def _lengths(cfg: DictConfig) -> list[int]:
    explicit = list(cfg.prompt_tokens or [])
    return explicit or sorted({cfg.blocks * cfg.chunk + t for t in as_list(cfg.tail)})


def validate(cfg: DictConfig) -> None:
    if cfg.fused and cfg.backend != "native":
        raise UsageError(f"fused=true chooses the native programs' FMA build; backend={cfg.backend} has none; "
                         "accepted: fused=true with backend=native, or fused=false")
    for t in as_list(cfg.tail):
        if t >= cfg.chunk:
            raise UsageError(f"tail={t} is out of range; accepted: integers from 0 to chunk - 1 = {cfg.chunk - 1}")
    if cfg.prompt_tokens:
        IntList(1, 1 << 20).check("prompt_tokens", cfg.prompt_tokens)
    elif _lengths(cfg)[0] < 1:
        raise UsageError("blocks=0 tail=0 is an empty prompt; accepted: blocks * chunk + tail >= 1")
    if cfg.counts and cfg.backend != "native":
        raise UsageError(f"counts=true counts the native engine's instructions; backend={cfg.backend} runs no native "
                         "program (accepted: counts=true with backend=native)")
    if cfg.threshold != "measured":
        Int(0).check("threshold", cfg.threshold)
    try:
        model_config(cfg)
    except ValueError as e:
        raise UsageError(f"shape: {e}") from None
    if not cfg.cache.sink < cfg.shape.window:
        raise UsageError(f"cache.sink={cfg.cache.sink} is out of range; accepted: integers from 0 to "
                         f"shape.window - 1 = {cfg.shape.window - 1}")
    if cfg.cache.dtype == "int8" and cfg.shape.head_dim % cfg.cache.group:
        raise UsageError(f"cache.group={cfg.cache.group} does not divide shape.head_dim={cfg.shape.head_dim}; "
                         "accepted: a divisor of head_dim")
    for pair in cfg.oracle.around_chunk:
        if len(pair) != 2 or pair[0] * cfg.chunk + pair[1] < 1:
            raise UsageError(f"oracle.around_chunk entry {list(pair)} is not [blocks, offset] with "
                             "blocks * chunk + offset >= 1")
    if cfg.backend == "engine" and cfg.mode != "fixture":  # the engine's yaml (what it serves: engine_refusal)
        from testbed.backends.engine import spec as engine_spec

        engine_spec.load(cfg.get("engine"))
    if cfg.mode == "fixture":
        fixture_path(cfg)
    elif cfg.threshold == "measured":
        policy_threshold(cfg, cfg.device.name)  # a missing sweep is bad input: say so before running


def model_config(cfg: DictConfig) -> gemma.GemmaConfig:
    return gemma.GemmaConfig(**OmegaConf.to_container(cfg.shape, resolve=True))


def fixture_path(cfg: DictConfig):
    """The fixture from `fixtures_dir` (testbed.measure.seed.fixtures_dir)."""
    path = seeds.fixtures_dir(cfg.fixtures_dir) / cfg.fixture
    if not path.is_file():
        raise UsageError(f"fixture={cfg.fixture!r} not found in {path.parent} (config key fixtures_dir)")
    return path


def source_label(cfg: DictConfig, device: str) -> str:
    """Which measurements belong in one table: device, backend, model size, chunk, cache."""
    s = cfg.shape
    backend = f"engine:{cfg.engine}" if cfg.backend == "engine" else cfg.backend
    return (f"{device}/{backend} h{s.hidden}x{s.layers} w{s.window} C={cfg.chunk} "
            f"{cfg.cache.dtype} sink={cfg.cache.sink}")


def policy_threshold(cfg: DictConfig, device: str) -> int:
    """The configured threshold, or breakeven - 1 from this source's stored measurements, when that
    breakeven is decided: a threshold is never taken from an undecided breakeven's median (its interval
    spans other tails; the refusal says the interval and the repetitions that would decide it)."""
    if cfg.threshold != "measured":
        return int(cfg.threshold)
    from testbed.runner import results_store  # the store this run writes to; imported late (cycle)

    stored = decided_from(results_store(SimpleNamespace(cfg=cfg)).frame("tail"))
    label = source_label(cfg, device)
    found = None
    # by wall time; on a device whose times are never speed (emulated), by its exact instructions
    for clock in ("wall", "instructions"):
        sweep = sweep_frame(stored, clock)
        sweep = sweep[sweep["source"] == label] if len(sweep) else sweep
        if len(sweep):
            found = breakeven_of(label, sweep, clock)
            break
    if found is None or found["tail"] is None:
        raise UsageError(f"threshold=measured: no stored tail sweep of {label!r} where padding wins; "
                         "run `testbed sweep experiment=tail tail=...` first")
    if not found["decided"]:
        more = (f"about {found['more_reps']} more repetitions would decide it" if found["more_reps"]
                else f"at least {MIN_DECIDING_REPS} repetitions give an interval")
        raise UsageError(f"threshold=measured: the stored breakeven of {label!r} is undecided ({found['says']}); "
                         f"no threshold is taken from its median tail {found['tail']}: {more} "
                         "(`testbed sweep experiment=tail tail=... reps=N`), or give threshold=N")
    return breakeven.threshold_from_breakeven(found["tail"])


# --- run -------------------------------------------------------------------------------------------


def engine_settings(cfg: DictConfig, threshold: int):
    """backend=native: the C engine's settings (testbed.backends.native.engine.TailSettings)."""
    from testbed.backends.native.engine import TailSettings

    c = cfg.cache
    return TailSettings(cfg.chunk, c.dtype, c.group, c.sink, threshold, c.conv_kernel > 0, cfg.oracle.generate,
                        threads=cfg.threads, fused=bool(cfg.fused))


def make_engine(cfg: DictConfig, mcfg: gemma.GemmaConfig, w: dict, threshold: int, device, refimpl: bool = False):
    """The engine on the chosen backend: refimpl's numpy model on the host, or the model engine in C
    (kernels/tb_model.h) on `device`, every prefill run there. refimpl=True: the numpy model whatever
    the backend (the reference an engine under test is judged against)."""
    if cfg.backend == "native" and not refimpl:
        from testbed.backends.native.engine import DeviceTailEngine

        return DeviceTailEngine(device, mcfg, w, engine_settings(cfg, threshold))
    calibration = np.arange(cfg.calibration_tokens) % mcfg.vocab
    graph = tp.trace_chunk_graph(cfg.chunk, calibration)
    c = cfg.cache
    return Engine(w, mcfg, graph, tp.TailPolicy(threshold),
                  lambda: tp.model_caches(mcfg, c.dtype, c.sink, c.group, c.conv_kernel))


def prompt(mcfg: gemma.GemmaConfig, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, n]).integers(0, mcfg.vocab, n)


def cache_grid_records(cfg: DictConfig, ctx, mcfg, w, threshold: int) -> Iterator[Record]:
    """The byte-identical cache grid: refimpl's cache operations on the host; for backend=native, whole
    engine prefills on the device, padded + rollback against the exact append, the bytes pulled."""
    windows, sinks = tuple(cfg.oracle.grid_windows), tuple(cfg.oracle.grid_sinks)
    if cfg.backend != "native":
        cases = grid(windows, sinks)
        for i, case in enumerate(cases):
            ctx.progress(f"tail cache grid {i + 1}/{len(cases)} {case.name}")
            v = check_padded_rollback(case, seed=cfg.seed)
            yield Record("tail", f"cache/{case.name}", "oracle", v.oracle, v.verdict, v.margin, v.metrics,
                         params=dict(vars(case)), detail=v.detail)
        return
    from testbed.backends.native.engine import rollback_runs

    cases = engine_grid(cfg.oracle.grid_chunk, windows, sinks)
    for i, case in enumerate(cases):
        ctx.progress(f"tail engine cache grid {i + 1}/{len(cases)} {case.name}")
        padded, exact = rollback_runs(ctx.device, mcfg, w, case, engine_settings(cfg, threshold), seed=cfg.seed)
        v = check_engine_rollback(case, mcfg.layer_types, padded.prefill, exact.prefill)
        yield Record("tail", f"cache/{case.name}", "oracle", v.oracle, v.verdict, v.margin, v.metrics,
                     params=dict(vars(case)), detail=v.detail,
                     evidence=[padded.evidence.as_dict(), exact.evidence.as_dict()])


def suite_lengths(cfg: DictConfig, threshold: int) -> list[int]:
    """The first-token suite's prompt lengths: oracle.around_chunk, and the two tails either side of the
    threshold (C + threshold must stay scalar, C + threshold + 1 pad), where they fit in a chunk, so
    the padding decision is judged where an off-by-one would show."""
    lengths = prompt_lengths(cfg.chunk, [tuple(p) for p in cfg.oracle.around_chunk])
    boundary = [cfg.chunk + t for t in (threshold, threshold + 1) if 0 < t < cfg.chunk]
    return sorted(dict.fromkeys(lengths + boundary))


def cache_encoding_records(cfg: DictConfig, ctx, mcfg, w, threshold: int, n: int) -> Iterator[Record]:
    """backend=native with a float16 or int8 cache: the engine's stored rows against refimpl's encoding
    (the byte-identical grid compares the engine with itself)."""
    if cfg.backend != "native" or cfg.cache.dtype == "float32":
        return
    from testbed.backends.native.engine import encoding_runs

    ctx.progress(f"tail cache encoding N={n}")
    judged, float_run = encoding_runs(ctx.device, mcfg, w, prompt(mcfg, n, cfg.seed), engine_settings(cfg, threshold))
    v = check_cache_encoding(float_run.prefill, judged.prefill)
    yield Record("tail", f"N={n}/cache_encoding", "oracle", v.oracle, v.verdict, v.margin, v.metrics,
                 params={"prompt_tokens": n, "chunk": cfg.chunk, "cache_dtype": cfg.cache.dtype,
                         "cache_group": cfg.cache.group, "source": source_label(cfg, ctx.device.profile.name)},
                 detail=v.detail, evidence=[judged.evidence.as_dict(), float_run.evidence.as_dict()])


def engine_atol(cfg: DictConfig, spec, dtype: str) -> tuple[float, str]:
    """The logits tolerance an engine under test is judged with for a cache dtype, and where it comes from:
    the engine's declared precision (its yaml's `tolerance`), unless oracle.engine_tolerance=false or it
    declares none for that dtype; then oracle.naive_atol."""
    declared = spec.logits_tolerance(dtype) if cfg.oracle.engine_tolerance else None
    if declared is None:
        return float(cfg.oracle.naive_atol[dtype]), f"oracle.naive_atol.{dtype}"
    measured = f" (measured {spec.tolerance_measured})" if spec.tolerance_measured else ""
    return declared, f"{spec.path.name}: tolerance.{dtype}{measured}"


def engine_state_records(cfg: DictConfig, ctx, mcfg, w, spec, program, base, label: str) -> Iterator[Record]:
    """The engine grid's prompts (testbed.oracles.tail.engine_grid), each prefilled with its tail padded then
    its pad rows removed and with the last partial chunk appended unpadded (tail.mode none): state.bin
    equal (state_bytes), which counts only beside an oracle on what the state holds (judged_with,
    testbed.oracles.engine): for an engine that restores (supports.state_in) the padded state restored in
    a fresh engine process that decodes oracle.continuation more tokens, against refimpl's continuation
    of the same prompt (state_continuation); otherwise the state's properties (state_properties): it
    differs from the state of the prompt with its last token changed and from the state before the last
    call, and its size follows the model's K/V rows."""
    from testbed.backends import NotSupported
    from testbed.backends.engine import tail as engine_tail
    from testbed.backends.engine.runner import ContractError
    from testbed.backends.engine.state import compare
    from testbed.oracles.engine import (check_continuation, check_state_bytes, check_state_properties,
                                        continuation_failed, judged_with)
    from testbed.oracles.tail import greedy_continuation

    content_oracle = "state_continuation" if spec.state_in else "state_properties"
    cases = engine_grid(cfg.oracle.grid_chunk, tuple(cfg.oracle.grid_windows), tuple(cfg.oracle.grid_sinks),
                        (cfg.cache.dtype,))
    shorter: dict[tuple, tuple[int, int]] = {}  # per (window, sink, dtype): the last state's (positions, bytes)
    for i, case in enumerate(cases):
        ctx.progress(f"tail engine state {i + 1}/{len(cases)} {case.name}")
        model = dataclasses.replace(mcfg, window=case.window)
        tokens = np.random.default_rng([cfg.seed, case.prompt]).integers(0, mcfg.vocab, case.prompt)
        settings = dataclasses.replace(base, chunk=case.chunk, cache_dtype=case.dtype, sink=case.sink)
        params = dict(vars(case)) | {"source": label}
        runs = []

        def prefill(prompt_tokens, mode, **kw):
            r = engine_tail.prefill(ctx.device, spec, model, w, prompt_tokens, settings, mode, engine_program=program,
                                    **kw)
            runs.append(r)
            return r

        def record(v):
            evidence = [r.evidence.as_dict() for r in runs if r.evidence]
            return Record("tail", f"state/{case.name}/{v.oracle}", "oracle", v.oracle, v.verdict, v.margin, v.metrics,
                          params=params, detail=v.detail, evidence=evidence)

        try:
            padded = prefill(tokens, "padded", state=True, state_before_last=not spec.state_in)
        except NotSupported as e:
            for oracle in ("state_bytes", content_oracle):
                yield record(Verdict.not_judged(oracle, str(e), state="not supported"))
            continue
        diff = None  # padded against unpadded: None when the engine refuses the unpadded tail
        try:
            unpadded = prefill(tokens, "none", state=True)
            diff = compare(padded.state, unpadded.state, spec.state_layout, spec.state_tolerance)
            agreement = check_state_bytes(padded, unpadded, spec.state_layout, spec.state_tolerance, diff)
        except NotSupported as e:
            agreement = Verdict.not_judged("state_bytes", str(e), state="not supported")
        if spec.state_in:
            reference = Engine(w, model, tp.ChunkGraph(case.chunk), tp.TailPolicy(0),
                               lambda: tp.model_caches(model, case.dtype, case.sink, cfg.cache.group))
            fed, expected = greedy_continuation(reference, tokens, cfg.oracle.continuation)
            atol, atol_from = engine_atol(cfg, spec, case.dtype)
            try:
                r = engine_tail.continue_from(ctx.device, spec, model, w, np.r_[tokens, fed], settings, padded.state,
                                              tokens.size, program)
                runs.append(r)
                content = check_continuation(expected, r.logits, fed, tokens.size, atol)
            except NotSupported as e:
                content = Verdict.not_judged(content_oracle, str(e), state="not supported")
            except ContractError as e:  # the engine broke on its own state: the state oracle fails, saying how
                content = continuation_failed(tokens.size, str(e))
            content.metrics["atol_from"] = atol_from
        else:
            other_tokens = tokens.copy()
            other_tokens[-1] = (other_tokens[-1] + 1) % mcfg.vocab
            try:
                other = prefill(other_tokens, "padded", state=True).state
            except NotSupported:
                other = None
            group = (case.window, case.sink, case.dtype)
            content = check_state_properties(padded.state, tokens.size,
                                             engine_tail.CacheBytes(model, case.dtype, cfg.cache.group), diff, other,
                                             padded.state_before_last, shorter.get(group), spec.state_layout,
                                             spec.state_tolerance)
            shorter[group] = (tokens.size, padded.state.size)
        yield record(content)
        yield record(judged_with(agreement, content))


def engine_oracle_records(cfg: DictConfig, ctx, mcfg, w, threshold: int) -> Iterator[Record]:
    """backend=engine, through the contract: the state oracles over the engine grid (engine_state_records);
    then the suite's prompts, the first token of the padded and the scalar tail against refimpl's engine
    on the same caches (verdict first_token, logits within the engine's declared tolerance or
    oracle.naive_atol of the cache dtype: engine_atol). A refusal is recorded "not supported"."""
    from testbed.backends import NotSupported
    from testbed.backends.engine import spec as engine_spec, tail as engine_tail
    from testbed.oracles.engine import check_first_token_agrees

    spec = engine_spec.load(cfg.engine)
    program = engine_tail.program(ctx.device, spec)
    label = source_label(cfg, ctx.device.profile.name)
    base = engine_settings(cfg, threshold)
    yield from engine_state_records(cfg, ctx, mcfg, w, spec, program, base, label)
    atol, atol_from = engine_atol(cfg, spec, cfg.cache.dtype)
    for n in suite_lengths(cfg, threshold):
        ctx.progress(f"tail engine first token N={n}")
        tokens = prompt(mcfg, n, cfg.seed)
        reference = make_engine(cfg, mcfg, w, 0, None, refimpl=True).prefill(tokens)
        runs, detail = {}, ""
        try:
            for mode in ("padded", "scalar"):
                runs[mode] = engine_tail.prefill(ctx.device, spec, mcfg, w, tokens, base, mode, state=False,
                                                 engine_program=program)
        except NotSupported as e:
            detail = str(e)
        evidence = [r.evidence.as_dict() for r in runs.values() if r.evidence]
        params = {"prompt_tokens": n, "tail": n % cfg.chunk, "chunk": cfg.chunk, "source": label}
        if detail:
            yield Record("tail", f"N={n}/first_token", "oracle", "first_token", "not supported", None, {},
                         params=params, detail=detail, evidence=evidence)
            continue
        v = check_first_token_agrees(reference.logits, {m: r.logits[0] for m, r in runs.items()}, atol)
        v.metrics["atol_from"] = atol_from
        yield Record("tail", f"N={n}/{v.oracle}", "oracle", v.oracle, v.verdict, v.margin, v.metrics, params=params,
                     detail=v.detail, evidence=evidence)


def oracle_records(cfg: DictConfig, ctx, mcfg, w, threshold: int) -> Iterator[Record]:
    if cfg.backend == "engine":
        yield from engine_oracle_records(cfg, ctx, mcfg, w, threshold)
        return
    yield from cache_grid_records(cfg, ctx, mcfg, w, threshold)
    yield from cache_encoding_records(cfg, ctx, mcfg, w, threshold, suite_lengths(cfg, threshold)[0])
    engine = make_engine(cfg, mcfg, w, threshold, ctx.device)
    lengths = suite_lengths(cfg, threshold)
    for n in lengths:
        ctx.progress(f"tail first-token suite N={n}")
        # the float64 model costs seconds per prompt at this shape: it judges the shortest prompt only
        naive_atol = float(cfg.oracle.naive_atol[cfg.cache.dtype]) if n == lengths[0] else None
        verdicts = check_first_token(engine, prompt(mcfg, n, cfg.seed), cfg.chunk, threshold, cfg.oracle.generate,
                                     naive_atol)
        evidence = [run.evidence.as_dict() for run in getattr(engine, "runs", [])]  # the device's prefills
        if evidence:
            engine.runs.clear()
        for v in verdicts:
            yield Record("tail", f"N={n}/{v.oracle}", "oracle", v.oracle, v.verdict, v.margin, v.metrics,
                         params={"prompt_tokens": n, "tail": n % cfg.chunk, "chunk": cfg.chunk,
                                 "threshold": threshold, "source": source_label(cfg, ctx.device.profile.name)},
                         detail=v.detail, evidence=evidence)


def call_flops(mcfg: gemma.GemmaConfig, rows: int, past: int) -> int:
    """FLOPs of one graph call of `rows` rows after `past` prompt positions: gemma.graph_flops, with
    each local layer attending only the rows its sliding cache holds (at most the window)."""
    head = gemma.graph_flops(mcfg, rows, past) - gemma.graph_flops(mcfg, rows, past, logit_rows=0)

    def layer(keys: int) -> int:
        return gemma.graph_flops(mcfg, rows, keys, logit_rows=0) // mcfg.layers

    return head + sum(layer(min(past, mcfg.window) if t == "local" else past) for t in mcfg.layer_types)


def prefill_flops(mcfg: gemma.GemmaConfig, tel: tp.Telemetry) -> int:
    """FLOPs of the graph calls a prefill made, read off its telemetry (pad rows are computed too)."""
    c = tel.chunk_size
    calls = [(c, b * c) for b in range(tel.chunk_tokens // c)]
    if tel.tail_mode == "padded":
        calls += [(c, tel.chunk_tokens), (1, tel.prompt_tokens - 1)]
    else:
        calls += [(1, p) for p in range(tel.chunk_tokens, tel.prompt_tokens)]
    return sum(call_flops(mcfg, rows, past) for rows, past in calls)


def requested_telemetry(n: int, chunk: int, mode: str) -> tp.Telemetry:
    """What a prefill asked of an engine under test did (the contract returns no telemetry): full chunks,
    then the tail padded or scalar as requested."""
    tail = n % chunk
    padded = mode == "padded" and tail > 0
    return tp.Telemetry(n, chunk, n - tail, tail if padded else 0, chunk - tail if padded else 0,
                        0 if padded else tail, ("padded" if padded else "scalar") if tail else "none",
                        f"tail.mode={mode} requested of the engine")


def bench_records(cfg: DictConfig, ctx, mcfg, w, threshold: int) -> Iterator[Record]:
    # Padding is forced wherever the guards allow (threshold 0): the sweep measures what the policy's
    # threshold is then chosen from. Scalar is the kill switch. Every (N, mode) is one variant, and
    # each repetition runs every variant once in its own shuffled order, so 1023 and 1024, padded and
    # scalar, are compared under the same machine load. On the native engine each variant is one
    # program run on the device, timed by the program's own clocks (after its own untimed prefill).
    forced = make_engine(cfg, mcfg, w, 0, ctx.device)
    label = source_label(cfg, ctx.device.profile.name)
    lengths = _lengths(cfg)
    prompts = {n: prompt(mcfg, n, cfg.seed) for n in lengths}
    telemetry, evidence = {}, {}
    instructions: dict[tuple, list[int]] = {}  # native on a device that counts: each prefill's exact count
    ctx.progress(f"tail bench N={','.join(map(str, lengths))}, interleaved")
    if cfg.backend == "native":
        from testbed.backends.native.engine import tail as engine_tail

        def variant(n: int, mode: str):
            def run() -> dict[str, float]:
                r = engine_tail(ctx.device, mcfg, w, prompts[n], forced.settings, reps=1,
                                kill_switch=mode == "scalar")
                telemetry[n, mode] = r.prefill.telemetry
                evidence.setdefault((n, mode), []).append(r.evidence.as_dict())
                if r.counts:
                    instructions.setdefault((n, mode), []).extend(r.counts.of("prefill"))
                return {"wall": r.timings["seconds"][0], "cpu": r.timings["cpu_seconds"][0]}
            return run

        def timer(run):
            return run()  # the program's own clocks
    elif cfg.backend == "engine":
        from testbed.backends.engine import spec as engine_spec, tail as engine_tail

        spec = engine_spec.load(cfg.engine)
        program = engine_tail.program(ctx.device, spec)
        settings = engine_settings(cfg, 0)

        def variant(n: int, mode: str):
            def run() -> dict[str, float]:
                r = engine_tail.prefill(ctx.device, spec, mcfg, w, prompts[n], settings, mode, state=False,
                                        bench={"reps": 1, "warmup": 0}, count=bool(cfg.get("counts")),
                                        engine_program=program)
                telemetry[n, mode] = requested_telemetry(n, cfg.chunk, mode)
                evidence.setdefault((n, mode), []).append(r.evidence.as_dict())
                if r.counts and r.counts.regions:
                    instructions.setdefault((n, mode), []).extend(r.counts.of("prefill"))
                timed = r.timings["calls"][-1:]  # the bench repetition's call (the first is the judged run)
                return {"wall": float(timed[0]["wall_s"]), "cpu": float(timed[0]["cpu_s"])}
            return run

        def timer(run):
            return run()  # the engine's own clocks
    else:
        def variant(n: int, mode: str):
            def run():
                with kill_switch(mode == "scalar"):
                    state = forced.prefill(prompts[n])
                telemetry[n, mode] = state.telemetry
                return state.first_token  # the first token is out: that is TTFT
            return run

        timer = host_clocks
    timed = time_interleaved({(n, mode): variant(n, mode) for n in lengths for mode in ("padded", "scalar")},
                             reps=cfg.reps, warmup=cfg.warmup, seed=cfg.seed, timer=timer, progress=ctx.progress,
                             what="tail bench")
    if cfg.backend == "native" and cfg.counts and not ctx.device.profile.has("counts"):
        for k, (n, mode) in enumerate(timed.figures, 1):  # one more run each, apart from the timed ones
            ctx.progress(f"tail bench: counting each prefill's instructions under valgrind {k}/{len(timed.figures)}")
            r = engine_tail(ctx.device, mcfg, w, prompts[n], forced.settings, reps=1, kill_switch=mode == "scalar",
                            count=True)
            instructions[n, mode] = r.counts.of("prefill")
    for (n, mode), clocks in timed.figures.items():
        wall, cpu = clocks["wall"], clocks["cpu"]
        tel = telemetry[n, mode]
        would_pad = tp.TailPolicy(threshold).decide(tel.tail, forced.graph.rows, forced.make_caches())
        rows = tel.chunk_tokens + (tel.chunk_size if tel.tail_mode == "padded" else 0) + tel.scalar_tail_tokens
        calls = tel.chunk_tokens // tel.chunk_size + (tel.tail_mode == "padded") + tel.scalar_tail_tokens
        flops = prefill_flops(mcfg, tel)
        yield Record(
            "tail", f"N={n}/{mode}", "measure",
            figures={"ttft": wall.scaled(1e3, "ms"), "tokens_per_s": wall.rate(n, "tokens/s"),
                     "gflops": wall.rate(flops / 1e9, "GFLOP/s"),
                     "ttft_cpu": cpu.scaled(1e3, "ms"), "tokens_per_cpu_s": cpu.rate(n, "tokens/s"),
                     **({"instructions": Figure.of(instructions[n, mode], "instructions")}
                        if (n, mode) in instructions else {})},
            metrics={**{f"telemetry.{k}": v for k, v in vars(tel).items()},
                     "policy_pads": would_pad[0], "policy_reason": would_pad[1],
                     "interleave.variants": len(timed.figures), "interleave.positions": timed.positions((n, mode))},
            work={"rows_computed": rows, "graph_calls": calls, "flops": flops,
                  "flop_count": "gemma.graph_flops per call, local layers over the rows their window holds",
                  "what": "time from prompt to first token (prefill + argmax): " + (
                      "the engine's own clocks on the device" if evidence else "wall and CPU time, reference model")},
            params={"prompt_tokens": n, "tail": tel.tail, "mode": mode, "chunk": cfg.chunk,
                    "threshold": threshold, "source": label, "threads": cfg.threads, "order_seed": timed.seed},
            evidence=evidence.get((n, mode), []),
        )


FIXTURE_REPS = 8  # the seed's sweep: medians of 8 alternating repetitions (min and max not published)


def fixture_records(cfg: DictConfig) -> Iterator[Record]:
    path = fixture_path(cfg)
    comment = " ".join(line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#"))
    df = breakeven.read_sweep_csv(path)
    for r in df.itertuples(index=False):
        for mode in ("padded", "scalar"):
            tps, ttft = getattr(r, f"{mode}_tps"), getattr(r, f"{mode}_ttft_ms")
            yield Record(
                "tail", f"N={r.prompt_tokens}/{mode}", "measure",
                figures={"tokens_per_s": Figure(float(tps), float(tps), float(tps), FIXTURE_REPS, "tokens/s"),
                         "ttft": Figure(float(ttft), float(ttft), float(ttft), FIXTURE_REPS, "ms")},
                params={"prompt_tokens": int(r.prompt_tokens), "tail": int(r.tail), "mode": mode,
                        "source": f"fixture:{cfg.fixture}"},
                detail=comment,
            )


def engine_refusal(cfg: DictConfig, ctx) -> Iterator[Record]:
    """backend=engine: what the engine's yaml says it does not serve (tail, the device's ABI, the cache dtype),
    recorded "not supported" for each oracle and the bench the run would have made."""
    from testbed.backends.engine import refusals, spec as engine_spec

    why = refusals.why_not(engine_spec.load(cfg.engine), ctx.device, "tail", cache=cfg.cache.dtype)
    if why is None:
        return
    judged = [("state_bytes/engine", "state_bytes"), ("first_token/engine", "first_token")] \
        if cfg.mode in ("oracle", "all") else []
    judged += [("bench/engine", "bench")] if cfg.mode in ("bench", "all") else []
    yield from refusals.records("tail", judged, why)


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    if cfg.mode == "fixture":
        yield from fixture_records(cfg)
        return
    if cfg.backend == "engine":
        refused = list(engine_refusal(cfg, ctx))
        if refused:
            yield from refused
            return
    from threadpoolctl import threadpool_limits

    threshold = policy_threshold(cfg, ctx.device.profile.name)
    mcfg = model_config(cfg)
    w = gemma.init_weights(mcfg, cfg.seed)
    with threadpool_limits(limits=cfg.threads):
        if cfg.mode in ("oracle", "all"):
            yield from oracle_records(cfg, ctx, mcfg, w, threshold)
        if cfg.mode in ("bench", "all"):
            yield from bench_records(cfg, ctx, mcfg, w, threshold)


# --- tables ----------------------------------------------------------------------------------------


# Per clock, the figures a sweep reads: throughput and TTFT by wall time (what a user waits) or by
# this process's or the engine's CPU time (what the work cost, whatever else ran on a loaded host); or,
# on a device that counts (an emulator; the host under valgrind with counts=true), the prefill's exact
# instructions, read as tokens per 1e9 instructions (its "TTFT" the instructions themselves).
CLOCK_FIGURES = {"wall": ("tokens_per_s", "ttft"), "cpu": ("tokens_per_cpu_s", "ttft_cpu"),
                 "instructions": ("instructions", "instructions")}
CLOCK_BY = {"wall": "wall time", "cpu": "CPU time", "instructions": "instructions"}  # what a decision is by
PER_GINSTR = 1e9  # instructions-as-a-rate: tokens per 1e9 instructions


def sweep_frame(df: pd.DataFrame, clock: str = "wall") -> pd.DataFrame:
    """Measurements in breakeven's columns by `clock`, one row per (source, N), from each source's
    latest run only: a sweep is one interleaved measurement, never stitched from jobs under different
    loads. Sources without that clock's figures (the seed's fixture has no CPU time, a device that does
    not count no instructions) are left out. By instructions the throughputs are tokens per 1e9
    instructions and the TTFT columns hold the instructions."""
    tps, ttft = (f"figures.{name}.median" for name in CLOCK_FIGURES[clock])
    if df.empty or "kind" not in df or tps not in df:
        return pd.DataFrame()
    m = df[(df["kind"] == "measure") & df[tps].notna()]
    if m.empty:
        return pd.DataFrame()
    m = m.sort_values("time", kind="stable")
    latest_run = m.groupby("params.source")["run_id"].transform("last")
    m = m[m["run_id"] == latest_run].groupby(["params.source", "params.prompt_tokens", "params.mode"]).tail(1)
    spread = [c for c in (tps.replace(".median", ".min"), tps.replace(".median", ".max")) if c in m]
    wide = m.pivot_table(index=["params.source", "params.prompt_tokens", "params.tail"], columns="params.mode",
                         values=list(dict.fromkeys([tps, ttft])), aggfunc="last")
    wide = wide.dropna()
    if wide.empty:
        return pd.DataFrame()
    tokens = wide.index.get_level_values(1).astype(int).to_numpy()
    counted = clock == "instructions"

    def rate(values, n):  # the figure as a throughput: itself, or tokens per 1e9 instructions
        return n * PER_GINSTR / np.asarray(values, float) if counted else np.asarray(values, float)

    frame = pd.DataFrame({
        "source": wide.index.get_level_values(0),
        "prompt_tokens": tokens,
        "tail": wide.index.get_level_values(2).astype(int),
        "padded_tps": rate(wide[(tps, "padded")].to_numpy(), tokens),
        "scalar_tps": rate(wide[(tps, "scalar")].to_numpy(), tokens),
        "padded_ttft_ms": wide[(ttft, "padded")].to_numpy(),
        "scalar_ttft_ms": wide[(ttft, "scalar")].to_numpy(),
    })
    repetitions = tps.replace(".median", ".samples")
    if repetitions in m:  # each repetition's throughput, for the breakeven's interval
        by_rep = m.set_index(["params.source", "params.prompt_tokens", "params.tail", "params.mode"])[repetitions]
        for mode in ("padded", "scalar"):
            found = [by_rep.get((*key, mode)) for key in wide.index]
            frame[f"{mode}_tps_samples"] = [list(rate(v, key[1])) if isinstance(v, list) else v
                                            for v, key in zip(found, wide.index)]
    if len(spread) == 2:  # each throughput's least and greatest repetition, for the plots' error bars
        bounds = m.pivot_table(index=["params.source", "params.prompt_tokens", "params.tail"], columns="params.mode",
                               values=spread, aggfunc="last").reindex(wide.index)
        low, high = (spread[1], spread[0]) if counted else spread  # more instructions: a lower rate
        for mode in ("padded", "scalar"):
            frame[f"{mode}_tps_min"] = rate(bounds[(low, mode)].to_numpy(), tokens)
            frame[f"{mode}_tps_max"] = rate(bounds[(high, mode)].to_numpy(), tokens)
    return frame


def breakeven_of(source: str, sweep: pd.DataFrame, clock: str = "wall") -> dict:
    """The sweep's breakeven as data, by `clock` (wall or CPU time: on a loaded host the CPU curve is
    the work's own, the wall curve also holds the scheduler's waits; or instructions, exact, on a
    device that counts): the tail padding wins from (None: not up to the largest tail measured), the
    policy threshold it gives, its interval from the repetitions (breakeven.breakeven_interval: lo and
    hi, the level, the method, how many repetitions, whether it is decided) and the sentence a person
    reads."""
    b = breakeven.breakeven_tail(sweep)
    largest = int(sweep["tail"].max())
    interval = breakeven.breakeven_interval(sweep, by=CLOCK_BY[clock])
    says = (f"none: padding does not win at tail {largest}" if b is None
            else f"padded from tail {b} (threshold {b - 1})") + ("" if clock == "wall" else f", by {CLOCK_BY[clock]}")
    return {"source": source, "clock": clock, "by": CLOCK_BY[clock], "tail": b,
            "threshold": breakeven.threshold_from_breakeven(b),
            "largest_tail": largest, "tails": int(sweep["tail"].nunique()),
            "lo": interval["lo"], "hi": interval["hi"], "level": interval["level"], "method": interval["method"],
            "reps": interval["reps"], "decided": interval["decided"], "more_reps": interval["more_reps"],
            "says": f"{says}; breakeven tail {interval['says']}"}


MIN_SWEEP_TAILS = 3  # fewer tails are a comparison (1023 vs 1024), not a sweep with a breakeven


def view(df: pd.DataFrame) -> pd.DataFrame:
    """Measurements: the reviewer's table per source (its breakeven is `breakevens`), with each mode's
    exact instructions where the device counts; on an emulated device the instructions alone (its times
    are never speed: no winner is drawn from them). Without measurements: the oracle verdicts."""
    decided = decided_from(df)
    timed, counted = sweep_frame(decided), sweep_frame(decided, "instructions")
    parts = []
    for source in dict.fromkeys([*timed.get("source", []), *counted.get("source", [])]):
        rows = timed[timed["source"] == source] if len(timed) else timed
        counts = counted[counted["source"] == source] if len(counted) else counted
        table = breakeven.tail_table(rows) if len(rows) else None
        if len(counts):
            by_counts = breakeven.instruction_table(counts)
            table = by_counts if table is None else table.merge(by_counts, on=["N", "tail"], how="left")
        table.insert(0, "source", source)
        parts.append(table)
    if parts:
        return pd.concat(parts, ignore_index=True)
    oracles = df[df["kind"] == "oracle"] if len(df) else df
    return pd.DataFrame({
        "case": oracles["case"], "oracle": oracles["oracle"], "verdict": oracles["verdict"],
        "margin": oracles["margin"], "covers": oracles.get("metrics.covers"),
        "padded mode": oracles.get("metrics.padded_mode"), "agree": oracles.get("metrics.sequence_agree"),
        "detail": oracles["detail"],
    }).reset_index(drop=True) if len(oracles) else pd.DataFrame()


def decided_from(df: pd.DataFrame) -> pd.DataFrame:
    """The records a decision may read: an emulated device's times are never speed, its counts are
    (testbed.measure.emulation)."""
    return emulation.split_frame(df)[0]


def breakevens(df: pd.DataFrame) -> list[dict]:
    """The breakevens of each source's sweep that has at least MIN_SWEEP_TAILS tails: by wall time, and
    by CPU time where the records have it (never from an emulated device's times), and by instructions
    where the device counted them."""
    df = decided_from(df)
    found = []
    for clock in ("wall", "cpu", "instructions"):
        sweep = sweep_frame(df, clock)
        for source, rows in sweep.groupby("source", sort=False) if len(sweep) else ():
            if rows["tail"].nunique() >= MIN_SWEEP_TAILS:
                found.append(breakeven_of(source, rows, clock))
    order = {clock: i for i, clock in enumerate(("wall", "cpu", "instructions"))}
    sources = list(dict.fromkeys(b["source"] for b in found))  # each source's breakevens together
    return sorted(found, key=lambda b: (sources.index(b["source"]), order[b["clock"]]))


def sweep_row(df: pd.DataFrame) -> dict:
    """Per sweep job (all its tails measured interleaved): how many tails, its breakeven tail by wall
    time, CPU time and instructions (where it has each) with the interval of the first, the oracle
    tally; each breakeven's sentence, with its confidence, for the footer (`decisions`, never a cell)."""
    row: dict = {}
    decided = decided_from(df)
    for clock, name in (("wall", "breakeven tail"), ("cpu", "breakeven tail (CPU time)"),
                        ("instructions", "breakeven tail (instructions)")):
        sweep = sweep_frame(decided, clock)
        if sweep.empty:
            continue
        row.setdefault("tails", int(sweep["tail"].nunique()))
        if sweep["tail"].nunique() >= MIN_SWEEP_TAILS:
            found = breakeven_of("this job", sweep, clock)
            row[name] = found["tail"]
            if "breakeven lo" not in row:
                row.update({"breakeven lo": found["lo"], "breakeven hi": found["hi"],
                            "decided": found["decided"]})
            row.setdefault("decisions", []).append(found["says"])
    oracles = df[df["kind"] == "oracle"]
    if len(oracles):
        row["oracles"] = Tally(oracles["verdict"]).phrase()
    return row


def sweep_footer(rows: pd.DataFrame, jobs) -> str:
    """Each job's breakevens in full, with their confidence (sweep_row's `decisions`)."""
    lines = []
    for (_, row), rc in zip(rows.iterrows(), jobs):
        said = row.get("decisions")
        if isinstance(said, list):
            job = " ".join(o for o in rc.overrides if not o.startswith("experiment="))
            lines += [f"breakeven ({job or 'the job'}): {says}" for says in said]
    return "\n".join(lines)
