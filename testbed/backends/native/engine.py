"""The model engine in C (kernels/tb_model.h) run on a device: chunk prefill with past (seed 000) and
chunked prefill with a padded tail and rollback on sliding-window caches (seed 003).

The engine program (kernels/bench/tb_model_bench.c) is built for the device's ABI, pushed once per
content, given the weights as ONE safetensors file (exported here, cached by content hash, pushed once
per content) and the prompt as tokens.npy, and runs the whole utterance or prompt on the device: the
KV caches never leave it; what an oracle compares (logits, K/V, cache bytes) is pulled at the end.

    chunk_prefill(device, cfg, w, prompt, case)  -> ChunkRun   (P past tokens, n tokens in chunks of C)
    tail(device, cfg, w, prompt, TailSettings)   -> TailRun    (padded or scalar tail, cache bytes)

Every run carries its Evidence (testbed.backends): the program's sha256, the command, the device-side
seconds. The oracles stay on the host and compare against refimpl: testbed/backends/native/gemma.py
hands a ChunkRun to the token-at-position oracle as an Utterance; `DeviceTailEngine` gives the
first-token oracle device-run prefills.

Weights: f32 as given, or f16 / int8 (symmetric, one float32 scale per `group` inputs of each row,
refimpl.sliding_cache.quantize_int8); `dequantized` gives what refimpl must run on to be the
reference for them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from refimpl import gemma, sliding_cache as sc, tail_prefill as tp
from testbed.backends import Evidence
from testbed.backends.native import build as kernel_build
from testbed.backends.native.device import NativeJob, NativeResult, program_digest, run_native, stage_program
from testbed.devices import Device
from testbed.errors import UsageError

PROGRAM = "tb_model_bench"
WEIGHT_DTYPES = ("f32", "f16", "int8")
CACHE_DTYPES = {"float32": "f32", "float16": "f16", "int8": "int8"}  # refimpl's names -> the program's
WEIGHTS_DIR = kernel_build.ROOT / ".cache" / "engine"


# --- weights -----------------------------------------------------------------------------------------


def _stored(name: str, a: np.ndarray, dtype: str, group: int) -> dict[str, np.ndarray]:
    """One tensor as the file stores it: matrices in the weight dtype (int8 with NAME_scale), vectors
    (the norms) always float32."""
    a = np.asarray(a, np.float32)
    if a.ndim == 1 or dtype == "f32":
        return {name: a}
    if dtype == "f16":
        return {name: a.astype(np.float16)}
    if a.shape[1] % group:
        raise UsageError(f"int8 weight group {group} does not divide {name}'s {a.shape[1]} inputs")
    q, scale = sc.quantize_int8(a, group)
    return {name: q, f"{name}_scale": scale}


def stored_tensors(w: dict, dtype: str = "f32", group: int = 32) -> dict[str, np.ndarray]:
    if dtype not in WEIGHT_DTYPES:
        raise UsageError(f"weights dtype {dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    out = {}
    for name in sorted(w):
        out.update(_stored(name, w[name], dtype, group))
    return out


def dequantized(w: dict, dtype: str = "f32", group: int = 32) -> dict[str, np.ndarray]:
    """The float32 weights the engine computes with: refimpl's reference for f16 / int8 weights."""
    stored = stored_tensors(w, dtype, group)
    out = {}
    for name in w:
        a = stored[name]
        if a.dtype == np.int8:
            rows, cols = a.shape
            scale = stored[f"{name}_scale"]
            a = (a.astype(np.float32).reshape(rows, cols // group, group) * scale[:, :, None]).reshape(rows, cols)
        out[name] = a.astype(np.float32)
    return out


def export_weights(cfg: gemma.GemmaConfig, w: dict, dtype: str = "f32", group: int = 32,
                   folder: Path = WEIGHTS_DIR) -> Path:
    """The weights as one safetensors file, named by the hash of its content (written once)."""
    from safetensors.numpy import save_file

    if not cfg.tie_embeddings:
        raise UsageError("the engine computes tied logits only (tie_embeddings=True)")
    tensors = stored_tensors(w, dtype, group)
    h = hashlib.sha256(f"{dtype} {group}".encode())
    for name, a in tensors.items():
        h.update(f"{name} {a.dtype} {a.shape}".encode() + np.ascontiguousarray(a).tobytes())
    path = folder / f"weights-{h.hexdigest()[:20]}.safetensors"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".tmp{os.getpid()}")
        save_file({k: np.ascontiguousarray(a) for k, a in tensors.items()}, str(partial),
                  metadata={"format": "testbed-gemma", "weights_dtype": dtype, "group": str(group)})
        partial.replace(path)
    return path


def model_args(cfg: gemma.GemmaConfig, dtype: str = "f32", group: int = 32) -> list[str]:
    """The model's shape as the program's arguments (the weights file must match it exactly)."""
    types = "".join("G" if t == "global" else "L" for t in cfg.layer_types)
    return [f"vocab={cfg.vocab}", f"hidden={cfg.hidden}", f"layers={cfg.layers}", f"heads={cfg.heads}",
            f"kv_heads={cfg.kv_heads}", f"head_dim={cfg.head_dim}", f"mlp={cfg.mlp}", f"window={cfg.window}",
            f"types={types}", f"rope_local={cfg.rope_local!r}", f"rope_global={cfg.rope_global!r}",
            f"rope_global_scaling={cfg.rope_scaling_global!r}",
            f"attn_scale={cfg.scale!r}", f"eps={cfg.rms_eps!r}", f"softcap={cfg.final_logit_softcap or 0.0!r}",
            f"wdtype={dtype}", f"wgroup={group}"]


# --- running the program -------------------------------------------------------------------------------


def program_for(device: Device, fused: bool = False) -> Path:
    """The engine program built for the device's ABI (cached by content hash); fused: the FMA build
    (faster, judged by tolerance; the default unfused build is bit-exact across targets)."""
    return kernel_build.build_programs(kernel_build.target_for_abi(device.profile.abi), fused=fused) / PROGRAM


def _run(device: Device, cfg: gemma.GemmaConfig, w: dict, tokens, args: list[str], outputs: list[str] | dict[str, tuple],
         weights_dtype: str, group: int, program: Path | None, measured: bool,
         count: bool = False) -> tuple[NativeResult, Evidence]:
    """`outputs`: their names, or each name with its shape (None: any size on that axis). `count` on a
    device that does not count by itself (the host): the run is under valgrind, with the build it can
    run (kernel_build.valgrind_program); its instructions come back in the result's counts, its times
    are valgrind's."""
    program = program or program_for(device)
    valgrind = count and not device.profile.has("counts")
    if valgrind:
        program = kernel_build.valgrind_program(program)
    weights = export_weights(cfg, w, weights_dtype, group)
    remote_weights = stage_program(device, weights)
    argv = [".", ".", f"weights=../../{remote_weights}", *model_args(cfg, weights_dtype, group), *args]
    job = NativeJob(program, {"tokens": np.asarray(tokens, np.int32)}, list(outputs), argv, measured=measured and not valgrind,
                    shapes=outputs if isinstance(outputs, dict) else {}, count=valgrind)
    result = run_native(device, job)
    # the device's evidence names the program; the weights it computed with are part of what ran
    evidence = dataclasses.replace(result.evidence, detail={**result.evidence.detail,
                                                            "weights_sha256": program_digest(weights)})
    return result, evidence


# --- chunk prefill with past (seed 000) -------------------------------------------------------------


@dataclass
class ChunkRun:
    """One utterance on the device: P past tokens, then n tokens in ceil(n/C) chunk calls."""

    call_logits: np.ndarray     # [calls, vocab]: each call's selected row (its last real one)
    k: list[np.ndarray]         # per layer [kv_heads, P' + C, head_dim] after the last call, pads included
    v: list[np.ndarray]
    decode_logits: np.ndarray   # [vocab]: the same n tokens as decode steps, at the last position
    timings: dict
    evidence: Evidence
    counts: object = None       # testbed.measure.counts.Counts on a device that counts: regions "chunk", "decode", ...


def chunk_prefill(device: Device, cfg: gemma.GemmaConfig, w: dict, prompt, case, *, weights_dtype: str = "f32",
                  group: int = 32, threads: int = 1, warmup: int = 0, reps: int = 1, reference: bool = False,
                  program: Path | None = None, cold_mb: int = 0, count: bool = False) -> ChunkRun:
    """Run a chunk-prefill case (testbed.oracles.tokens.TokenCase) on the device. `w`: float32 weights,
    exported in weights_dtype. reps > 1 times a chunk call and a decode step interleaved (and, with
    `reference`, this run's sgemm and streaming-read rates); cold_mb > 0: the caches evicted before
    each timed decode step (that many MiB written and read). `count`: on the host, under valgrind (_run)."""
    tokens = np.asarray(prompt, np.int64)[: case.past + case.tokens]
    args = ["mode=chunk", f"past={case.past}", f"tokens={case.tokens}", f"chunk={case.chunk}", f"threads={threads}",
            f"warmup={warmup}", f"reps={reps}", f"reference={int(reference)}"] + (
                [f"cold_mb={cold_mb}"] if cold_mb else [])
    kv = (cfg.layers, cfg.kv_heads, None, cfg.head_dim)
    outputs = {"chunk_logits": (case.calls, cfg.vocab), "k": kv, "v": kv, "decode_logits": (cfg.vocab,)}
    result, evidence = _run(device, cfg, w, tokens, args, outputs, weights_dtype, group, program, measured=reps > 1,
                            count=count)
    out = result.outputs
    return ChunkRun(out["chunk_logits"], list(out["k"]), list(out["v"]), out["decode_logits"], result.timings,
                    evidence, result.counts)


# --- the padded tail (seed 003) ---------------------------------------------------------------------


@dataclass(frozen=True)
class TailSettings:
    chunk: int
    cache_dtype: str = "float32"   # refimpl's name: float32 | float16 | int8
    cache_group: int = 16
    sink: int = 0
    threshold: int = tp.DEFAULT_THRESHOLD
    state: bool = False            # the model has a conv / recurrent state: padding must stay off
    generate: int = 1              # greedy tokens generated after the prefill, on the device
    exact_tail: bool = False       # the byte-identical oracle's reference: append the tail's real rows only
    weights_dtype: str = "f32"
    weights_group: int = 32
    threads: int = 1
    fused: bool = False            # the FMA build (judged by tolerance) instead of the bit-exact one


@dataclass
class DevicePrefill(tp.Prefill):
    """refimpl's Prefill, from the device: its caches rebuilt from the pulled bytes, and the tokens the
    device generated greedily right after it."""

    generated: list[int] = field(default_factory=list)


@dataclass
class TailRun:
    prefill: DevicePrefill
    timings: dict
    evidence: Evidence
    counts: object = None  # testbed.measure.counts.Counts on a device that counts: one region "prefill" per repetition


def _caches(cfg: gemma.GemmaConfig, s: TailSettings, out: dict, lengths: list[int]) -> tp.ModelCaches:
    """refimpl caches holding the device's bytes (sliding for local layers, full for global ones)."""
    layers = []
    for i, t in enumerate(cfg.layer_types):
        def part(name, dtype):
            return out[f"layer{i}.{name}"].view(dtype)

        k, v = part("k", s.cache_dtype), part("v", s.cache_dtype)
        slots = k.shape[1]
        k, v = k.reshape(cfg.kv_heads, slots, cfg.head_dim), v.reshape(cfg.kv_heads, slots, cfg.head_dim)
        if s.cache_dtype == "int8":
            groups = cfg.head_dim // s.cache_group
            k_scale = part("k_scale", np.float32).reshape(cfg.kv_heads, slots, groups)
            v_scale = part("v_scale", np.float32).reshape(cfg.kv_heads, slots, groups)
        else:
            k_scale = v_scale = np.zeros((cfg.kv_heads, slots, 0), np.float32)
        rows = sc.RowStorage(s.cache_dtype, s.cache_group, k, v, k_scale, v_scale, out[f"layer{i}.positions"], lengths[i])
        layers.append(sc.SlidingCache(cfg.window, s.sink, rows) if t == "local" else sc.FullCache(rows))
    return tp.ModelCaches(layers)


def tail(device: Device, cfg: gemma.GemmaConfig, w: dict, prompt, s: TailSettings, *, warmup: int = 0,
         reps: int = 1, kill_switch: bool | None = None,
         program: Path | None = None, count: bool = False) -> TailRun:
    """Prefill `prompt` on the device with the tail policy. The kill switch: the host's
    TESTBED_DISABLE_PREFILL_TAIL_PAD unless given, forwarded to the program. `count`: on the host,
    under valgrind (_run)."""
    if kill_switch is None:
        kill_switch = os.environ.get(tp.KILL_SWITCH) == "1"
    if s.cache_dtype not in CACHE_DTYPES:
        raise UsageError(f"cache dtype {s.cache_dtype!r} is not one of {', '.join(CACHE_DTYPES)}")
    tokens = np.asarray(prompt, np.int64).reshape(-1)
    args = ["mode=tail", f"chunk={s.chunk}", f"cache={CACHE_DTYPES[s.cache_dtype]}", f"cache_group={s.cache_group}",
            f"sink={s.sink}", f"threshold={s.threshold}", f"state={int(s.state)}", f"generate={s.generate}",
            f"exact_tail={int(s.exact_tail)}",
            f"{tp.KILL_SWITCH}={int(kill_switch)}", f"threads={s.threads}", f"warmup={warmup}",
            f"reps={reps}"]
    parts = {"k": (cfg.kv_heads, None, None), "v": (cfg.kv_heads, None, None), "positions": (None,)}
    if s.cache_dtype == "int8":
        parts |= {"k_scale": (cfg.kv_heads, None, None), "v_scale": (cfg.kv_heads, None, None)}
    outputs = {"logits": (cfg.vocab,), "generated": (s.generate,),
               **{f"layer{i}.{p}": shape for i in range(cfg.layers) for p, shape in parts.items()}}
    result, evidence = _run(device, cfg, w, tokens, args, outputs, s.weights_dtype, s.weights_group,
                            program or program_for(device, s.fused), measured=reps > 1, count=count)
    out, timings = result.outputs, result.timings
    caches = _caches(cfg, s, out, timings["lengths"])
    prefill = DevicePrefill(out["logits"], tp.Telemetry(**timings["telemetry"]), caches, tokens.size,
                            [int(t) for t in out["generated"]])
    return TailRun(prefill, timings, evidence, result.counts)


def rollback_runs(device: Device, cfg: gemma.GemmaConfig, w: dict, case, s: TailSettings, seed: int = 0,
                  program: Path | None = None) -> tuple[TailRun, TailRun]:
    """For the byte-identical oracle (testbed.oracles.tail.check_engine_rollback): the prompt of
    `case` (an EngineGridCase) with its tail padded then rolled back, and with the padded call
    appending only its real rows. Padding is forced (threshold 0, kill switch off)."""
    model = dataclasses.replace(cfg, window=case.window)
    tokens = np.random.default_rng([seed, case.prompt]).integers(0, cfg.vocab, case.prompt)
    base = dataclasses.replace(s, chunk=case.chunk, cache_dtype=case.dtype, sink=case.sink, threshold=0, state=False)
    return tuple(tail(device, model, w, tokens, dataclasses.replace(base, exact_tail=exact), kill_switch=False,
                      program=program) for exact in (False, True))


def encoding_runs(device: Device, cfg: gemma.GemmaConfig, w: dict, prompt, s: TailSettings,
                  program: Path | None = None) -> tuple[TailRun, TailRun]:
    """For the cache-encoding oracle (testbed.oracles.tail.check_cache_encoding): the prompt prefilled
    with the settings' cache dtype, and with a float32 cache (which holds the rows the encoder was given)."""
    return tuple(tail(device, cfg, w, prompt, dataclasses.replace(s, cache_dtype=dtype), program=program)
                 for dtype in (s.cache_dtype, "float32"))


@dataclass
class DeviceTailEngine:
    """What testbed.oracles.tail.check_first_token drives (its Engine's prefill and generate), with
    every prefill run on the device. `make_caches` and `policy` describe the same caches and policy on
    the host, for callers that ask the policy what it would decide."""

    device: Device
    cfg: gemma.GemmaConfig
    w: dict
    settings: TailSettings
    program: Path | None = None
    runs: list[TailRun] = field(default_factory=list)

    @property
    def graph(self) -> tp.ChunkGraph:
        return tp.ChunkGraph(self.settings.chunk)

    @property
    def policy(self) -> tp.TailPolicy:
        return tp.TailPolicy(self.settings.threshold)

    def make_caches(self) -> tp.ModelCaches:
        s = self.settings
        return tp.model_caches(self.cfg, s.cache_dtype, s.sink, s.cache_group, 2 if s.state else 0)

    def prefill(self, tokens) -> DevicePrefill:
        run = tail(self.device, self.cfg, self.w, tokens, self.settings, program=self.program)
        self.runs.append(run)
        return run.prefill

    def generate(self, state: DevicePrefill, steps: int) -> list[int]:
        """The tokens the device generated after this prefill (it generates settings.generate)."""
        if steps > len(state.generated):
            raise ValueError(f"{steps} tokens asked, the device generated {len(state.generated)} "
                             f"(TailSettings.generate)")
        return state.generated[:steps]


def weights_stream_bytes(cfg: gemma.GemmaConfig, dtype: str = "f32", group: int = 32) -> int:
    """Bytes of the weight matrices one decode step reads once (every projection and the tied LM head)."""
    per = {"f32": 4.0, "f16": 2.0, "int8": 1.0 + 4.0 / group}[dtype]
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    layer = cfg.hidden * (2 * q + 2 * kv) + 3 * cfg.hidden * cfg.mlp
    return int(math.ceil(per * (cfg.layers * layer + cfg.vocab * cfg.hidden)))
