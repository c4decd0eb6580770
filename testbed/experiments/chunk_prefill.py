"""Experiment `chunk_prefill`: chunk prefill with past against the all-positions redecode (seed 000).

oracle mode  each configured case (P cached positions, n utterance tokens, chunk C): the token at
             position P+n-1 from ceil(n/C) chunk calls must equal redecode's and the token-by-token
             decode's; logits and the cache within tolerance; and logits and token those of the
             model written out in float64 (refimpl.naive_gemma, verdict naive) (testbed.oracles.tokens).
             For backend=iree (its graphs run the host's masks) also the first case with masks that
             differ per head, against refimpl on the same masks (verdict mask_heads); for
             backend=native, whose engine builds masks the same for every head, its attention kernel
             at the model's shape and that case's P and C with such masks (verdict mask_heads).
bench mode   on the chosen backend, the time of one chunk call of C rows and of one decode step,
             both against bench.past cached positions, with FLOPs counted (refimpl.gemma.graph_flops);
             then the projected latency of each configured utterance length: ceil(n/C) chunk calls
             against n decode steps, each followed by reply_tokens decode steps.

A user's module (backend=iree iree.artifact=DIR: seed 000's prefill_with_past from someone's exporter,
testbed.backends.iree.user_module) replaces testbed's graphs: one call per case on the device, judged by
testbed.oracles.module_contract (token, logits, K/V, mask_heads, and a diagnosis naming the argument or
result it gets wrong); bench mode times its chunk call alone (it has no decode step).

`testbed sweep chunk=32,64` prints one row per C (verdicts, margin, chunk-call and decode-step time)
and, below it, the projected-latency table over the configured length distribution naming the C
with the lowest expected latency by the medians, then the decision with its confidence: that C alone
at 95%, or "undecided" with the C not distinguishable from it (best_chunk); on a device that counts,
also by instructions. The seed's device figures (fixture CSV) are rendered by the same table code.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from refimpl import gemma
from testbed import backends, verdicts
from testbed.backends.iree.artifacts import target_names
from testbed.backends.native.engine import WEIGHT_DTYPES, dequantized
from testbed.config import Choice, Float, Int, IntList, project_path
from testbed.errors import UsageError
from testbed.measure import decisions, seed
from testbed.models.checkpoints import load_checkpoint
from testbed.models.prompts import find_tokenizer, load_prompt
from testbed.oracles.numerical import digest
from testbed.oracles.tokens import Reference, TokenCase, check_mask_heads, check_token_at_position
from testbed.report import implementations, tables
from testbed.results import Record
from testbed.verdicts import Tally

PRESETS = {"tiny": gemma.tiny_config, "functiongemma": gemma.functiongemma_config}
ORACLES = ("token", "logits", "cache", "naive")  # per case (testbed.oracles.tokens.check_token_at_position)

PARAMS = {
    "backend": Choice(tuple(backends.implementing("gemma"))),
    "mode": Choice(("oracle", "bench", "all")),
    "target": Choice(tuple(target_names())),
    "iree.driver": Choice((None, "local-sync", "local-task", "vulkan")),
    "iree.past_bucket": Int(1, 4096),
    "iree.weights": Choice(("parameters", "constants")),
    "native.weights": Choice(WEIGHT_DTYPES),
    "native.group": Int(1, 1 << 16),
    "chunk": Int(1, 4096),
    "logit_atol": Float(0.0),
    "engine_tolerance": Choice((True, False)),
    "cache_atol": Float(0.0),
    "threads": Int(1, 256),
    "counts": Choice((False, True)),
    "fused": Choice((False, True)),
    "seed": Int(0),
    "model.preset": Choice(tuple(PRESETS)),
    "model.weights_seed": Int(0),
    "model.chat": Choice((False, True)),
    "bench.past": Int(0, 1 << 20),
    "bench.warmup": Int(0, 100),
    "bench.reps": Int(1, 1000),
    "latency.utterance_tokens": IntList(1, 1 << 20),
    "latency.reply_tokens": Int(0, 1 << 20),
    "fixture.decode_s": Float(0.0),
}


# --- configuration ---------------------------------------------------------------------------------


def cases(cfg: DictConfig) -> list[TokenCase]:
    if not OmegaConf.is_list(cfg.cases) or not len(cfg.cases):
        raise UsageError(f"cases={cfg.cases!r} is not accepted; accepted: a non-empty list of {{past: P, tokens: n}}")
    out = []
    for i, c in enumerate(OmegaConf.to_container(cfg.cases)):
        if not isinstance(c, dict) or set(c) != {"past", "tokens"}:
            raise UsageError(f"cases[{i}]={c!r} is not accepted; accepted: {{past: P, tokens: n}} entries")
        for key in ("past", "tokens"):
            if isinstance(c[key], bool) or not isinstance(c[key], int) or c[key] < 1:
                raise UsageError(f"cases[{i}].{key}={c[key]!r} is not accepted; accepted: integers >= 1")
        out.append(TokenCase(c["past"], c["tokens"], cfg.chunk))
    return out


def model_config(cfg: DictConfig) -> gemma.GemmaConfig:
    """The model's shape, without weights (a checkpoint's config.json or GGUF header decides)."""
    return load_model(*_model_key(cfg))[0] if cfg.model.checkpoint else _preset(cfg)


def _preset(cfg: DictConfig) -> gemma.GemmaConfig:
    overrides = OmegaConf.to_container(cfg.model.overrides) or {}
    fields = {f.name for f in dataclasses.fields(gemma.GemmaConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise UsageError(f"model.overrides.{unknown[0]} is not a model field; accepted: {', '.join(sorted(fields))}")
    try:
        return PRESETS[cfg.model.preset](**overrides)
    except (TypeError, ValueError) as e:
        raise UsageError(f"model.overrides {overrides}: {e}") from None


def _model_key(cfg: DictConfig) -> tuple:
    overrides = tuple(sorted((OmegaConf.to_container(cfg.model.overrides) or {}).items()))
    checkpoint = str(project_path(cfg.model.checkpoint)) if cfg.model.checkpoint else None
    return cfg.model.preset, overrides, cfg.model.weights_seed, checkpoint


@functools.lru_cache(maxsize=2)
def load_model(preset: str, overrides: tuple, weights_seed: int, checkpoint: str | None):
    """(config, weights, weights digest), kept for the next job of a sweep: seeded FunctionGemma weights
    take seconds."""
    if checkpoint:
        model, w = load_checkpoint(checkpoint)
    else:
        model = PRESETS[preset](**dict(overrides))
        w = gemma.init_weights(model, weights_seed)
    return model, w, digest(*(w[name] for name in sorted(w)))


def prompt_length(cfg: DictConfig) -> int:
    needs = [c.past + c.tokens for c in cases(cfg)] if cfg.mode in ("oracle", "all") else []
    if cfg.mode in ("bench", "all"):
        needs.append(cfg.bench.past + cfg.chunk)
    return max(needs)


def validate(cfg: DictConfig) -> None:
    cases(cfg)
    if cfg.backend == "engine":  # the engine's yaml (what it serves is recorded by run: engine_refusal)
        from testbed.backends.engine import spec as engine_spec

        engine_spec.load(cfg.get("engine"))
    check_given_gguf(cfg)
    if cfg.fused and cfg.backend != "native":
        raise UsageError(f"fused=true chooses the native programs' FMA build; backend={cfg.backend} has none; "
                         "accepted: fused=true with backend=native, or fused=false")
    if cfg.backend == "iree":  # a module for another kind of device is refused before anything compiles
        from testbed.backends.iree.device import check_target_fits
        from testbed.devices import load_profile

        check_target_fits(cfg.target, load_profile(cfg.device.name))
    if cfg.counts and cfg.backend != "native":
        raise UsageError(f"counts=true counts the native engine's instructions; backend={cfg.backend} runs no native "
                         "program (accepted: counts=true with backend=native)")
    if cfg.mode in ("bench", "all") and cfg.bench.past < 1:
        raise UsageError(f"bench.past={cfg.bench.past} is out of range; accepted: integers >= 1")
    weights = cfg.latency.weights
    if weights is not None:
        w = list(weights)
        if len(w) != len(cfg.latency.utterance_tokens) or any(not isinstance(x, (int, float)) or x < 0 for x in w) \
                or sum(w) <= 0:
            raise UsageError(f"latency.weights={w} is not accepted; accepted: null or "
                             f"{len(cfg.latency.utterance_tokens)} non-negative numbers, not all zero")
    model = model_config(cfg)
    if user_artifact(cfg):
        check_cases_fit(cfg, load_user_module(cfg, model))
    expected = cfg.model.expected_token
    if expected is not None:
        if not isinstance(expected, int) or not 0 <= expected < model.vocab:
            raise UsageError(f"model.expected_token={expected!r} is not accepted; accepted: null or 0..{model.vocab - 1}")
        ends = sorted({c.position for c in cases(cfg)})
        if cfg.mode != "bench" and len(ends) > 1:
            raise UsageError(f"model.expected_token={expected} pins one token but the cases end at positions "
                             f"{', '.join(map(str, ends))}; accepted: cases that all end at one position")
    run_prompt(cfg, model)


def given_gguf(cfg: DictConfig) -> str | None:
    gguf = OmegaConf.select(cfg, "model.gguf", default=None)
    return str(project_path(gguf)) if gguf else None


def check_given_gguf(cfg: DictConfig) -> None:
    """model.gguf: a GGUF handed to the engine beside the Hugging Face folder the reference reads."""
    gguf = given_gguf(cfg)
    if gguf is None:
        return
    if cfg.backend != "engine":
        raise UsageError(f"model.gguf={cfg.model.gguf} is handed to an engine under test; accepted with backend=engine "
                         f"(or backend=llamacpp), not backend={cfg.backend}")
    if not (gguf.endswith(".gguf") and Path(gguf).is_file()):
        raise UsageError(f"model.gguf={cfg.model.gguf!r} is not accepted; accepted: a .gguf file on this host")
    if not (cfg.model.checkpoint and (project_path(cfg.model.checkpoint) / "config.json").is_file()):
        raise UsageError(f"model.gguf={cfg.model.gguf} needs model.checkpoint=DIR, the Hugging Face folder the "
                         "reference reads and the file is judged against (model.checkpoint=FILE.gguf reads a GGUF "
                         "alone)")


def reference_source(cfg: DictConfig) -> str:
    """What the reference reads, for the records: a GGUF read alone is judged against itself."""
    checkpoint = cfg.model.checkpoint
    if not checkpoint:
        return f"the seeded {cfg.model.preset} model"
    if str(checkpoint).endswith(".gguf"):
        return (f"testbed's reading of {project_path(checkpoint)}, the GGUF the engine reads: a field the file lost is "
                "lost on both sides (model.checkpoint=DIR model.gguf=FILE judges the file against its folder)")
    return f"the Hugging Face folder {project_path(checkpoint)} (testbed.models.checkpoints.load_hf_folder)"


def user_artifact(cfg: DictConfig) -> str | None:
    """iree.artifact: a user's prefill_with_past module folder (testbed.backends.iree.user_module)."""
    return cfg.iree.get("artifact") if cfg.backend == "iree" else None


def load_user_module(cfg: DictConfig, model: gemma.GemmaConfig):
    """The user's folder checked against seed 000's contract for `model` (its MLIR compiled for the
    target, once per content): any problem is one UsageError line, before a record is stored."""
    from testbed.backends.iree import user_module
    from testbed.backends.iree.runtime import compile_progress_on_terminal

    return user_module.load(project_path(user_artifact(cfg)), model, cfg.target, compile_progress_on_terminal)


def check_cases_fit(cfg: DictConfig, user) -> None:
    """A user's module has fixed shapes: one call of its C rows per case, against its cache rows."""
    if cfg.chunk != user.chunk:
        raise UsageError(f"chunk={cfg.chunk} but the module in iree.artifact={user_artifact(cfg)} takes "
                         f"C={user.chunk} rows; accepted: chunk={user.chunk}")
    for i, c in enumerate(cases(cfg)):
        if c.past > user.past or c.tokens > user.chunk:
            raise UsageError(f"cases[{i}]={{past: {c.past}, tokens: {c.tokens}}} does not fit the module in "
                             f"iree.artifact={user_artifact(cfg)} (C={user.chunk} rows, {user.past} cache rows); "
                             f"accepted: past <= {user.past}, tokens <= {user.chunk}")


def run_prompt(cfg: DictConfig, model: gemma.GemmaConfig):
    """The run's prompt (testbed.models.prompts): seeded ids, a file, or text through the checkpoint's tokenizer."""
    return load_prompt(str(cfg.model.prompt), prompt_length(cfg), model.vocab, cfg.seed,
                       find_tokenizer(cfg.model.checkpoint), cfg.model.chat)


# --- run -------------------------------------------------------------------------------------------


def _setup(cfg: DictConfig, ctx):
    model, w, weights_sha = load_model(*_model_key(cfg))
    prompt = run_prompt(cfg, model)
    artifacts = {"weights_sha256": weights_sha, **prompt.artifacts()}
    backend = backends.load(cfg.backend, "gemma").backend(w, model, cfg, ctx.device, ctx.progress)
    if cfg.backend == "engine":  # what the engine read, and what the reference read
        artifacts |= {"model_file": str(backend.model_file), "model_format": backend.model_format,
                      "reference": reference_source(cfg)}
    if user_artifact(cfg):  # which module and manifest every verdict and figure is about
        artifacts.update(backend.user.record_artifacts())
    if cfg.backend in ("native", "engine") and cfg.native.weights != "f32":
        # the engine computes with the weights its file stores: refimpl on those is the reference
        w = dequantized(w, cfg.native.weights, cfg.native.group)
    return model, w, prompt.ids, backend, artifacts


def oracle_records(cfg, ctx, model, w, prompt, backend) -> Iterator[Record]:
    ref = Reference(w, model, prompt)
    tokenizer = find_tokenizer(cfg.model.checkpoint)
    if user_artifact(cfg):
        yield from user_module_records(cfg, ctx, ref, backend, tokenizer)
        return
    every = cases(cfg)
    logit_atol, cache_atol, tolerance = atols(cfg)
    for i, case in enumerate(every):
        ctx.progress(f"chunk_prefill oracle {i + 1}/{len(every)} {case.name}")
        params = {"past": case.past, "tokens": case.tokens, "chunk": case.chunk, "position": case.position,
                  "calls": case.calls, "tolerance": tolerance}
        try:
            verdicts = check_token_at_position(backend, ref, case, expected=cfg.model.expected_token,
                                               logit_atol=logit_atol, cache_atol=cache_atol,
                                               token_text=tokenizer.token_text if tokenizer else None)
        except backends.NotSupported as e:  # an engine's refusal: recorded as such, never a pass
            for oracle in ORACLES:
                yield Record("chunk_prefill", f"{case.name}/{oracle}", "oracle", oracle, "not supported", None, {},
                             params=params, detail=str(e), evidence=backend.evidence.take())
            continue
        failing = [v for v in verdicts if not v.passed and v.metrics.get("cache_exposed") is not False]
        if cfg.backend == "engine" and failing:
            ctx.progress(f"chunk_prefill oracle {case.name} failed: asking the engine where")
            where_it_broke(backend, ref, case, failing, logit_atol, cache_atol)
        evidence = backend.evidence.take()
        for v in verdicts:
            unjudged = v.metrics.get("cache_exposed") is False  # an engine that exposes no K/V: not a pass
            yield Record("chunk_prefill", f"{case.name}/{v.oracle}", "oracle", v.oracle,
                         "not supported" if unjudged else v.verdict, v.margin, v.metrics, params=params,
                         detail=v.detail, evidence=evidence)
    # IREE's graphs run the host's masks; the native engine builds its own (the same for every head), so
    # its attention kernel is run with masks that differ per head apart; refimpl is the reference
    if cfg.backend in ("iree", "native"):
        case = cases(cfg)[0]
        ctx.progress(f"chunk_prefill oracle {case.name} with masks that differ per head")
        v = backend.mask_heads(case, cfg.seed) if cfg.backend == "native" else \
            check_mask_heads(backend, ref, case, cfg.logit_atol)
        yield Record("chunk_prefill", f"{case.name}/{v.oracle}", "oracle", v.oracle, v.verdict, v.margin, v.metrics,
                     params={"past": case.past, "tokens": case.tokens, "chunk": case.chunk, "position": case.position,
                             "calls": case.calls}, detail=v.detail, evidence=backend.evidence.take())


def atols(cfg: DictConfig) -> tuple[float, float, str]:
    """(logit_atol, cache_atol, where they come from): the config's, or for an engine under test that declares
    its precision (its yaml's `tolerance.float32`: another engine's kernels sum in other orders) that precision
    for both, unless engine_tolerance=false."""
    if cfg.backend == "engine" and cfg.engine_tolerance:
        from testbed.backends.engine import spec as engine_spec

        spec = engine_spec.load(cfg.get("engine"))
        declared = spec.logits_tolerance("float32")
        if declared is not None:
            measured = f" (measured {spec.tolerance_measured})" if spec.tolerance_measured else ""
            return declared, declared, f"{spec.path.name}: tolerance.float32{measured}"
    return float(cfg.logit_atol), float(cfg.cache_atol), "logit_atol, cache_atol"


def where_it_broke(backend, ref: Reference, case: TokenCase, failing: list, logit_atol: float,
                   cache_atol: float) -> None:
    """An engine's failing case localised (testbed.oracles.where: the first call, row, and cache layer and
    head that differ), and the failing path's request kept for replay (testbed.backends.engine.keep): each
    failing verdict's detail says both, its metrics["where"] holds them."""
    from testbed.oracles.where import locate

    asks = {"chunk": functools.partial(backend.logits_at, ref.prompt, case.past, case.chunk),
            "decode": functools.partial(backend.logits_at, ref.prompt, case.past, 1)}
    final = {path: response.logits[0] for path, (_, response) in backend.last.items()}
    chunked = backend.last["chunk"][1]
    real = case.past + case.tokens
    cache = None if chunked.cache_k is None else ([k[:, :real] for k in chunked.cache_k],
                                                  [v[:, :real] for v in chunked.cache_v])
    where = locate(asks, ref, case, final, cache, logit_atol, cache_atol, ref.cfg.vocab)
    # the path that broke, or where none does (only the padded tail's cache: its pads kept), the padded request
    paths = [f.path for f in where.found if f.call is not None] or \
        ["padded" if any(v.metrics.get("padded_rows_past_real") for v in failing) else "chunk"]
    kept = [k for k in (backend.keep(path, failing[0].detail) for path in paths) if k is not None]
    where.kept = kept[0].said() if kept else ""
    for v in failing:
        v.detail = f"{v.detail}; {where.said()}"
        v.metrics["where"] = {**where.metrics(), "kept": [k.as_dict() for k in kept]}


def user_module_records(cfg, ctx, ref, backend, tokenizer) -> Iterator[Record]:
    """A user's module, one call per case, judged with a diagnosis naming the argument it gets wrong
    (testbed.oracles.module_contract)."""
    from testbed.oracles.module_contract import check_module

    user = backend.user
    every = cases(cfg)
    for i, case in enumerate(every):
        ctx.progress(f"chunk_prefill oracle {i + 1}/{len(every)} {case.name} on {user.source.name}")
        verdicts = check_module(backend.call, ref, case, user.past, user.contract, expected=cfg.model.expected_token,
                                logit_atol=cfg.logit_atol, cache_atol=cfg.cache_atol,
                                token_text=tokenizer.token_text if tokenizer else None)
        params = {"past": case.past, "tokens": case.tokens, "chunk": case.chunk, "position": case.position,
                  "calls": 1, "module_rows": user.past}
        evidence = backend.evidence.take()
        for v in verdicts:
            yield Record("chunk_prefill", f"{case.name}/{v.oracle}", "oracle", v.oracle, v.verdict, v.margin,
                         v.metrics, params=params, detail=v.detail, evidence=evidence)


def user_bench_records(cfg, ctx, model, w, prompt, backend) -> Iterator[Record]:
    """A user's module: its chunk call timed on the device, on the first case's inputs (its cost is that
    of its fixed C rows against its fixed cache rows, whatever P). It has no decode step to set against
    it, so no projected latency."""
    from testbed.models.contract import pack_prefill_with_past
    from testbed.oracles.module_contract import case_inputs

    user, case = backend.user, cases(cfg)[0]
    p = case.past
    ctx.progress(f"chunk_prefill bench P={p} C={user.chunk} on {user.source.name}")
    inp, ks, vs = case_inputs(Reference(w, model, prompt), case, user.past)
    call_time = backend.bench(pack_prefill_with_past(model, inp, ks, vs), cfg.bench.reps, cfg.bench.warmup)
    flops = gemma.graph_flops(model, user.chunk, user.past)
    yield Record("chunk_prefill", f"P={p},C={user.chunk}/chunk_call", "measure",
                 figures={"time": call_time, "gflops": call_time.rate(flops / 1e9, "GFLOP/s"),
                          "rows_per_s": call_time.rate(user.chunk, "rows/s")}, evidence=backend.evidence.take(),
                 work={"flops": flops, "rows": user.chunk, "keys": user.past + user.chunk,
                       "flop_count": "refimpl.gemma.graph_flops at the module's cache rows"},
                 params={"past": p, "chunk": user.chunk, "threads": cfg.threads, "form": "chunk_call",
                         "module_rows": user.past})


def ab_engine_calls(cfg: DictConfig) -> list:
    """`testbed ab engine:A engine:B experiment=chunk_prefill`: one chunk call of C rows after bench.past
    positions, served by each engine through the contract (testbed.backends.engine.gemma.ab_calls)."""
    from testbed.backends.engine.gemma import ab_calls

    model, w, _ = load_model(*_model_key(cfg))
    return ab_calls(w, model, run_prompt(cfg, model).ids, cfg.bench.past, cfg.chunk, cfg.native.weights,
                    cfg.native.group, cfg.threads, cfg.model.checkpoint, given_gguf(cfg))


def projected(n: int, chunk: int, chunk_s: float, decode_s: float, reply: int) -> tuple[float, float]:
    """(chunk path, token-by-token path) seconds for an utterance of n tokens plus a reply."""
    return math.ceil(n / chunk) * chunk_s + reply * decode_s, (n + reply) * decode_s


def bench_records(cfg, ctx, model, w, prompt, backend) -> Iterator[Record]:
    p, c = cfg.bench.past, cfg.chunk
    ctx.progress(f"chunk_prefill bench P={p} C={c}")
    params = {"past": p, "chunk": c, "threads": cfg.threads}
    try:
        times = backend.bench(prompt, p, c, cfg.bench.reps, cfg.bench.warmup)
    except backends.NotSupported as e:  # an engine that refuses to be measured: said as such, never a figure
        yield Record("chunk_prefill", f"P={p},C={c}/bench", "oracle", "bench", "not supported", None, {},
                     params=params | {"form": "chunk_call"}, detail=str(e), evidence=backend.evidence.take())
        return
    evidence = backend.evidence.take()
    for name, rows in (("chunk_call", c), ("decode_step", 1)):
        flops = gemma.graph_flops(model, rows, p)
        counted = {"instructions": times[f"{name}_instructions"]} if f"{name}_instructions" in times else {}
        # the engine process's peak RSS and its export's size, where it has them
        extra = (("peak_rss", f"{name}_peak_rss"), ("export_bytes", "export_bytes"))
        counted |= {figure: times[key] for figure, key in extra if key in times}
        # the CPU time beside the wall time, where the backend's clock gives it (never wall alone for an engine)
        cpu = {"cpu_time": times[f"{name}_cpu"], "gflops_cpu": times[f"{name}_cpu"].rate(flops / 1e9, "GFLOP/s")} \
            if f"{name}_cpu" in times else {}
        yield Record("chunk_prefill", f"P={p},C={c}/{name}", "measure",
                     figures={"time": times[name], "gflops": times[name].rate(flops / 1e9, "GFLOP/s"),
                              "rows_per_s": times[name].rate(rows, "rows/s"), **cpu, **counted}, evidence=evidence,
                     work={"flops": flops, "rows": rows, "keys": p + rows,
                           "flop_count": "refimpl.gemma.graph_flops: projections, attention, MLP, one LM-head row"},
                     params=params | {"form": name})
    chunk_s, decode_s = times["chunk_call"].median, times["decode_step"].median
    for n in cfg.latency.utterance_tokens:
        by_chunk, by_token = projected(n, c, chunk_s, decode_s, cfg.latency.reply_tokens)
        yield Record("chunk_prefill", f"n={n},C={c}/projection", "measure",
                     metrics={"chunk_path_s": by_chunk, "decode_path_s": by_token, "speedup": by_token / by_chunk},
                     work={"chunk_calls": math.ceil(n / c), "reply_tokens": cfg.latency.reply_tokens},
                     params=params | {"form": "projection", "utterance_tokens": n}, evidence=evidence)


def engine_refusal(cfg: DictConfig, ctx) -> Iterator[Record]:
    """backend=engine: what the engine's yaml says it does not serve (chunk_prefill, the device's ABI, the
    weights dtype), recorded "not supported" for every oracle and measurement the run would have made."""
    from testbed.backends.engine import refusals, spec as engine_spec

    why = refusals.why_not(engine_spec.load(cfg.engine), ctx.device, "chunk_prefill", weights=cfg.native.weights)
    if why is None:
        return
    judged = [(f"{c.name}/{o}", o) for c in cases(cfg) for o in ORACLES] if cfg.mode != "bench" else []
    if cfg.mode != "oracle":
        judged.append((f"P={cfg.bench.past},C={cfg.chunk}/bench", "bench"))
    yield from refusals.records("chunk_prefill", judged, why)


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    from threadpoolctl import threadpool_limits

    if cfg.backend == "engine":
        refused = list(engine_refusal(cfg, ctx))
        if refused:
            yield from refused
            return
    with threadpool_limits(limits=cfg.threads):
        model, w, prompt, backend, artifacts = _setup(cfg, ctx)
        bench = user_bench_records if user_artifact(cfg) else bench_records
        parts = [oracle_records] if cfg.mode == "oracle" else [bench] if cfg.mode == "bench" \
            else [oracle_records, bench]
        for part in parts:
            for record in part(cfg, ctx, model, w, prompt, backend):
                record.artifacts = artifacts  # which weights and prompt every verdict and figure is about
                yield record


# --- tables ----------------------------------------------------------------------------------------


def latency_table(chunk_s: dict[int, float], decode_s: float, lengths, weights, reply: int) -> tuple[pd.DataFrame, int]:
    """Projected seconds per utterance length: token by token, and for each C; the last row is the
    expectation over the length distribution. Returns the table and the C of lowest expectation."""
    lengths = list(lengths)
    p = np.asarray(weights if weights is not None else [1.0] * len(lengths), float)
    p = p / p.sum()
    rows = []
    for n in lengths:
        row = {"utterance tokens": str(n), "token by token s": projected(n, 1, 0.0, decode_s, reply)[1]}
        for c, t in sorted(chunk_s.items()):
            row[f"C={c} s"] = projected(n, c, t, decode_s, reply)[0]
        rows.append(row)
    df = pd.DataFrame(rows)
    expected = {"utterance tokens": "expected"} | {col: float(np.dot(p, df[col])) for col in df.columns[1:]}
    df = pd.concat([df, pd.DataFrame([expected])], ignore_index=True)
    best = min(chunk_s, key=lambda c: expected[f"C={c} s"])
    return df, best


def calls_per_utterance(chunk: int, lengths, weights) -> float:
    """The expected number of chunk calls per utterance over the length distribution."""
    p = np.asarray(weights if weights is not None else [1.0] * len(list(lengths)), float)
    return float(np.dot(p / p.sum(), [math.ceil(n / chunk) for n in lengths]))


def best_chunk(chunk_samples: dict[int, list[float]], decode_s: float, lengths, weights, reply: int,
               by: str = "time") -> dict:
    """The C of lowest expected cost per utterance, with the C not distinguishable from it
    (decisions.best_of over each C's repetitions; the C were timed in separate jobs: unpaired). by
    "time": chunk-call seconds, the reply's decode steps added; by "instructions": the chunk calls'
    counted instructions (the reply costs every C the same)."""
    constant = reply * decode_s if by == "time" else 0.0
    cost = {c: [calls_per_utterance(c, lengths, weights) * x + constant for x in xs]
            for c, xs in sorted(chunk_samples.items())}
    return decisions.best_of(cost, by=by)


def versus_token_by_token(chunk: int, chunk_samples: list[float], decode_samples: list[float], lengths, weights,
                          reply: int, by: str = "time") -> dict:
    """Chunked at C against token by token, over the length distribution (decisions.ratio): per
    repetition the expected utterance's chunk calls and reply against its tokens and reply decoded one
    by one. The chunk call and the decode step ran interleaved in C's job: paired, where both have
    every repetition (else the decode step's median stands for each)."""
    p = np.asarray(weights if weights is not None else [1.0] * len(list(lengths)), float)
    mean_tokens = float(np.dot(p / p.sum(), list(lengths)))
    calls = calls_per_utterance(chunk, lengths, weights)
    x, d = np.asarray(chunk_samples, float), np.asarray(decode_samples, float)
    paired = x.size == d.size
    chunked = calls * x + reply * (d if paired else np.median(d))
    token = (mean_tokens + reply) * (d if paired else np.full(1, np.median(d)))
    return decisions.ratio(chunked, token, f"chunked (C={chunk})", "token by token", paired=paired, by=by)


@dataclasses.dataclass
class ChunkMeasures:
    """One implementation's repetitions per C (each C timed in its own job): the chunk call's, and the
    decode step's of the same job (interleaved with the chunk call: paired), in seconds and, on a
    device that counts, in instructions; an emulated device's seconds decide nothing."""

    time: dict[int, list[float]]
    decode: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    instructions: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    decode_instructions: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    emulated: bool = False


def choices(measured: ChunkMeasures, lengths, weights, reply: int) -> list[dict]:
    """Every decision over one implementation's C, each with its confidence: the best C (the C not
    distinguishable from it; a tie of exact counts names each), and chunked at that C (the best by
    median where undecided; the only C where one was measured) against token by token; by time (never
    on an emulated device) and by instructions where every C was counted. Each: the decision's data,
    `decision` (what is decided), `by`, and for chunked against token by token its `chunk`."""
    found = []
    for by, calls, decode in (("time", measured.time, measured.decode),
                              ("instructions", measured.instructions, measured.decode_instructions)):
        if (by == "time" and measured.emulated) or not calls or not all(calls.values()):
            continue
        chosen = next(iter(calls))
        if len(calls) > 1:
            steps = [float(np.median(v)) for v in decode.values() if v]
            best = best_chunk(calls, float(np.median(steps)) if steps else 0.0, lengths, weights, reply, by=by)
            found.append({"decision": "best C", "by": by, **best})
            chosen = best["best"]
        if decode.get(chosen):
            found.append({"decision": f"C={chosen} vs token by token", "by": by, "chunk": chosen,
                          **versus_token_by_token(chosen, calls[chosen], decode[chosen], lengths, weights, reply, by)})
    return found


def choice_line(decision: dict) -> str:
    """One decision as the terminal prints it: what is decided, by what, and the sentence."""
    return f"{decision['decision']} by {decision['by']}: {decision['says']}"


def render_latency(title: str, measured: ChunkMeasures, lengths, weights, reply: int) -> str:
    """The projected-latency table from each C's median chunk call and decode step, then every
    decision with its confidence (`choices`). An emulated device's times make the table but never a
    decision (testbed.measure.emulation)."""
    chunk_s = {c: float(np.median(xs)) for c, xs in sorted(measured.time.items())}
    steps = [float(np.median(v)) for v in measured.decode.values() if v]
    decode_s = float(np.median(steps)) if steps else 0.0
    df, _ = latency_table(chunk_s, decode_s, lengths, weights, reply)
    lines = [f"{title}: chunk call {', '.join(f'C={c} {tables.number(t)} s' for c, t in chunk_s.items())}; "
             f"decode {tables.number(decode_s)} s/token; reply {reply} tokens",
             tables.markdown(df)]
    if measured.emulated:
        lines.append("no best C by time: the device is emulated (its times are never speed)")
    lines += [choice_line(d) for d in choices(measured, lengths, weights, reply)]
    return "\n".join(lines)


def fixture_file(cfg: DictConfig) -> Path:
    """The seed's CSV, under fixtures_dir (testbed.measure.seed.fixtures_dir)."""
    path = seed.fixtures_dir(cfg.fixtures_dir) / cfg.fixture.file
    if not path.is_file():
        raise UsageError(f"fixture {cfg.fixture.file!r} not found in {path.parent} (config key fixtures_dir)")
    return path


def fixture_chunk_times(path: Path, target: str) -> dict[int, float]:
    df = pd.read_csv(path, comment="#")
    rows = df[(df["target"] == target) & df["chunk_call_s"].notna()]
    if rows.empty:
        known = sorted(df.loc[df["chunk_call_s"].notna(), "target"].unique())
        raise UsageError(f"fixture.target={target!r} has no chunk-call times in {path.name}; accepted: {', '.join(known)}")
    return {int(r.chunk): float(r.chunk_call_s) for r in rows.itertuples()}


def render_fixture(cfg: DictConfig) -> str:
    path = fixture_file(cfg)
    medians = fixture_chunk_times(path, cfg.fixture.target)
    decode = [float(cfg.fixture.decode_s)]
    return render_latency(f"seed 000 figures ({cfg.fixture.target}, {path.name})",
                          ChunkMeasures({c: [t] for c, t in medians.items()}, {c: decode for c in medians}),
                          cfg.latency.utterance_tokens, cfg.latency.weights, cfg.latency.reply_tokens)


def view(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for _, r in df.iterrows():
        base = {"device": r["device"], "backend": r["backend"], "case": r["case"]}
        if r["kind"] == "oracle":
            text = r.get("metrics.token_text")  # where the checkpoint has a tokenizer
            rows.append(base | {"verdict": r["verdict"], "margin": r["margin"], "token": r.get("metrics.token_ref"),
                                **({"token text": text} if pd.notna(text) else {}),
                                "chunk token": r.get("metrics.token_chunk"),
                                "ref top1-top2": r.get("metrics.margin_ref"),
                                "max |diff|": r.get(f"metrics.max_abs_{r['oracle']}_diff"),
                                "K/V NMSE": r.get("metrics.nmse_kv"),
                                "detail": r["detail"]})
        elif r.get("params.form") == "projection":
            rows.append(base | {"chunk path s": r.get("metrics.chunk_path_s"),
                                "token by token s": r.get("metrics.decode_path_s"), "speedup": r.get("metrics.speedup")})
        else:
            rows.append(base | {"ms": r["figures.time.median"] * 1e3, "min ms": r["figures.time.min"] * 1e3,
                                "max ms": r["figures.time.max"] * 1e3, "reps": r["figures.time.reps"],
                                "CPU ms": (r.get("figures.cpu_time.median") or float("nan")) * 1e3,
                                "GFLOP/s": r.get("figures.gflops.median"), "samples": tables.samples(r)})
    return pd.DataFrame(rows)


def sweep_row(df: pd.DataFrame) -> dict:
    """Per job: C, the token verdicts with their worst margin, the worst logit difference, times."""
    row: dict = {"chunk": int(df["params.chunk"].dropna().iloc[0]) if "params.chunk" in df else None}
    oracles = df[df["kind"] == "oracle"]
    if len(oracles):
        tokens = oracles[oracles["oracle"] == "token"]
        row["token verdicts"] = " ".join(f"{c.split('/')[0]}:{v}" for c, v in zip(tokens["case"], tokens["verdict"]))
        row["oracles"] = Tally(oracles["verdict"]).phrase()
        row["token margin"] = float(pd.to_numeric(tokens["margin"], errors="coerce").min())
        # a job whose every verdict is a refusal has no reference margins
        row["ref top1-top2"] = float(pd.to_numeric(tokens["metrics.margin_ref"]).min()) \
            if "metrics.margin_ref" in tokens else None
        diffs = pd.to_numeric(oracles.get("metrics.max_abs_logits_diff"), errors="coerce")
        row["max |dlogit|"] = float(diffs.max())
    for form in ("chunk_call", "decode_step"):
        m = df[(df.get("params.form") == form) & (df["kind"] == "measure")] if "params.form" in df else df.iloc[:0]
        if len(m):
            row[f"{form} s"] = float(m["figures.time.median"].iloc[0])
            # the repetitions, for the decisions' confidence (programs only): the chunk call's by figure
            # ("time", "instructions"), the decode step's as "decode time", "decode instructions"
            prefix = "" if form == "chunk_call" else "decode "
            row["samples"] = row.get("samples", {}) | {prefix + k: v for k, v in tables.samples(m.iloc[0]).items()}
    if "emulated" in df and df["emulated"].fillna(False).astype(bool).any():
        row["emulated"] = True  # its times are never a decision (testbed.measure.emulation)
    return row


def _repetitions(row: pd.Series, figure: str) -> list[float]:
    """A sweep row's repetitions of `figure` (sweep_row's samples); [] where it has none."""
    found = row.get("samples")
    return list(found.get(figure) or []) if isinstance(found, dict) else []


def sweep_footer(rows: pd.DataFrame, jobs) -> str:
    """One latency table per (backend, device, model) of the sweep with its decisions, then the seed's
    figures."""
    groups: dict[tuple, list[dict]] = {}
    for (_, row), rc in zip(rows.iterrows(), jobs):
        if pd.notna(row.get("chunk_call s")) and pd.notna(row.get("decode_step s")):
            backend = f"engine:{rc.cfg.engine}" if rc.cfg.backend == "engine" else rc.cfg.backend  # one per engine
            key = (backend, rc.device, rc.cfg.model.checkpoint or rc.cfg.model.preset)
            groups.setdefault(key, []).append(row)
    cfg = jobs[0].cfg
    parts = []
    for (backend, device, model), measured in groups.items():
        def each(figure: str, median: str | None = None) -> dict[int, list[float]]:
            return {int(r["chunk"]): _repetitions(r, figure) or ([float(r[median])] if median else [])
                    for r in measured}

        counted = each("instructions")
        measures = ChunkMeasures(each("time", "chunk_call s"), each("decode time", "decode_step s"),
                                 counted if all(counted.values()) else {},
                                 each("decode instructions") if all(counted.values()) else {},
                                 emulated=any(r.get("emulated") is True for r in measured))
        parts.append(render_latency(f"projected utterance latency, {model} on {backend} / {device} (measured)",
                                    measures, cfg.latency.utterance_tokens, cfg.latency.weights,
                                    cfg.latency.reply_tokens))
    parts.append(render_fixture(cfg))
    return "\n\n".join(parts)


def measured_chunks(df: pd.DataFrame) -> list[tuple[str, ChunkMeasures, dict]]:
    """From stored records (a flattened frame: store.frame, or the report's records), per
    implementation (device, backend, model: testbed.report.implementations), bench past and threads,
    the latest chunk-call and decode-step repetitions of each C, with the run's latency settings
    (lengths, weights, reply) and its device: [(label, ChunkMeasures, settings)]."""
    if df.empty or "params.form" not in df:
        return []
    m = df[(df["kind"] == "measure") & df["params.form"].isin(["chunk_call", "decode_step"])]
    if "time" in m:
        m = m.sort_values("time", kind="stable")
    config_columns = [c for c in m.columns if c.startswith("config.")]
    groups: dict[tuple, dict] = {}
    for _, r in m.iterrows():
        config = {c[len("config."):]: v for c in config_columns if _present(v := r[c])}
        impl = implementations.of({"config": config, "device": r["device"], "backend": r["backend"]})
        key = (impl.label, _whole(config.get("bench.past")), _whole(config.get("threads", 1)))
        group = groups.setdefault(key, {"rows": {}, "config": config})
        group["rows"][int(r["params.chunk"]), r["params.form"]] = r  # the latest record of each C and form
        group["config"] = config
    found = []
    for (label, past, threads), group in groups.items():
        rows, config = group["rows"], group["config"]

        def each(form: str, figure: str) -> dict[int, list[float]]:
            out = {}
            for (chunk, f), r in rows.items():
                if f == form and _present(r.get(f"figures.{figure}.median")):
                    scale = TIME_SCALE.get(r.get(f"figures.{figure}.unit"), 1.0)
                    reps = r.get(f"figures.{figure}.samples")
                    values = list(reps) if isinstance(reps, list) and reps else [r[f"figures.{figure}.median"]]
                    out[chunk] = [float(v) * scale for v in values]
            return out

        counted = each("chunk_call", "instructions")
        measures = ChunkMeasures(each("chunk_call", "time"), each("decode_step", "time"), counted,
                                 each("decode_step", "instructions"),
                                 emulated=any(_present(r.get("emulated")) and bool(r.get("emulated"))
                                              for r in rows.values()))
        settings = {"lengths": list(config.get("latency.utterance_tokens") or []),
                    "weights": config.get("latency.weights"), "reply": int(config.get("latency.reply_tokens") or 0),
                    "device": next(iter(rows.values()))["device"]}
        setting = ", ".join([*([f"past {past}"] if past is not None else []),
                             *([f"{threads} threads"] if threads not in (None, 1) else [])])
        found.append((f"{label}, {setting}" if setting else label, measures, settings))
    return found


TIME_SCALE = {"s": 1.0, "ms": 1e-3, "us": 1e-6}  # a time figure's unit in seconds


def _whole(value):
    """A count from a frame (where a missing value elsewhere made it float): an int, or None."""
    return int(value) if value is not None and _present(value) else None


def _present(value) -> bool:
    """A frame cell that holds something (not a missing value)."""
    return isinstance(value, (list, dict)) or not pd.isna(value)


def table_choices(df: pd.DataFrame) -> list[dict]:
    """`testbed table chunk_prefill`'s decisions from stored records: per implementation the best C and
    chunked against token by token (`choices`), as data beside the rows (tables.render)."""
    out = []
    for label, measures, settings in measured_chunks(df):
        if not settings["lengths"]:
            continue
        for d in choices(measures, settings["lengths"], settings["weights"], settings["reply"]):
            out.append(decisions.as_choice(d, label))
    return out
# --- the engines table: every engine under test side by side ----------------------------------------

ENGINE = "engine:"


def _headline(tally: Tally) -> str:
    """One verdict for an engine and technique (testbed.verdicts): fail where any oracle failed or erred,
    else pass where any passed, else the refusal (not supported) or not judged."""
    if tally.failed:
        return verdicts.FAIL
    for state in (verdicts.PASS, verdicts.NOT_SUPPORTED, verdicts.NOT_JUDGED):
        if tally[state]:
            return state
    return ""


def _evidence_max(group: pd.DataFrame, key: str) -> float | None:
    """The largest `key` any run of the group states in its evidence (every engine request says its peak
    RSS and, exporter-based, its export's size)."""
    found = [d.get(key) for ev in group.get("evidence", pd.Series(dtype=object)) if isinstance(ev, list)
             for e in ev if isinstance(e, dict) for d in [e.get("detail") or {}]]
    numbers = [float(v) for v in found if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return max(numbers) if numbers else None


def _at(row: pd.Series, figure: str) -> tuple[float | None, tuple[float, float] | None]:
    """A figure's median and the 95% interval of its median (decisions.median_interval) in one record."""
    median = row.get(f"figures.{figure}.median")
    if median is None or pd.isna(median):
        return None, None
    found = row.get(f"figures.{figure}.samples")
    return float(median), decisions.median_interval(found) if isinstance(found, list) else None


def engines(df: pd.DataFrame) -> pd.DataFrame:
    """The engines under test side by side (records of chunk_prefill and tail with backend=engine:NAME):
    one row per engine, technique, device and model. Its verdict (testbed.verdicts: fail, pass, not
    supported with the engine's reason, not judged) over every oracle of the technique; for chunk_prefill's
    bench, the best C by the projected utterance latency with its confidence (best_chunk: unpaired
    bootstrap over each C's repetitions; an emulated device's times decide nothing) and, at that C, the
    chunk call's prefill tokens/s and CPU time, each its median with the 95% interval of the median; the
    largest peak RSS of the engine process any of its requests had (VmHWM) and its export's size on disk
    (exporter-based engines)."""
    if df.empty or "backend" not in df:
        return pd.DataFrame()
    df = df[df["backend"].astype(str).str.startswith(ENGINE)]
    if df.empty:
        return pd.DataFrame()
    settings = [c for c in df.columns if c.startswith("config.")]
    df = df.assign(_model=[implementations.model_of({k[len("config."):]: v for k, v in zip(settings, values)
                                                     if not (isinstance(v, float) and math.isnan(v))})
                            for values in df[settings].itertuples(index=False)])
    # the newest run of each configuration (its C and mode): an older run's verdicts are history
    config = [c for c in ("backend", "experiment", "device", "_model", "config.chunk", "config.mode") if c in df]
    df = df.sort_values("time", kind="stable")
    df = df[df["run_id"] == df.groupby(config, dropna=False)["run_id"].transform("last")]
    rows = []
    for (engine, technique, device, name), group in df.groupby(["backend", "experiment", "device", "_model"],
                                                                sort=True):
        tally = Tally.of_records(group.to_dict("records"))
        refused = group[(group["kind"] == "oracle") & (group["verdict"] == verdicts.NOT_SUPPORTED)]
        row = {"engine": engine[len(ENGINE):], "technique": technique, "device": device, "model": name,
               "verdict": _headline(tally), "oracles": tally.phrase(),
               "reason": str(refused["detail"].iloc[0]) if len(refused) else ""}
        calls = group[(group["kind"] == "measure") & (group.get("params.form") == "chunk_call")] \
            if "params.form" in group else group.iloc[:0]
        if len(calls):
            calls = calls.sort_values("time").groupby("params.chunk").tail(1)
            by_c = {int(r["params.chunk"]): r for _, r in calls.iterrows()}
            decode = group[group.get("params.form") == "decode_step"]["figures.time.median"]
            first = calls.iloc[0]
            lengths = list(first.get("config.latency.utterance_tokens") or [16, 36, 44, 52])
            weights = first.get("config.latency.weights")
            reply = int(first.get("config.latency.reply_tokens") or 0)
            samples = {c: list(r.get("figures.time.samples") or [r["figures.time.median"]]) for c, r in by_c.items()}
            decode_s = float(decode.median()) if len(decode) else 0.0
            if "emulated" in calls and calls["emulated"].fillna(False).astype(bool).any():
                calls = calls.iloc[:0]  # an emulated device's times are never speed (testbed.measure.emulation)
                row["best C says"] = "none: the device is emulated (its times are never speed)"
        if len(calls):
            decision = best_chunk(samples, decode_s, lengths, weights if isinstance(weights, list) else None, reply)
            best = int(decision["best"])
            rate, rate_ci = _at(by_c[best], "rows_per_s")
            cpu, cpu_ci = _at(by_c[best], "cpu_time")
            row |= {"best C": decisions.label(decision), "best C says": decision["says"], "prefill tok/s": round(rate),
                    "tok/s lo": round(rate_ci[0]) if rate_ci else None,  # whole rows/s: the spread is wider
                    "tok/s hi": round(rate_ci[1]) if rate_ci else None,
                    "CPU ms": cpu * 1e3 if cpu is not None else None,
                    "CPU ms lo": cpu_ci[0] * 1e3 if cpu_ci else None, "CPU ms hi": cpu_ci[1] * 1e3 if cpu_ci else None}
        rss, export = _evidence_max(group, "peak_rss_bytes"), _evidence_max(group, "export_bytes")
        row |= {"peak RSS MB": rss / 1e6 if rss else None, "export MB": export / 1e6 if export else None}
        rows.append(row)
    table = pd.DataFrame(rows)
    # the figures before the words (a terminal keeps the columns that fit from the first): speed with its
    # spread, CPU time, memory, then CPU time's spread
    first = [c for c in ENGINE_COLUMNS if c in table]
    return table[first + [c for c in table.columns if c not in first]]


ENGINE_COLUMNS = ("engine", "technique", "device", "model", "verdict", "best C", "prefill tok/s", "tok/s lo",
                  "tok/s hi", "CPU ms", "peak RSS MB", "export MB", "CPU ms lo", "CPU ms hi", "oracles", "reason",
                  "best C says")


def more_tables(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The tables drawn over a set of runs beside view's (a sweep's, `testbed table`, the report)."""
    found = engines(df)
    return {"engines": found} if len(found) else {}
