"""Experiment `hybrid`: a Qwen3.5-style hybrid model end to end (seed 002 at the model level).

The model is refimpl.qwen35 (GDN layers with their conv and recurrent states, gated full attention
with its KV cache): seeded weights of the `shape` config, or a Hugging Face Qwen3.5 checkpoint folder
(`model.checkpoint=DIR`, testbed.models.hybrid_checkpoints: every config field honoured or refused) with a
prompt of ids or text through its own tokenizer (`model.prompt=`, testbed.models.prompts).

Backends: refimpl (numpy, on the host only) and native: the hybrid engine in C (kernels/tb_hybrid.h,
program tb_hybrid_bench) built for the device's ABI and run ON the device the run names (the host
included), the states staying there between calls and pulled for the oracles; every record of such a
run carries the device's evidence. Each in its serial and chunkwise GDN forms. And engine: an engine
under test through engine contract v1 (`backend=engine engine=llamacpp`: libllama through
tb_llama_engine, given the GGUF testbed writes of the same model, `model.gguf=auto`, or a file;
`engine=testbed-c`: tb_hybrid.h from the safetensors file backend=native reads), in
mode=oracle (engine_oracle_records): its token at every call boundary and its logits against the
float64 model; the first token for each C of oracle.chunks (chunk_invariance: the recurrent state
carried over other call boundaries); and the padded tail rolled back (state_bytes against the
unpadded tail), with the engine's default memory and with a recurrent-state snapshot per pad row asked
for (rs_snapshots: llama.cpp's n_rs_seq, at most C - 2), an engine's refusal recorded "not supported"
in its own words.

oracle     per GDN form and case (P past tokens, then n <= C in one call padded to C rows) against
           redecode of the P + n tokens (all positions from scratch, serial GDN): the token (native:
           at every chunk boundary, the past's calls included), every carried state by NMSE, and the
           last logits against the float64 model written out independently (refimpl.naive_qwen35:
           NMSE and token). Token verdicts follow the tie rule (logit_atol: a token within it of the
           reference's best passes, said to be a tie); `model.expected_token` pins the token at the
           last position the cases reach. Padded tail (prompts of C + t): first token and state
           against the scalar tail; native also `tail_bytes`: the padded tail's state byte for byte
           and its logits equal to the same tail run unpadded. refimpl also pad identity on the GDN op.
crossover  prefill rate of a prompt of L tokens (bench.prefill_chunk rows per call) for each L of
           bench.contexts: the dense model (every layer full attention, same width and depth), the
           dense model of similar size (seed 002's comparison: as deep as brings its weights to the
           hybrid's), the hybrid with serial GDN, with chunkwise GDN, and with no recurrence at all
           (the GDN's share of the time, hence the most a faster GDN can gain), all interleaved.
           Rates: tokens per CPU second; on an emulated device tokens per 1e9 instructions counted
           under emulation (testbed.measure.counts), labelled so, never as time. The crossover context is
           where the hybrid overtakes a dense model, from a fit of cost per token = a + b L (the
           seed's ~24-28k is such an extrapolation from 512..8k). L = 512 gives pp512 serial vs
           chunkwise (the seed's 93 -> 150 goal is 1.6x). On the `bench.shape` model.
tail       padded vs scalar tail (prompt = chunk + t for each t of bench.tails), interleaved:
           does padding pay now that the state allows it, and from which tail (breakeven).
drift      the chunkwise GDN's products in fp16 with f32 or fp16 accumulation (an NPU matrix unit)
           against f32 (native: tb_gdn_chunkwise_precision in the engine, on the device): NMSE of
           the logits at every position and of the final recurrent states, and the share of
           positions whose argmax agrees, over prompts of bench.drift_tokens. On the checkpoint if
           one is given, else on the `bench.shape` model.
bench      crossover + tail + drift; all = oracle + bench.

Timings alternate between the variants and are taken on both clocks; the tables read the CPU-time
rates, since this host is shared and its wall times swing with other load. The native programs flush
denormals (FTZ/DAZ) on every target; numpy does not (refimpl's rows say so).

`testbed sweep experiment=hybrid mode=crossover gdn_chunk=16,32,64,128` sweeps the GDN chunk;
`... bench.contexts=512,2048,8192` sweeps the context (the crossover then appears under the sweep).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from refimpl import gdn, naive_qwen35, qwen35
from testbed.config import Choice, Float, Int, IntList, as_list, project_path
from testbed.errors import UsageError
from testbed.heartbeat import Step, Tick
from testbed.measure import breakeven, decisions
from testbed.oracles.hybrid import (check_chunk_with_past, check_engine_case, check_engine_tail, check_pad_identity,
                                    check_padded_tail)
from testbed.measure.timing import interleaved_order, time_alternating_clocks
from testbed.models.prompts import find_tokenizer, load_prompt
from testbed.oracles.numerical import digest, nmse
from testbed.results import Figure, Record
from testbed.verdicts import Tally

MODES = ("oracle", "crossover", "tail", "drift", "bench", "all")
PARTS = {"oracle": ("oracle",), "crossover": ("crossover",), "tail": ("tail",), "drift": ("drift",),
         "bench": ("crossover", "tail", "drift"), "all": ("oracle", "crossover", "tail", "drift")}
MODELS = ("dense", "dense-similar", "hybrid-serial", "hybrid-chunkwise", "hybrid-no-recurrence")
DENSE = ("dense", "dense-similar")
# The seed's figures (26/05, phone NPU, Qwen3.5 hybrid vs a dense model): prefill tokens/s.
SEED = {"hybrid": {512: 93, 2048: 97, 8192: 91}, "dense": {512: 285, 8192: 182}, "crossover": "~24-28k",
        "pp512_goal": 150 / 93}
PRECISIONS = ("fp16-acc32", "fp16-acc16")

SHAPE_KEYS = ("vocab", "hidden", "layers", "mlp", "heads", "kv_heads", "head_dim", "linear_k_heads",
              "linear_v_heads", "linear_head_dim", "conv_kernel")
PARAMS = {
    "backend": Choice(("refimpl", "native", "engine")),
    "mode": Choice(MODES),
    "chunk": Int(1, 4096),
    "gdn_chunk": Int(1, 4096),
    "threads": Int(1, 256),
    "counts": Choice((False, True)),
    "fused": Choice((False, True)),
    "threshold": Float(0.0, 1.0),
    "logit_atol": Float(0.0),
    "seed": Int(0),
    "model.chat": Choice((False, True)),
    **{f"shape.{k}": Int(1) for k in SHAPE_KEYS},
    **{f"bench.shape.{k}": Int(1) for k in SHAPE_KEYS},
    "oracle.prompt_tokens": Int(2, 1 << 16),
    "oracle.past": IntList(0, 1 << 16),
    "oracle.tokens": IntList(1, 4096),
    "oracle.tails": IntList(1, 4095),
    "oracle.chunks": IntList(1, 4096),
    "bench.contexts": IntList(1, 1 << 17),
    "bench.prefill_chunk": Int(1, 1 << 16),
    "bench.tails": IntList(0, 4095),
    "bench.drift_tokens": IntList(1, 1 << 16),
    "bench.reps": Int(1, 1000),
    "bench.warmup": Int(0, 100),
}


# --- configuration -------------------------------------------------------------------------------


def model_config(shape: DictConfig) -> qwen35.HybridConfig:
    try:
        return qwen35.HybridConfig(**{k: int(shape[k]) for k in SHAPE_KEYS})
    except ValueError as e:
        raise UsageError(f"shape: {e}") from None


@functools.lru_cache(maxsize=2)
def load_model(checkpoint: str | None, shape: tuple, seed: int):
    """(config, weights, weights digest): a Hugging Face Qwen3.5 folder, or the shape with seeded weights
    (kept for the next job of a sweep)."""
    if checkpoint:
        from testbed.models.hybrid_checkpoints import load_checkpoint

        model, w = load_checkpoint(checkpoint)  # a Hugging Face folder, or a qwen35 GGUF
    else:
        model = qwen35.HybridConfig(**dict(shape))
        w = qwen35.init_weights(model, seed)
    return model, w, digest(*(w[name] for name in sorted(w)))


def oracle_model(cfg: DictConfig):
    """The oracles' model: the checkpoint (a Hugging Face folder: never the GGUF an engine is handed beside it),
    or (backend=engine) the GGUF given alone, or `shape` with weights from `seed`."""
    given = cfg.model.checkpoint or (given_gguf(cfg) if cfg.backend == "engine" else None)
    checkpoint = str(project_path(given)) if given else None
    if checkpoint is None:
        model_config(cfg.shape)  # its one-line refusals
    return load_model(checkpoint, tuple((k, int(cfg.shape[k])) for k in SHAPE_KEYS), cfg.seed)


def given_gguf(cfg: DictConfig) -> str | None:
    """model.gguf when it names a file (not auto)."""
    given = OmegaConf.select(cfg, "model.gguf", default="auto")
    return None if given in (None, "auto") else str(given)


def engine_model(cfg: DictConfig, model: qwen35.HybridConfig, w: dict):
    """The model as engines are handed it (testbed.backends.engine.models): the checkpoint and the GGUF given,
    or what testbed writes of the oracles' model in the format each engine reads."""
    from testbed.backends.engine.models import HybridModel

    given = given_gguf(cfg)
    checkpoint = str(project_path(cfg.model.checkpoint)) if cfg.model.checkpoint else None
    return HybridModel(model, w, checkpoint, str(project_path(given)) if given else None)


def reference_source(cfg: DictConfig) -> str:
    """Where the oracles' model comes from, for the records: a GGUF read alone is judged against itself."""
    if cfg.model.checkpoint:
        return f"the checkpoint {project_path(cfg.model.checkpoint)} as testbed reads it"
    if given_gguf(cfg):
        return (f"testbed's reading of {given_gguf(cfg)}, the GGUF the engine reads: a field the file lost is lost on "
                "both sides (model.checkpoint=DIR judges the file against its folder)")
    return "the seeded `shape`"


def cases(cfg: DictConfig) -> list[tuple[int, int]]:
    return list(zip(as_list(cfg.oracle.past), as_list(cfg.oracle.tokens)))


def prompt_needs(cfg: DictConfig) -> int:
    """Tokens the oracles read: every case's P + n, every tail prompt's C + t."""
    needs = [p + n for p, n in cases(cfg)] + [cfg.chunk + t for t in as_list(cfg.oracle.tails)]
    return max(needs)


def run_prompt(cfg: DictConfig, vocab: int):
    """The oracles' prompt (testbed.models.prompts): `seed` draws oracle.prompt_tokens ids; a file or text (through
    the checkpoint's tokenizer) gives its own, of which the cases need prompt_needs."""
    length = cfg.oracle.prompt_tokens if str(cfg.model.prompt) == "seed" else prompt_needs(cfg)
    return load_prompt(str(cfg.model.prompt), length, vocab, cfg.seed, find_tokenizer(cfg.model.checkpoint),
                       cfg.model.chat)


def last_position(cfg: DictConfig) -> int:
    """The last position the oracle's cases reach: where model.expected_token is the reference's token."""
    return max(p + n for p, n in cases(cfg)) - 1


def validate(cfg: DictConfig) -> None:
    """What the mode runs must fit: oracle cases n within one chunk and P + n within the prompt, tails
    shorter than a chunk; the checkpoint, prompt and expected token must be usable. (The backend against
    the device: testbed.backends.refuse_mismatch, refimpl on the host only.)"""
    if cfg.counts and cfg.backend != "native":
        raise UsageError(f"counts=true counts the native engine's instructions; backend={cfg.backend} runs no native "
                         "program (accepted: counts=true with backend=native)")
    parts = PARTS[cfg.mode]
    if cfg.backend == "engine":
        validate_engine(cfg)
    tails = []
    if cfg.fused and cfg.backend != "native":
        raise UsageError(f"fused=true chooses the native programs' FMA build; backend={cfg.backend} has none; "
                         "accepted: fused=true with backend=native, or fused=false")
    if "oracle" in parts:
        past, tokens = as_list(cfg.oracle.past), as_list(cfg.oracle.tokens)
        if len(past) != len(tokens):
            raise UsageError(f"oracle.past has {len(past)} entries and oracle.tokens {len(tokens)}; "
                             f"accepted: one n per P")
        seeded = str(cfg.model.prompt) == "seed"
        for p, n in zip(past, tokens):
            if n > cfg.chunk or (seeded and p + n > cfg.oracle.prompt_tokens):
                raise UsageError(f"oracle case P={p}, n={n} does not fit chunk={cfg.chunk} and oracle.prompt_tokens="
                                 f"{cfg.oracle.prompt_tokens}; accepted: n <= chunk, P + n <= prompt")
        tails += as_list(cfg.oracle.tails)
        if seeded and cfg.chunk + max(as_list(cfg.oracle.tails)) > cfg.oracle.prompt_tokens:
            raise UsageError(f"oracle.tails={as_list(cfg.oracle.tails)} need prompts of chunk={cfg.chunk} + tail tokens, "
                             f"oracle.prompt_tokens={cfg.oracle.prompt_tokens}; accepted: chunk + tail <= prompt")
    if "tail" in parts:
        tails += as_list(cfg.bench.tails)
    bad = [t for t in tails if t >= cfg.chunk]
    if bad:
        raise UsageError(f"tail {bad[0]} is not shorter than chunk={cfg.chunk}; accepted: tails 0..{cfg.chunk - 1}")
    if {"crossover", "tail"} & set(parts) or ("drift" in parts and not cfg.model.checkpoint):
        model_config(cfg.bench.shape)
    expected = cfg.model.expected_token
    if not cfg.model.checkpoint and str(cfg.model.prompt) == "seed" and expected is None:
        if "oracle" in parts:
            model_config(cfg.shape)
        return  # nothing to load before running
    model, _, _ = oracle_model(cfg)
    if expected is not None:
        if isinstance(expected, bool) or not isinstance(expected, int) or not 0 <= expected < model.vocab:
            raise UsageError(f"model.expected_token={expected!r} is not accepted; accepted: null or 0..{model.vocab - 1}")
        if "oracle" not in parts:
            raise UsageError(f"model.expected_token={expected} pins the oracles' token and mode={cfg.mode} runs no "
                             f"oracle; accepted: mode=oracle or all")
    if "oracle" in parts:
        run_prompt(cfg, model.vocab)


def validate_engine(cfg: DictConfig) -> None:
    """backend=engine runs the oracles (the engine's own measurements are the contract's bench, not these
    modes), with a GGUF file where one is named. (An engine whose yaml does not serve the hybrid is recorded
    "not supported" by run.)"""
    from testbed.backends.engine import spec as engine_spec

    if cfg.mode != "oracle":
        raise UsageError(f"mode={cfg.mode} is not run for backend=engine; accepted: mode=oracle (backend=refimpl or "
                         f"native run crossover, tail and drift)")
    engine_spec.load(OmegaConf.select(cfg, "engine", default=None))  # names what is wrong with the yaml
    given = given_gguf(cfg)
    if given and not (project_path(given).is_file() and given.endswith(".gguf")):
        raise UsageError(f"model.gguf={given!r} is not accepted; accepted: auto, or a qwen35 .gguf file on this host")
    if given:  # its header and tensor table now, so a file testbed's reader refuses stores no run
        from testbed.models.gguf_files import gguf_for

        gguf_for(project_path(given))
    if given and cfg.model.checkpoint and not (project_path(cfg.model.checkpoint) / "config.json").is_file():
        raise UsageError(f"model.gguf={given!r} with model.checkpoint={cfg.model.checkpoint!r}: the oracles read the "
                         "checkpoint; accepted: a Hugging Face folder beside a GGUF (the GGUF alone is read itself)")


def artifacts(cfg: DictConfig) -> dict:
    """What computed the records (the program's sha256 and build are in each record's evidence)."""
    if cfg.backend == "engine":
        return {"engine": str(OmegaConf.select(cfg, "engine", default=""))}
    if cfg.backend == "native":
        from testbed.backends.native import hybrid as engine

        return {"program": engine.PROGRAM}
    return {"engine": "refimpl.qwen35 (numpy)"}


# --- oracle ------------------------------------------------------------------------------------------


def gdn_forms(cfg: DictConfig) -> dict[str, qwen35.GDNFn]:
    """refimpl's serial and chunkwise GDN, as the numpy model calls them."""
    return {"serial": qwen35.gdn_form("serial"), "chunkwise": qwen35.gdn_form("chunkwise", cfg.gdn_chunk)}


def oracle_records(cfg: DictConfig, ctx) -> Iterator[Record]:
    if cfg.backend == "engine":
        yield from engine_oracle_records(cfg, ctx)
        return
    model, w, weights_sha = oracle_model(cfg)
    prompt = run_prompt(cfg, model.vocab)
    ids = prompt.ids
    arts = {"weights_sha256": weights_sha, **prompt.artifacts(),
            **({"checkpoint": str(project_path(cfg.model.checkpoint))} if cfg.model.checkpoint else {})}
    tokenizer = find_tokenizer(cfg.model.checkpoint)
    token_text = tokenizer.token_text if tokenizer else None
    end = last_position(cfg)

    def record(case, v, params, evidence=()):
        return Record("hybrid", case, "oracle", v.oracle, v.verdict, v.margin, v.metrics, params=params,
                      artifacts=arts, detail=v.detail, evidence=list(evidence))

    native = cfg.backend == "native"
    references: dict[int, tuple] = {}  # redecode and the naive model per P + n, shared by the forms
    forms = gdn_forms(cfg)
    steps, step = len(forms) * (len(cases(cfg)) + len(as_list(cfg.oracle.tails))), 0
    for form, fn in forms.items():
        base = {"gdn": form, "gdn_chunk": cfg.gdn_chunk if form == "chunkwise" else None, "chunk": cfg.chunk,
                **({"fused": bool(cfg.fused)} if native else {})}
        for p, n in cases(cfg):
            step += 1
            ctx.progress(f"hybrid oracle {step}/{steps} {form} P={p} n={n}")
            expected = cfg.model.expected_token if p + n - 1 == end else None
            params = base | {"past": p, "tokens": n, "position": p + n - 1}
            if native:
                from testbed.backends.native import hybrid as engine

                run = engine.prefill(ctx.device, model, w, ids, past=p, tokens=n, chunk=cfg.chunk, tail="padded",
                                     gdn=form, gdn_chunk=cfg.gdn_chunk, threads=cfg.threads,
                                     fused=bool(cfg.fused))
                if p + n not in references:
                    references[p + n] = (qwen35.redecode(w, model, ids[:p + n]), naive_qwen35.logits(w, model, ids[:p + n]))
                verdicts = check_engine_case(w, model, ids, p, n, run, cfg.threshold, cfg.logit_atol, expected,
                                             token_text, *references[p + n])
                evidence = [run.evidence.as_dict()]
            else:
                verdicts = check_chunk_with_past(w, model, ids, p, n, cfg.chunk, fn, cfg.threshold, cfg.logit_atol,
                                                 expected)
                evidence = []
            for v in verdicts:
                yield record(f"P={p},n={n},C={cfg.chunk}/{form}", v, params, evidence)
        for t in as_list(cfg.oracle.tails):
            length = cfg.chunk + t
            step += 1
            ctx.progress(f"hybrid oracle {step}/{steps} {form} padded tail N={length}")
            params = base | {"prompt_tokens": length, "tail": t}
            if native:
                from testbed.backends.native import hybrid as engine

                runs = {tail: engine.prefill(ctx.device, model, w, ids, past=0, tokens=length, chunk=cfg.chunk,
                                             tail=tail, gdn=form, gdn_chunk=cfg.gdn_chunk, threads=cfg.threads,
                                             fused=bool(cfg.fused))
                        for tail in ("padded", "exact", "scalar")}
                verdicts = check_engine_tail(runs["padded"], runs["exact"], runs["scalar"], cfg.threshold,
                                             cfg.logit_atol)
                evidence = [r.evidence.as_dict() for r in runs.values()]
            else:
                verdicts = check_padded_tail(w, model, ids[:length], cfg.chunk, fn, cfg.threshold, cfg.logit_atol)
                evidence = []
            for v in verdicts:
                yield record(f"N={length},tail={t},C={cfg.chunk}/{form}", v, params, evidence)
        # numpy's chunkwise products reblock with the row count, so only its serial form is bit-exact; the
        # engine's pads are judged whole, state and logits byte for byte (tail_bytes above)
        if not native and form == "serial":
            x = gdn.draw_inputs(1, 37, model.linear_k_heads, model.linear_head_dim,
                                v_repeat=model.linear_v_heads // model.linear_k_heads, gate="mild", seed=cfg.seed)
            yield record(f"pads=27/{form}", check_pad_identity(x, 27, fn), base | {"pads": 27})


def engine_oracle_records(cfg: DictConfig, ctx) -> Iterator[Record]:
    """An engine under test (engine contract v1) on the oracles' model in its format: per case its token at every
    call boundary and its logits against the float64 model; the first token across oracle.chunks; the
    padded tail rolled back against the unpadded one, byte for byte, or the engine's refusal."""
    from testbed.backends.engine import hybrid as engine, spec as engine_spec
    from testbed.oracles.engine import check_state_bytes
    from testbed.oracles.hybrid import check_boundaries, check_chunk_invariance, check_naive, check_token

    model, w, weights_sha = oracle_model(cfg)
    spec = engine_spec.load(cfg.engine)
    program = engine.program(ctx.device, spec)
    handed = engine_model(cfg, model, w).file_for(spec)
    prompt = run_prompt(cfg, model.vocab)
    ids = prompt.ids
    arts = {"weights_sha256": weights_sha, "model_file": str(handed[0]), "model_format": handed[1],
            "engine": spec.name, "reference": reference_source(cfg), **prompt.artifacts(),
            **({"checkpoint": str(project_path(cfg.model.checkpoint))} if cfg.model.checkpoint else {})}
    tokenizer = find_tokenizer(cfg.model.checkpoint)
    end = last_position(cfg)

    def run(tokens, past, chunk, logits_at, tail="none", state=False, rs_snapshots=0):
        return engine.prefill(ctx.device, spec, program, handed, model, tokens, past, chunk, logits_at, tail, state,
                              cfg.threads, rs_snapshots)

    def record(case, oracle, response_or_verdict, params, evidence):
        v = response_or_verdict
        if getattr(v, "refused", False):  # the engine's refusal, in its words: never a pass
            return Record("hybrid", f"{case}/{oracle}", "oracle", oracle, "not supported", None, {}, params=params,
                          artifacts=arts, detail=f"engine {spec.name} refused: {v.reason}", evidence=evidence)
        return Record("hybrid", f"{case}/{v.oracle}", "oracle", v.oracle, v.verdict, v.margin, v.metrics,
                      params=params, artifacts=arts, detail=v.detail, evidence=evidence)

    base = {"engine": spec.name, "chunk": cfg.chunk}
    for p, n in cases(cfg):
        ctx.progress(f"hybrid oracle engine={spec.name} P={p} n={n} C={cfg.chunk}")
        ends = engine.call_ends(p, p + n, cfg.chunk)
        response = run(ids[:p + n], p, cfg.chunk, ends)
        params, name = base | {"past": p, "tokens": n, "position": p + n - 1}, f"P={p},n={n},C={cfg.chunk}/engine"
        evidence = [response.evidence.as_dict()] if response.evidence else []
        if response.refused:
            yield record(name, "token", response, params, evidence)
            continue
        reference = qwen35.redecode(w, model, ids[:p + n])[0]
        expected = cfg.model.expected_token if p + n - 1 == end else None
        yield record(name, "token", check_boundaries(reference, response.logits, ends, cfg.logit_atol, expected,
                                                     tokenizer.token_text if tokenizer else None), params, evidence)
        yield record(name, "naive", check_naive(naive_qwen35.logits(w, model, ids[:p + n]), response.logits[-1],
                                                cfg.threshold, cfg.logit_atol), params, evidence)
    length = max(p + n for p, n in cases(cfg))
    chunks = as_list(cfg.oracle.chunks)
    ctx.progress(f"hybrid oracle engine={spec.name}: {length} tokens in calls of C = {chunks}")
    responses = {c: run(ids[:length], 0, c, [length - 1]) for c in chunks}
    evidence = [r.evidence.as_dict() for r in responses.values() if r.evidence]
    params = base | {"prompt_tokens": length, "chunks": chunks}
    name = f"N={length},C={'|'.join(map(str, chunks))}/engine"
    refused = next((r for r in responses.values() if r.refused), None)
    by_chunk = {c: r.logits[0] for c, r in responses.items()} if refused is None else {}
    yield record(name, "chunk_invariance", refused or check_chunk_invariance(
        qwen35.redecode(w, model, ids[:length])[0][-1], by_chunk, cfg.logit_atol), params, evidence)
    # the padded tail rolled back: with the engine's default memory (llama.cpp keeps no recurrent snapshot and
    # refuses), and asking it to keep as many recurrent snapshots as there are pad rows (llama.cpp's n_rs_seq),
    # at most C - 2: llama.cpp keeps the last n_rs_seq + 1 rows in one ubatch of C rows and aborts
    # (GGML_ASSERT(n_ubatch > n_keep_tail)) beyond that, so a tail of one token (C - 1 pads) stays refused
    for t in as_list(cfg.oracle.tails):
        length = cfg.chunk + t
        reference = None
        for snapshots in sorted({0, max(0, min(cfg.chunk - t, cfg.chunk - 2))}):
            ctx.progress(f"hybrid oracle engine={spec.name}: padded tail N={length} rolled back, "
                         f"{snapshots} recurrent snapshots")
            params = base | {"prompt_tokens": length, "tail": t, "rs_snapshots": snapshots}
            name = f"N={length},tail={t},C={cfg.chunk},rs={snapshots}/engine"
            padded = run(ids[:length], 0, cfg.chunk, [length - 1], "padded", True, snapshots)
            if padded.refused:
                evidence = [padded.evidence.as_dict()] if padded.evidence else []
                yield record(name, "state_bytes", padded, params, evidence)
                continue
            unpadded = run(ids[:length], 0, cfg.chunk, [length - 1], "none", True, snapshots)
            evidence = [r.evidence.as_dict() for r in (padded, unpadded) if r.evidence]
            yield record(name, "state_bytes", check_state_bytes(padded, unpadded), params, evidence)
            reference = qwen35.redecode(w, model, ids[:length])[0][-1] if reference is None else reference
            yield record(name, "first_token", check_token(reference, padded.logits[0], "first_token", cfg.logit_atol),
                         params, evidence)


# --- measurements ------------------------------------------------------------------------------------


def figures(clocks: dict, tokens: int, flops: int) -> dict:
    """Wall and CPU time, and the rates per each: on a shared machine the CPU figures are what the
    work cost, the wall figures what a user waited. Counted instructions (emulated devices; the host with
    counts=true) beside."""
    wall, cpu = clocks["wall"], clocks["cpu"]
    out = {"time": wall.scaled(1e3, "ms"), "tokens_per_s": wall.rate(tokens, "tokens/s"),
           "cpu_time": cpu.scaled(1e3, "ms"), "tokens_per_cpu_s": cpu.rate(tokens, "tokens/s"),
           "gflops_cpu": cpu.rate(flops / 1e9, "GFLOP/s")}
    if "instructions" in clocks:
        n = clocks["instructions"]
        out["instructions"] = n
        out["tokens_per_ginstr"] = n.rate(tokens * 1e9, "tokens per 1e9 instructions")
    if "gdn_cpu" in clocks:  # the engine's own timer around the recurrence (tb_hybrid_gdn_seconds)
        out["gdn_cpu_time"] = clocks["gdn_cpu"].scaled(1e3, "ms")
    return out


@dataclass
class Variant:
    """One model the measurements time: its config and weights, and how its GDN layers run."""

    model: qwen35.HybridConfig
    w: dict
    gdn: str  # serial | chunkwise | none


def crossover_variants(cfg: DictConfig) -> dict[str, Variant]:
    hybrid = model_config(cfg.bench.shape)
    dense, similar = qwen35.dense_config(hybrid), qwen35.dense_similar_config(hybrid)
    w_h = qwen35.init_weights(hybrid, cfg.seed)
    return {"dense": Variant(dense, qwen35.init_weights(dense, cfg.seed), "serial"),  # no GDN layer
            "dense-similar": Variant(similar, qwen35.init_weights(similar, cfg.seed), "serial"),
            "hybrid-serial": Variant(hybrid, w_h, "serial"),
            "hybrid-chunkwise": Variant(hybrid, w_h, "chunkwise"),
            "hybrid-no-recurrence": Variant(hybrid, w_h, "none")}


def no_recurrence(q, k, v, g, beta, state, head_map):
    """A GDN op that does no work (zero output, state unchanged): the hybrid timed with it is
    everything but the recurrence, so 1 - its time / the serial hybrid's is the recurrence's share,
    and 1 / (1 - share) the most any faster GDN form can gain on this model (Amdahl)."""
    return np.zeros_like(v), state


REFIMPL_GDN = {"serial": qwen35.gdn_form("serial"), "none": no_recurrence}


def refimpl_gdn(form: str, gdn_chunk: int):
    return qwen35.gdn_form("chunkwise", gdn_chunk) if form == "chunkwise" else REFIMPL_GDN[form]


def time_variants(cfg: DictConfig, ctx, calls: dict, reps: int, warmup: int) -> tuple[dict, dict]:
    """Each call (key -> (Variant, prompt, chunk, tail)) timed interleaved: per key its clocks as Figures
    (wall, cpu; instructions where counted) and the evidence of the runs. refimpl: numpy on the host,
    timed by the host's clocks; native: the engine program on the device, by its own clocks, one run per
    repetition (its warm-up inside), in an order shuffled per repetition from the run's seed; on an
    emulated device that counts, one run each (the counts are exact, its times never speed); on the host
    with counts=true, each call once more under valgrind, apart from the timed runs."""
    if cfg.backend != "native":
        fns = {key: partial(qwen35.prefill, v.w, v.model, prompt, chunk, refimpl_gdn(v.gdn, cfg.gdn_chunk), tail)
               for key, (v, prompt, chunk, tail) in calls.items()}
        return (time_alternating_clocks(fns, reps=reps, warmup=warmup, progress=ctx.progress, what="hybrid timing"),
                {key: [] for key in calls})
    from testbed.backends.native import hybrid as engine

    profile = ctx.device.profile
    if profile.has("emulated") and profile.has("counts"):
        reps, warmup = 1, 0  # its figures are exact counts: a repetition would give the same number again
    samples = {key: {"wall": [], "cpu": [], "gdn_cpu": [], "instructions": []} for key in calls}
    evidence = {key: [] for key in calls}
    runs = 0
    for rep in interleaved_order(list(calls), reps, cfg.seed):
        for key in rep:
            v, prompt, chunk, tail = calls[key]
            runs += 1  # each run inside the step: what the heartbeat says, with the time left
            ctx.progress(Tick(f"hybrid run {runs}/{reps * len(calls)}: {key} ({len(prompt)} tokens)"))
            run = engine.prefill(ctx.device, v.model, v.w, prompt, past=0, tokens=len(prompt), chunk=chunk,
                                 tail=tail, gdn=v.gdn, gdn_chunk=cfg.gdn_chunk, threads=cfg.threads,
                                 fused=bool(cfg.fused),
                                 warmup=warmup, reps=1, measured=True)
            samples[key]["wall"] += run.timings["seconds"]
            samples[key]["cpu"] += run.timings["cpu_seconds"]
            samples[key]["gdn_cpu"] += run.timings["gdn_cpu_seconds"]
            if run.counts:
                samples[key]["instructions"].append(run.counts.per_call)
            evidence[key].append(run.evidence.as_dict())
    if cfg.counts and not profile.has("counts"):
        for k, (key, (v, prompt, chunk, tail)) in enumerate(calls.items(), 1):
            ctx.progress(f"hybrid: counting instructions under valgrind {k}/{len(calls)}: {key}")
            run = engine.prefill(ctx.device, v.model, v.w, prompt, past=0, tokens=len(prompt), chunk=chunk,
                                 tail=tail, gdn=v.gdn, gdn_chunk=cfg.gdn_chunk, threads=cfg.threads, count=True)
            samples[key]["instructions"].append(run.counts.per_call)
    clocks = {key: {c: Figure.of(s, "instructions" if c == "instructions" else "s") for c, s in by.items() if s}
              for key, by in samples.items()}
    return clocks, evidence


def where(cfg: DictConfig, ctx) -> dict:
    """Where the figures come from: the clocks' and the denormals' story (FTZ on in every native program)."""
    emulated = ctx.device.profile.has("emulated")
    if cfg.backend != "native":
        return {"engine": "refimpl (numpy, host)", "ftz": False}
    return {"engine": "tb_hybrid_bench (C)", "ftz": True, "emulated": emulated,
            "rate": "tokens per 1e9 instructions (counted under emulation, not time)" if emulated
            else "tokens per CPU second"}


def crossover_records(cfg: DictConfig, ctx) -> Iterator[Record]:
    b = cfg.bench
    variants = crossover_variants(cfg)
    hybrid = variants["hybrid-serial"]
    arts, how = artifacts(cfg), where(cfg, ctx)
    gates = qwen35.median_log_decay(hybrid.w, hybrid.model)
    contexts = as_list(b.contexts)
    for i, length in enumerate(contexts):
        # each context's work grows with L: the time left is the contexts' tokens left at the pace so far
        ctx.progress(Step(f"hybrid crossover {i + 1}/{len(contexts)} L={length}", sum(contexts[:i]), sum(contexts)))
        prompt = np.random.default_rng(cfg.seed).integers(0, hybrid.model.vocab, length)
        calls = {name: (v, prompt, b.prefill_chunk, "exact") for name, v in variants.items()}
        clocks, evidence = time_variants(cfg, ctx, calls, b.reps, b.warmup)
        cpu = {name: c["cpu"].median for name, c in clocks.items()}
        for name, v in variants.items():
            flops = qwen35.prefill_flops(v.model, length, b.prefill_chunk)
            metrics = {"x_dense_cpu": cpu["dense"] / cpu[name], "x_dense_similar_cpu": cpu["dense-similar"] / cpu[name],
                       "x_serial_cpu": cpu["hybrid-serial"] / cpu[name], "median_log_decay": gates}
            if "instructions" in clocks[name]:
                metrics["x_serial_instructions"] = (clocks["hybrid-serial"]["instructions"].median
                                                    / clocks[name]["instructions"].median)
            yield Record(
                "hybrid", f"L={length}/{name}", "measure", figures=figures(clocks[name], length, flops), metrics=metrics,
                work={"flops": flops, "flop_count": "qwen35.prefill_flops (GDN: gdn_flops, the serial count)",
                      "tokens": length, "params": qwen35.body_params(v.model)},
                params={"part": "crossover", "context": length, "model": name, "prefill_chunk": b.prefill_chunk,
                        "gdn_chunk": cfg.gdn_chunk, "threads": cfg.threads, "layers": v.model.layers,
                        "layer_types": "".join(t[0] for t in v.model.layer_types), **how},
                artifacts=arts, evidence=evidence[name])


def tail_records(cfg: DictConfig, ctx) -> Iterator[Record]:
    """Padded vs scalar tail after one full chunk, chunkwise GDN, interleaved over every (N, mode)."""
    b = cfg.bench
    model = model_config(b.shape)
    v = Variant(model, qwen35.init_weights(model, cfg.seed), "chunkwise")
    prompt = np.random.default_rng(cfg.seed).integers(0, model.vocab, 2 * cfg.chunk)
    lengths = [cfg.chunk + t for t in as_list(b.tails)]
    ctx.progress(f"hybrid tail N={lengths}")
    calls = {(n, mode): (v, prompt[:n], cfg.chunk, mode) for n in lengths for mode in ("padded", "scalar")}
    clocks, evidence = time_variants(cfg, ctx, calls, b.reps, b.warmup)
    arts, how = artifacts(cfg), where(cfg, ctx)
    for (n, mode), c in clocks.items():
        tail = n - cfg.chunk
        flops = qwen35.graph_flops(model, cfg.chunk, 0)  # the full chunk
        if tail and mode == "padded":
            flops += qwen35.graph_flops(model, cfg.chunk, cfg.chunk)
        elif tail:
            flops += sum(qwen35.graph_flops(model, 1, cfg.chunk + i) for i in range(tail))
        # the prefill's time is the time to the first token's logits (TTFT)
        yield Record("hybrid", f"N={n}/{mode}", "measure", figures=figures(c, n, flops),
                     work={"flops": flops, "tokens": n},
                     params={"part": "tail", "prompt_tokens": n, "tail": tail, "mode": mode, "chunk": cfg.chunk,
                             "gdn_chunk": cfg.gdn_chunk, "threads": cfg.threads, **how},
                     artifacts=arts, evidence=evidence[(n, mode)])


def drift_model(cfg: DictConfig):
    """The checkpoint when one is given (its own gates and norms decide how fp16 drifts), else bench.shape."""
    if cfg.model.checkpoint:
        return oracle_model(cfg)[:2]
    model = model_config(cfg.bench.shape)
    return model, qwen35.init_weights(model, cfg.seed)


def drift_records(cfg: DictConfig, ctx) -> Iterator[Record]:
    """fp16 products in the chunkwise GDN against f32: refimpl's emulation (numpy, whole prompt in one
    redecode), or the engine's (tb_gdn_chunkwise_precision) in calls of bench.prefill_chunk on the device."""
    b = cfg.bench
    model, w = drift_model(cfg)
    native = cfg.backend == "native"
    for length in as_list(b.drift_tokens):
        prompt = np.random.default_rng(cfg.seed).integers(0, model.vocab, length)
        ctx.progress(f"hybrid drift T={length} f32")

        def run(precision):
            if native:
                from testbed.backends.native import hybrid as engine

                r = engine.prefill(ctx.device, model, w, prompt, past=0, tokens=length, chunk=b.prefill_chunk,
                                   tail="exact", gdn="chunkwise", gdn_chunk=cfg.gdn_chunk, precision=precision,
                                   all_logits=True, threads=cfg.threads, fused=bool(cfg.fused))
                return r.logits_all, r.state, [r.evidence.as_dict()]
            fn = partial(gdn.gdn_chunkwise, chunk=cfg.gdn_chunk, precision=precision)
            logits, state = qwen35.redecode(w, model, prompt, fn)
            return logits, state, []

        ref_logits, ref_state, ref_evidence = run("f32")
        ref_tokens = ref_logits.argmax(axis=-1)
        for precision in PRECISIONS:
            ctx.progress(f"hybrid drift T={length} {precision}")
            logits, state, evidence = run(precision)
            ref_arrays, arrays = ref_state.arrays(), state.arrays()
            recurrent = [k for k in ref_arrays if k.endswith("recurrent")]
            yield Record("hybrid", f"T={length}/{precision}", "measure",
                         metrics={"nmse_logits": nmse(ref_logits, logits),
                                  "nmse_recurrent": max(nmse(ref_arrays[k], arrays[k]) for k in recurrent),
                                  "token_agreement": float(np.mean(logits.argmax(axis=-1) == ref_tokens)),
                                  "last_token_agrees": bool(logits[-1].argmax() == ref_tokens[-1])},
                         work={"tokens": length},
                         params={"part": "drift", "tokens": length, "precision": precision,
                                 "gdn_chunk": cfg.gdn_chunk, "gdn_backend": "engine" if native else "refimpl",
                                 **({"prefill_chunk": b.prefill_chunk} if native else {})},
                         evidence=ref_evidence + evidence)


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    from threadpoolctl import threadpool_limits

    parts = {"oracle": oracle_records, "crossover": crossover_records, "tail": tail_records, "drift": drift_records}
    if cfg.backend == "engine":
        from testbed.backends.engine import refusals, spec as engine_spec

        spec = engine_spec.load(cfg.get("engine"))
        why = refusals.why_not(spec, ctx.device, "hybrid")
        if why is not None:  # recorded, never a pass
            yield from refusals.records("hybrid", [(f"{part}/engine", part) for part in PARTS[cfg.mode]], why,
                                        {"engine": spec.name})
            return
    with threadpool_limits(limits=cfg.threads):
        for part in PARTS[cfg.mode]:
            yield from parts[part](cfg, ctx)


# --- tables ------------------------------------------------------------------------------------------

RATE_CPU = "tokens per CPU s"
RATE_COUNTS = "tokens per 1e9 instr (emulated: counts, not time)"


def fit_per_token(contexts, seconds) -> tuple[float, float] | None:
    """Least-squares (a, b) of cost per token = a + b L (attention's average cost grows with L); the
    cost is seconds or instructions, whichever the rates are per."""
    if len(set(contexts)) < 2:
        return None
    b, a = np.polyfit(np.asarray(contexts, float), np.asarray(seconds, float) / np.asarray(contexts, float), 1)
    return float(a), float(b)


def crossover_context(frame: pd.DataFrame, hybrid: str, dense: str = "dense", by: str = "CPU time") -> dict:
    """Where `hybrid` overtakes `dense`: the first measured L with the higher rate, and the fitted L
    (an extrapolation beyond the largest measured L, as the seed's). frame: context, model, rate, and
    where it has them rate_samples (each repetition's rate, the models interleaved per context): then
    also the first L as an interval from the repetitions (decisions.crossing, `by` what the rate is
    per), in "crossover lo" < L <= "crossover hi", and the sentence saying it."""
    rate = "rate" if "rate" in frame else "tokens/s"
    tps = frame.pivot_table(index="context", columns="model", values=rate)
    if not {dense, hybrid} <= set(tps.columns):
        return {}
    interval = {}
    if "rate_samples" in frame:
        found = crossover_interval(frame, hybrid, dense, by)
        interval = {"crossover lo": found["lo"], "crossover hi": found["hi"], "crossover": found["says"]}
    measured = [int(L) for L, r in tps.iterrows() if r[hybrid] >= r[dense]]
    fits = {m: fit_per_token(tps.index, tps.index / tps[m]) for m in (dense, hybrid)}
    fitted = None
    if fits[dense] and fits[hybrid]:
        (a_d, b_d), (a_h, b_h) = fits[dense], fits[hybrid]
        if b_d > b_h:
            fitted = max(0.0, (a_h - a_d) / (b_d - b_h))
    return {"first measured L where faster": measured[0] if measured else None, **interval,
            "fitted crossover L": None if fitted is None else int(round(fitted))}


def crossover_interval(frame: pd.DataFrame, hybrid: str, dense: str, by: str) -> dict:
    """decisions.crossing of `hybrid` over `dense` across the contexts: the first L where its rate is at
    least dense's, as an interval. frame: context, model, rate_samples (both models at every context)."""
    reps = frame.set_index(["context", "model"])["rate_samples"]
    contexts = sorted(frame["context"].unique())
    return decisions.crossing(contexts, [reps[L, hybrid] for L in contexts], [reps[L, dense] for L in contexts],
                              for_good=False, by=by)


def measure_frame(df: pd.DataFrame, part: str) -> pd.DataFrame:
    if df.empty or "params.part" not in df:
        return pd.DataFrame()
    m = df[(df["kind"] == "measure") & (df["params.part"] == part)]
    return m.sort_values("time", kind="stable") if "time" in m else m


def _rates(m: pd.DataFrame) -> pd.DataFrame:
    """Per record its rate and what it is per: tokens per CPU second, or on an emulated device tokens
    per 1e9 counted instructions (an emulated device's times are never shown as speed; without counts
    its rows are left out). Beside it the rate's least and greatest repetition."""
    emulated = m["emulated"].fillna(False).astype(bool) if "emulated" in m else pd.Series(False, index=m.index)
    counted = m.get("figures.tokens_per_ginstr.median", pd.Series(np.nan, index=m.index)).notna()
    keep = ~emulated | counted
    m, emulated = m[keep], emulated[keep]

    def col(name):
        return m.get(name, pd.Series(np.nan, index=m.index)).astype(float)

    by_counts = emulated.to_numpy()
    pick = {s: np.where(by_counts, col(f"figures.tokens_per_ginstr.{s}"), col(f"figures.tokens_per_cpu_s.{s}"))
            for s in ("median", "min", "max")}

    def repetitions(name: str) -> list:
        return list(m.get(f"figures.{name}.samples", pd.Series(None, index=m.index, dtype=object)))

    # each repetition's rate (for the crossover's interval); one value where only the median is known
    samples = []
    for counted, by_instr, by_cpu, median in zip(by_counts, repetitions("tokens_per_ginstr"),
                                                 repetitions("tokens_per_cpu_s"), pick["median"]):
        found = by_instr if counted else by_cpu
        samples.append(list(found) if isinstance(found, list) else [median])
    # the recurrence's own cost: the engine's timer around it (CPU ms), or, counted, the whole count
    # (the recurrence-free model's is subtracted in the table)
    own = np.where(by_counts, col("figures.instructions.median"), col("figures.gdn_cpu_time.median"))
    total = np.where(by_counts, col("figures.instructions.median"), col("figures.cpu_time.median"))
    # denormals: the native programs flush them (FTZ/DAZ) on every target; numpy does not
    ftz = m.get("params.ftz", pd.Series(None, index=m.index)).map({True: "on", False: "off"}).fillna("?")
    return pd.DataFrame({"device": m["device"], "backend": m["backend"], "context": m["params.context"].astype(int),
                         "model": m["params.model"], "rate": pick["median"], "rate_min": pick["min"],
                         "rate_max": pick["max"], "rate_samples": samples,
                         "per": np.where(by_counts, RATE_COUNTS, RATE_CPU), "own": own,
                         "total": total, "FTZ": ftz.to_numpy()})


def recurrence(group: pd.DataFrame, counted: bool) -> dict:
    """The recurrence alone, from one context's rows: serial over chunkwise on its own cost (the engine's
    timer around it, CPU; or counted, each form's instructions minus the recurrence-free model's, the
    same code otherwise), its share of the serial hybrid's cost, the bound that share puts on any GDN
    speed-up (1 / (1 - share)) and what the measured ratio predicts for the whole
    (1 / (1 - share (1 - 1 / ratio))). Without the engine's timer (refimpl), the share comes from the
    rates: 1 - serial / no recurrence."""
    own = dict(zip(group["model"], group["own"]))
    total = dict(zip(group["model"], group["total"]))
    rate = dict(zip(group["model"], group["rate"]))
    nan = float("nan")
    serial, chunkwise = own.get("hybrid-serial", nan), own.get("hybrid-chunkwise", nan)
    if counted:
        base = own.get("hybrid-no-recurrence", nan)
        serial, chunkwise = serial - base, chunkwise - base
    ratio = serial / chunkwise if np.isfinite(chunkwise) and chunkwise > 0 else nan
    share = serial / total.get("hybrid-serial", nan) if np.isfinite(serial) else nan
    if not np.isfinite(share):
        share = 1 - rate.get("hybrid-serial", nan) / rate.get("hybrid-no-recurrence", nan)
    expected = 1 / (1 - share * (1 - 1 / ratio)) if np.isfinite(ratio) and np.isfinite(share) else nan
    return {"share": share, "ratio": ratio, "bound": 1 / (1 - share), "expected": expected}


def why_not_faster(r) -> str:
    """A row where chunkwise is not faster than serial: why, from the row's own figures."""
    if not {"hybrid-serial", "hybrid-chunkwise"} <= set(r.index) or pd.isna(r["hybrid-chunkwise"]):
        return ""
    if r["hybrid-chunkwise"] > r["hybrid-serial"]:
        return ""
    spread = r.get("spread", {}) or {}
    lo_c, hi_c = spread.get("hybrid-chunkwise", (np.nan, np.nan))
    lo_s, hi_s = spread.get("hybrid-serial", (np.nan, np.nan))
    rec = r.get("recurrence", {}) or {}
    alone, share, expected = rec.get("ratio", np.nan), rec.get("share", np.nan), rec.get("expected", np.nan)
    if np.isfinite(alone) and alone > 1 and np.isfinite(expected):
        why = (f"the recurrence alone runs {alone:.2f}x faster chunkwise, but it is {share:.0%} of the serial "
               f"hybrid's cost: the whole can gain {expected:.2f}x")
        if hi_c >= lo_s and hi_s >= lo_c:
            return (f"{why}, inside the repetitions' spread (serial {lo_s:.4g}-{hi_s:.4g}, chunkwise "
                    f"{lo_c:.4g}-{hi_c:.4g} {r['per']}): within noise")
        return f"{why}, and the rest of the model moved more than that between the runs"
    if hi_c >= lo_s and hi_s >= lo_c:
        return (f"within noise: the repetitions overlap (serial {lo_s:.4g}-{hi_s:.4g}, chunkwise "
                f"{lo_c:.4g}-{hi_c:.4g} {r['per']})")
    if np.isfinite(alone):
        return (f"the chunkwise recurrence is {1 / alone:.2f}x the serial one's cost here ({share:.0%} of the "
                f"serial hybrid): at this shape its products and forward substitution do more than the "
                f"rank-1 updates they replace")
    return "chunkwise is slower here, and no figure says what the recurrence alone costs"


def crossover_table(df: pd.DataFrame) -> pd.DataFrame:
    """The rate per context and model (latest record of each; the wall figures are in the records),
    beside the seed's figures; where chunkwise is not faster than serial, why (from the row's own
    figures)."""
    m = measure_frame(df, "crossover")
    if m.empty:
        return pd.DataFrame()
    m = m.groupby(["device", "backend", "params.context", "params.model"]).tail(1)
    rows = _rates(m)
    if rows.empty:
        return pd.DataFrame()
    keys = ["device", "backend", "FTZ", "context", "per"]
    wide = rows.pivot_table(index=keys, columns="model", values="rate").reset_index()
    spread = {k: {r["model"]: (r["rate_min"], r["rate_max"]) for _, r in g.iterrows()}
              for k, g in rows.groupby(keys)}
    rec = {k: recurrence(g, k[-1] == RATE_COUNTS) for k, g in rows.groupby(keys)}
    wide = wide[[*keys, *(m for m in MODELS if m in wide)]]  # MODELS' order
    wide.columns.name = None
    wide = wide.rename(columns={"per": "rate"})
    if {"hybrid-serial", "hybrid-chunkwise"} <= set(wide.columns):
        wide["chunkwise x serial"] = (wide["hybrid-chunkwise"] / wide["hybrid-serial"]).round(2)
    found = [rec[tuple(r[k] for k in ("device", "backend", "FTZ", "context", "rate"))] for _, r in wide.iterrows()]
    for column, key, digits in (("GDN share", "share", 3), ("bound x serial", "bound", 2),
                                ("recurrence alone: chunkwise x serial", "ratio", 2),
                                ("expected x serial", "expected", 2)):
        values = pd.Series([f[key] for f in found], index=wide.index, dtype=float)
        if values.notna().any():
            wide[column] = values.round(digits)
    why = []
    for (_, r), f in zip(wide.iterrows(), found):
        r = r.copy()
        r["per"], r["recurrence"] = r["rate"], f
        r["spread"] = spread.get((r["device"], r["backend"], r["FTZ"], r["context"], r["rate"]))
        why.append(why_not_faster(r))
    for model in MODELS:
        if model in wide:
            wide[model] = wide[model].round(1)
    wide["why chunkwise is not faster"] = why
    # object columns: whole numbers print whole beside the blanks of lengths the seed did not measure
    wide["seed hybrid"] = pd.Series([SEED["hybrid"].get(L) for L in wide["context"]], dtype=object)
    wide["seed dense"] = pd.Series([SEED["dense"].get(L) for L in wide["context"]], dtype=object)
    if not any(why):
        wide = wide.drop(columns="why chunkwise is not faster")
    return wide


def models_table(df: pd.DataFrame) -> pd.DataFrame:
    """The crossover's models: layers, their types (l linear, f full) and decoder weights."""
    m = measure_frame(df, "crossover")
    if m.empty or "params.layers" not in m:
        return pd.DataFrame()
    m = m.groupby("params.model").tail(1).set_index("params.model")
    what = {"dense": "the hybrid's width and depth, every layer full attention",
            "dense-similar": "seed 002's comparison: dense, as deep as brings its weights closest to the hybrid's",
            "hybrid-serial": "GDN serial", "hybrid-chunkwise": "GDN chunkwise",
            "hybrid-no-recurrence": "the hybrid with no recurrence: the bound on any GDN form"}
    rows = [{"model": name, "layers": int(m.loc[name, "params.layers"]), "types": m.loc[name, "params.layer_types"],
             "decoder weights": int(m.loc[name, "work.params"]), "what": what[name]}
            for name in MODELS if name in m.index]
    return pd.DataFrame(rows, dtype=object)


def crossover_summary(df: pd.DataFrame) -> pd.DataFrame:
    m = measure_frame(df, "crossover")
    if m.empty:
        return pd.DataFrame()
    rates = _rates(m.groupby(["device", "backend", "params.context", "params.model"]).tail(1))
    rows = []
    for (device, backend, per), grp in rates.groupby(["device", "backend", "per"]):
        for dense in DENSE:
            for hybrid in ("hybrid-serial", "hybrid-chunkwise"):
                found = crossover_context(grp, hybrid, dense, "instructions" if per == RATE_COUNTS else "CPU time")
                if found:
                    rows.append({"device": device, "backend": backend, "hybrid": hybrid, "against": dense,
                                 **found, "rate": per, "seed": SEED["crossover"]})
    return pd.DataFrame(rows, dtype=object)


def breakevens(df: pd.DataFrame) -> list[dict]:
    """The crossovers as data beside `testbed table hybrid`'s rows (testbed.report.tables.render): per
    device, backend and rate, each hybrid form over each dense model, with its interval (lo, hi, the
    level, the method, how many repetitions, whether decided) and the sentence a person reads; then
    the padded tail's breakevens (tail_breakevens)."""
    m = measure_frame(df, "crossover")
    if m.empty:
        return tail_breakevens(df)
    rates = _rates(m.groupby(["device", "backend", "params.context", "params.model"]).tail(1))
    found = []
    for (device, backend, per), grp in rates.groupby(["device", "backend", "per"]):
        if grp["context"].nunique() < 2:
            continue  # a crossover needs two contexts at least
        for dense in DENSE:
            for hybrid in ("hybrid-serial", "hybrid-chunkwise"):
                if not {dense, hybrid} <= set(grp["model"]):
                    continue
                c = crossover_interval(grp, hybrid, dense, "instructions" if per == RATE_COUNTS else "CPU time")
                found.append({"source": f"{device}/{backend}: {hybrid} overtakes {dense}", "rate": per,
                              **{k: c[k] for k in ("point", "lo", "hi", "level", "method", "reps", "decided",
                                                   "more_reps")},
                              "says": f"crossover context {c['says']}"})
    return found + tail_breakevens(df)


def tail_breakevens(df: pd.DataFrame) -> list[dict]:
    """The padded tail's breakeven per device and backend, by CPU time (never an emulated device's) and
    by instructions where the prefills were counted, with its interval, as data."""
    m = measure_frame(df, "tail")
    found = []
    for (device, backend), records in (m.groupby(["device", "backend"], sort=False) if len(m) else ()):
        for by in ("CPU time", "instructions"):
            sweep = tail_frame(records, by)
            if sweep.empty or sweep["tail"].nunique() < 2:
                continue
            point, c = breakeven.breakeven_tail(sweep), breakeven.breakeven_interval(sweep, by=by)
            found.append({"source": f"{device}/{backend}: padded tail", "by": by, "tail": point,
                          **{k: c[k] for k in ("lo", "hi", "level", "method", "reps", "decided", "more_reps")},
                          "says": _tail_breakeven(sweep, by)})
    return found


def tail_frame(df: pd.DataFrame, by: str = "CPU time") -> pd.DataFrame:
    """breakeven's columns by CPU time (tok/s and TTFT per CPU second; emulated devices' times are never
    speed, so their rows are left out) or by instructions (tokens per 1e9 instructions, the TTFT
    columns holding the instructions: wherever the prefill was counted, emulated devices included)."""
    m = measure_frame(df, "tail")
    if m.empty:
        return pd.DataFrame()
    counted = by == "instructions"
    rate, cost = (("figures.tokens_per_ginstr", "figures.instructions") if counted
                  else ("figures.tokens_per_cpu_s", "figures.cpu_time"))
    if "emulated" in m and not counted:
        m = m[~m["emulated"].fillna(False).astype(bool)]
    if m.empty or f"{rate}.median" not in m:
        return pd.DataFrame()
    m = m[m[f"{rate}.median"].notna()].groupby(["params.prompt_tokens", "params.mode"]).tail(1)
    if m.empty:
        return pd.DataFrame()
    wide = m.pivot_table(index=["params.prompt_tokens", "params.tail"], columns="params.mode",
                         values=[f"{rate}.median", f"{cost}.median"], aggfunc="last").dropna()
    frame = pd.DataFrame({
        "prompt_tokens": wide.index.get_level_values(0).astype(int), "tail": wide.index.get_level_values(1).astype(int),
        "padded_tps": wide[(f"{rate}.median", "padded")].to_numpy(),
        "scalar_tps": wide[(f"{rate}.median", "scalar")].to_numpy(),
        "padded_ttft_ms": wide[(f"{cost}.median", "padded")].to_numpy(),
        "scalar_ttft_ms": wide[(f"{cost}.median", "scalar")].to_numpy()})
    if f"{rate}.samples" in m:  # each repetition, for the breakeven's interval
        by_rep = m.set_index(["params.prompt_tokens", "params.mode"])[f"{rate}.samples"]
        for mode in ("padded", "scalar"):
            frame[f"{mode}_tps_samples"] = [by_rep.get((n, mode)) for n in frame["prompt_tokens"]]
    return frame


def _tail_breakeven(sweep: pd.DataFrame, by: str) -> str:
    b = breakeven.breakeven_tail(sweep)
    verdict = f"padded from tail {b}" if b is not None else f"scalar up to tail {int(sweep['tail'].max())}"
    if by != "CPU time":
        verdict += f", by {by}"
    if (sweep["tail"] > 0).any():
        verdict += f"; breakeven tail {breakeven.breakeven_interval(sweep, by=by)['says']}"
    return verdict


def tail_table(df: pd.DataFrame) -> pd.DataFrame:
    """The padded-vs-scalar table by CPU time, with each mode's exact instructions where they were
    counted; on an emulated device the instructions alone (its times never speed). Its breakevens are
    decisions beside the rows (tail_breakevens), never a row."""
    timed, counted = tail_frame(df), tail_frame(df, "instructions")
    if timed.empty:
        return breakeven.instruction_table(counted) if len(counted) else timed
    table = breakeven.tail_table(timed)
    return table.merge(breakeven.instruction_table(counted), on=["N", "tail"], how="left") if len(counted) else table


def drift_table(df: pd.DataFrame) -> pd.DataFrame:
    m = measure_frame(df, "drift")
    if m.empty:
        return pd.DataFrame()
    m = m.groupby(["params.tokens", "params.precision"]).tail(1)
    return pd.DataFrame({"tokens": m["params.tokens"].astype(int), "precision": m["params.precision"],
                         "NMSE logits": m["metrics.nmse_logits"], "NMSE recurrent": m["metrics.nmse_recurrent"],
                         "token agreement": m["metrics.token_agreement"].round(4),
                         "last token agrees": m["metrics.last_token_agrees"]}).reset_index(drop=True)


def oracle_table(df: pd.DataFrame) -> pd.DataFrame:
    o = df[df["kind"] == "oracle"] if len(df) else df
    if o.empty:
        return pd.DataFrame()
    return pd.DataFrame({"case": o["case"], "oracle": o["oracle"], "verdict": o["verdict"], "margin": o["margin"],
                         "nmse": o.get("metrics.nmse"), "bitexact": o.get("metrics.bitexact"),
                         "detail": o["detail"]}).reset_index(drop=True)


def summary(df: pd.DataFrame) -> list[pd.DataFrame]:
    """What `testbed run hybrid` prints: the oracle verdicts, the crossover table and its crossover
    contexts, the tail breakeven table, the fp16 drift."""
    tables = (oracle_table(df), crossover_table(df), models_table(df), crossover_summary(df), tail_table(df),
              drift_table(df))
    return [t for t in tables if len(t)]


def view(df: pd.DataFrame) -> pd.DataFrame:
    """`testbed table hybrid`: the crossover table from stored records (else the first table there is)."""
    tables = summary(df)
    crossover = crossover_table(df)
    return crossover if len(crossover) else (tables[0] if tables else pd.DataFrame())


def sweep_row(df: pd.DataFrame) -> dict:
    """Per sweep job: the oracle tally, the rate per model and context, chunkwise x serial (at L = 512:
    pp512) and the bound on it."""
    row: dict = {}
    o = df[df["kind"] == "oracle"]
    if len(o):
        row["oracles"] = Tally(o["verdict"]).phrase()
    table = crossover_table(df)
    for _, r in table.iterrows():
        for model in MODELS:
            if model in r:
                row[f"L={r['context']} {model}"] = r[model]
        for ratio in ("chunkwise x serial", "bound x serial"):
            if ratio in r:
                row[f"L={r['context']} {ratio}"] = r[ratio]
        row["rate"] = r["rate"]
    m = measure_frame(df, "crossover")
    if len(m) and len(table):  # each rate's repetitions, for the crossover's interval (programs only)
        rates = _rates(m.groupby(["device", "backend", "params.context", "params.model"]).tail(1))
        row["samples"] = {f"L={r.context} {r.model}": r.rate_samples for r in rates.itertuples()}
    return row


def sweep_footer(rows: pd.DataFrame, jobs) -> str:
    """A sweep over bench.contexts: the crossover over its jobs (one context each), with its interval
    where the rows carry their repetitions."""
    cols = [c for c in rows.columns if c.startswith("L=") and c.split(" ", 1)[1] in MODELS]
    if len({c.split(" ")[0] for c in cols}) < 2:
        return ""  # a crossover needs two contexts at least
    def repetitions(row: pd.Series, column: str) -> list[float]:  # sweep_row's samples, else the median
        found = row.get("samples")
        return found.get(column, [row[column]]) if isinstance(found, dict) else [row[column]]

    long = pd.DataFrame([{"context": int(c.split(" ")[0][2:]), "model": c.split(" ", 1)[1], "rate": r[c],
                          "rate_samples": repetitions(r, c)}
                         for _, r in rows.iterrows() for c in cols if pd.notna(r[c])])
    by = "instructions" if "rate" in rows and (rows["rate"] == RATE_COUNTS).all() else "CPU time"
    parts = []
    for h in ("hybrid-serial", "hybrid-chunkwise"):
        found = crossover_context(long.groupby(["context", "model"], as_index=False).last(), h, by=by)
        shown = {k: v for k, v in found.items() if k not in ("crossover lo", "crossover hi")}
        parts.append(f"{h}: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
    return "crossover with dense: " + "; ".join(parts)
