"""Experiment `engine_compare`: testbed's engine against llama.cpp on the same model, by llama-bench's measures.

The model (model group: FunctionGemma's 270M shape by default, seeded weights) is written once per weight
type, cached by content, as testbed's engine file and as a GGUF holding the same numbers:

  f32   both float32.
  f16   both IEEE half, numpy's round to nearest even of the float32 weights (as llama.cpp's converter).
  q8_0  llama.cpp's GGUF q8_0: per row, blocks of 32 weights, each block one float16 scale d = max|x| / 127
        and 32 int8 q = round(x / d), interleaved (34 bytes per 32 weights: 8.5 bits a weight). testbed's int8
        of the same model: the q8_0 weights q * d quantised again by testbed's own rule (scale = max / 127,
        group 32), which gives back exactly q and d, stored apart: an int8 matrix and a float32 scale per 32
        (36 bytes per 32 weights: 9 bits a weight). Checked before anything runs: testbed's file dequantises
        to exactly the values the GGUF dequantises to.
  The norms are float32 in every file. gguf_files.held_in gives those values (float32), the model both
  engines are handed and the reference computes.

What each engine computes from them is its own: testbed's engine (kernels/tb_model.h) multiplies float32
activations by the weights converted to float32 as they stream; llama.cpp's CPU backend rounds the
activations to f16 for f16 weights and quantises them to q8_0 blocks for q8_0 weights (integer dot
products), so its logits carry that rounding too (judge.tie).

Judged first. Per weight type, test and engine, one untimed run through the engine contract gives the logits
where the test's timed calls give them (Test.positions: every token of tg, the last row of pp and the plan),
against the model written out in float64 (refimpl.naive_gemma, sharing no code with either engine; one run of
the prompt gives every position): each token must be the reference's, or one within judge.tie of its best
logit (testbed.oracles.tokens' tie rule), margins beside. An engine that fails
(or refuses) a test is never timed on it, and llama-bench's row stands on the contract adapter's verdict:
the same library, built from the same llama.cpp tree. Every timed run's logits are checked again; a
repetition whose token differs fails the engine there and its times are dropped.

Measured as llama-bench measures (its tests, tokens per second of the timed calls, the other calls untimed):

  pp    `pp` tokens (pp512) in one call from empty caches (llama-bench: -p 512 -n 0, one ubatch)
  plan  seed 000's chunk plan: `plan.past` positions in calls of `plan.chunk` rows, untimed, then the utterance's
        `plan.tokens` in one timed call (llama-bench: pp52 @ d800 at -b 64 -ub 64). testbed's call is the seed's
        fixed-size chunk graph: 64 rows, 12 of them pads; llama.cpp's is 52 rows. Both are counted as 52 tokens.
  tg    `tg` one-token calls from empty caches (tg128; llama-bench: -p 0 -n 128)

Per weight type, thread count and test, the engines run interleaved in one job: `reps` repetitions, each
running every engine once in a shuffled order, one process per run (a process runs the plan `warmup` times
untimed, then once timed; llama-bench warms up as it always does). Three rows each:

  testbed     engine (cfg.engine, testbed-c-fused: the FMA build) through the contract: the timed calls'
              seconds by its own wall and CPU clocks (timings.json), its process's peak resident set (VmHWM
              at exit, read by tb_peak_rss, which every engine request runs through)
  llama.cpp   reference_engine (tb_llama_engine, libllama) through the contract, the same figures
  llama-bench llama.cpp's own measure: its samples_ns for the test, -r 1 per process; its process's CPU
              seconds (load, warm-up and all: not per token) and peak resident set beside
              (testbed.backends.llamacpp.bench)

Each row's tokens per second is median [min, max] over the repetitions, beside the CPU seconds per token and
CPU use (CPU / wall / threads: under 1 the process waited for a core or its threads for each other), and the
ratio testbed / llama-bench (and testbed / llama.cpp through the contract, by wall and by CPU) per repetition,
against the goal (at least 1: issue 45), with met or short_by.

On an emulated device (qemu-aarch64) nothing is timed: each engine's judged run is counted by the
instruction plugin through its marks (tb_engine.h), and its records give the instructions of the timed calls
per token (the FLOPs they do beside), at one thread. testbed's engine runs one guest thread: exact, run after
run. libllama starts more (the plugin's shared counter then says "exact": false, kept in the record): its
counts differ between runs by up to about 1e-4. llama-bench does not run there.

`testbed run engine_compare` prints llama-bench's columns (model, size, params, backend, threads, test, t/s)
for the three rows, then testbed's table; `testbed table engine_compare --format md|csv|json|jsonl` the same
as one table from the stored records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from refimpl import gemma, naive_gemma
from testbed.backends import NotSupported
from testbed.backends.engine import build as engine_build, spec as specs
from testbed.backends.engine.gemma import model_config
from testbed.backends.engine.runner import ContractError, Expect, Request, Response, call
from testbed.backends.llamacpp import bench as llama_bench, build as llama_build
from testbed.backends.native import build as kernel_build
from testbed.backends.native.engine import dequantized, export_weights
from testbed.config import Choice, ChoiceList, Float, Int, IntList, as_list
from testbed.devices import load_profile
from testbed.errors import UsageError
from testbed.experiments import chunk_prefill
from testbed.measure import blas_reference
from testbed.measure.timing import time_interleaved
from testbed.models import gguf_files
from testbed.oracles.tokens import margin_for, tied_tokens, top2_margin
from testbed.oracles.numerical import nmse
from testbed.report import tables
from testbed.results import Figure, Record

WEIGHTS = ("f32", "f16", "q8_0")
TESTBED_DTYPE = {"f32": "f32", "f16": "f16", "q8_0": "int8"}  # testbed's engine file for each weight type
GROUP = 32  # q8_0's block: testbed's int8 scale group for the same numbers
LAYOUT = {  # how each file stores a weight matrix (what its size column counts)
    ("testbed", "f32"): "float32", ("llama.cpp", "f32"): "F32",
    ("testbed", "f16"): "float16", ("llama.cpp", "f16"): "F16",
    ("testbed", "q8_0"): "int8 + float32 scale per 32 (9 bits/weight)",
    ("llama.cpp", "q8_0"): "Q8_0: float16 scale + 32 int8 per block (8.5 bits/weight)",
}
ROWS = ("testbed", "llama.cpp", "llama-bench")  # the engines' rows, in the order tables show them
GOAL = 1.0  # testbed's tokens/s at least llama.cpp's (issue 45)

PARAMS = {
    "backend": Choice(("engine",)),
    "weights": ChoiceList(WEIGHTS),
    "threads": IntList(1, 256),
    "tests": ChoiceList(("pp", "plan", "tg")),
    "pp": Int(1, 1 << 16),
    "plan.past": Int(1, 1 << 20),
    "plan.tokens": Int(1, 1 << 16),
    "plan.chunk": Int(1, 1 << 16),
    "tg": Int(1, 1 << 16),
    "reps": Int(1, 1000),
    "warmup": Int(0, 100),
    "timeout_s": Float(1.0),
    "llama_bench": Choice((False, True)),
    "flash_attn": Choice(("auto", "on", "off")),
    "judge.tie.f32": Float(0.0),
    "judge.tie.f16": Float(0.0),
    "judge.tie.q8_0": Float(0.0),
    "seed": Int(0),
    "model.preset": Choice(tuple(chunk_prefill.PRESETS)),
    "model.weights_seed": Int(0),
}


@dataclass(frozen=True)
class Test:
    """One of llama-bench's tests as a plan of engine calls: `past` positions untimed in calls of `chunk`
    rows, then `tokens` timed in calls of `chunk` rows (one call for pp and plan, one per token for tg)."""

    kind: str   # pp | plan | tg
    past: int
    tokens: int
    chunk: int

    @property
    def name(self) -> str:
        """llama-bench's name for it: pp512, tg128, pp52 @ d800."""
        if self.kind == "tg":
            return f"tg{self.tokens}"
        return f"pp{self.tokens}" + (f" @ d{self.past}" if self.past else "")

    @property
    def position(self) -> int:
        """The last position."""
        return self.past + self.tokens - 1

    @property
    def positions(self) -> list[int]:
        """Where the timed calls give logits, as llama-bench's do: every token of tg (generation needs each
        token's logits; an engine asked for none may skip the LM head, 60% of this model's weights), the last
        row of a prompt. The engines are judged at all of them."""
        return list(range(self.past, self.past + self.tokens)) if self.kind == "tg" else [self.position]

    def llama_bench_args(self) -> list[str]:
        if self.kind == "tg":
            return ["-p", "0", "-n", str(self.tokens)]
        args = ["-p", str(self.tokens), "-n", "0"]
        if self.kind == "plan":
            args += ["-d", str(self.past), "-b", str(self.chunk), "-ub", str(self.chunk)]
        return args

    def flops(self, model: gemma.GemmaConfig) -> int:
        """Multiply-add FLOPs of the timed calls (refimpl.gemma.graph_flops: projections, attention, MLP,
        and the LM head on one row per call), counting the rows llama.cpp computes (no pads)."""
        if self.kind == "tg":
            return sum(gemma.graph_flops(model, 1, p) for p in range(self.past, self.past + self.tokens))
        return gemma.graph_flops(model, self.tokens, self.past)


def tests(cfg: DictConfig) -> list[Test]:
    make = {"pp": Test("pp", 0, cfg.pp, cfg.pp), "plan": Test("plan", cfg.plan.past, cfg.plan.tokens, cfg.plan.chunk),
            "tg": Test("tg", 0, cfg.tg, 1)}
    return [make[k] for k in cfg.tests]


def validate(cfg: DictConfig) -> None:
    if cfg.plan.tokens > cfg.plan.chunk:
        raise UsageError(f"plan.tokens={cfg.plan.tokens} is more than one call of plan.chunk={cfg.plan.chunk} rows; "
                         "accepted: plan.tokens <= plan.chunk (the seed's plan times one chunk call)")
    if cfg.model.checkpoint:
        raise UsageError("model.checkpoint: engine_compare writes a seeded model in each weight type; accepted: "
                         "model.checkpoint=null (model.preset and model.overrides choose the shape)")
    # what this experiment hands each side: testbed's engine file, a GGUF (an engine that reads neither is a
    # wrong setting; one that refuses a weight type or is not built for the device says so in its records)
    for key, fmt in (("engine", "safetensors"), ("reference_engine", "gguf")):
        spec = specs.load(cfg[key])
        if "chunk_prefill" not in spec.techniques or fmt not in spec.model_formats:
            raise UsageError(f"{key}={spec.name} must serve chunk_prefill from a {fmt} model ({spec.path}: supports: "
                             f"techniques {list(spec.techniques)}, model_formats {list(spec.model_formats)})")
        engine_build.check_device(spec, load_profile(cfg.device.name))
    chunk_prefill._preset(cfg)  # model.overrides checked


# --- the model, its files and its reference ------------------------------------------------------------


@dataclass
class WeightType:
    """One weight type's model: the values both files hold, the files, and the reference's logits."""

    name: str
    held: dict                      # float32 values both engines are handed
    testbed_file: Path
    gguf: Path
    reference: dict[int, np.ndarray] = field(default_factory=dict)  # position -> float64 logits

    @property
    def artifacts(self) -> dict:
        # the files are named by a hash of their content (export_weights, gguf_of)
        return {"testbed_weights": self.testbed_file.name, "gguf": self.gguf.name}


def model_files(model: gemma.GemmaConfig, w: dict, weights: str) -> WeightType:
    """Both files of `w` in `weights` (written once per content), checked to hold the same numbers."""
    held = gguf_files.held_in(w, weights)
    testbed_file = export_weights(model, held, TESTBED_DTYPE[weights], GROUP)
    gguf = gguf_files.gguf_of(model, w, tensor_type=weights)  # judged by reading it back: it holds `held`
    back = dequantized(held, TESTBED_DTYPE[weights], GROUP)
    for name, a in held.items():
        if not np.array_equal(back[name], a):
            raise AssertionError(f"testbed's {TESTBED_DTYPE[weights]} file of {name} does not hold the {weights} "
                                 f"GGUF's values (largest difference {float(np.abs(back[name] - a).max()):.3g})")
    return WeightType(weights, held, testbed_file, gguf)


def params_count(w: dict) -> int:
    return int(sum(a.size for a in w.values()))


def file_bytes(model: gemma.GemmaConfig, w: dict, weights: str, row: str) -> int:
    """The bytes of the model's tensors in that engine's file (llama-bench's size: tensor data)."""
    per = {"testbed": {"f32": 4.0, "f16": 2.0, "q8_0": 1.0 + 4.0 / GROUP},
           "llama.cpp": {"f32": 4.0, "f16": 2.0, "q8_0": 34.0 / 32.0}}["testbed" if row == "testbed" else "llama.cpp"]
    return int(sum(a.size * (per[weights] if a.ndim == 2 else 4.0) for a in w.values()))


# --- one engine run through the contract ---------------------------------------------------------------


@dataclass
class ContractEngine:
    """An engine under the contract, as this experiment asks it: one request per run."""

    row: str                   # "testbed" | "llama.cpp"
    spec: specs.EngineSpec
    program: Path | None       # None: not built for this device (its refusal says so)
    model: gemma.GemmaConfig
    device: object
    target: str

    def refusal(self, weights: str) -> str | None:
        """Why the engine's yaml says it does not serve this experiment's requests of `weights` here."""
        theirs = self.row != "testbed"
        return self.spec.refusal("chunk_prefill", self.target, weights if theirs else TESTBED_DTYPE[weights])

    def request(self, wt: WeightType, prompt, test: Test, threads: int, bench: dict | None) -> Request:
        theirs = self.row != "testbed"
        dtype = wt.name if theirs else TESTBED_DTYPE[wt.name]
        return Request("chunk_prefill", np.asarray(prompt[:test.past + test.tokens], np.int32),
                       wt.gguf if theirs else wt.testbed_file, "gguf" if theirs else "safetensors", dtype,
                       model_config(self.model, TESTBED_DTYPE[wt.name], GROUP), test.past, test.chunk,
                       test.positions, threads=threads, bench=bench)

    def run(self, wt: WeightType, prompt, test: Test, threads: int, bench: dict | None) -> Response:
        refused = self.refusal(wt.name)
        if refused:
            raise NotSupported(refused)
        c = self.model
        response = call(self.device, self.spec, self.request(wt, prompt, test, threads, bench),
                        Expect(c.vocab, c.layers, c.kv_heads, c.head_dim), self.program)
        if response.refused:
            raise NotSupported(f"engine {self.spec.name} refused: {response.reason}")
        return response


def timed_calls(response: Response, test: Test) -> list[dict]:
    """The calls of the test's timed tokens in the engine's timings.json: those named "chunk" (the past's are
    "past"), one for pp and plan, `tokens` for tg."""
    calls = [c for c in response.timings.get("calls", []) if c.get("name") == "chunk"]
    want = test.tokens if test.kind == "tg" else 1
    if len(calls) != want:
        raise ContractError(f"timings.json names {len(calls)} calls \"chunk\"; the plan of {test.name} makes {want}")
    return calls


# --- judging ----------------------------------------------------------------------------------------------


def judge(logits: np.ndarray, wt: "WeightType", test: Test, tie: float) -> dict:
    """The engine's logits [len(test.positions), vocab] against the float64 reference at each position: the
    token must be the reference's best or within `tie` of it. Reported: the tokens, the least margin (an
    engine's best accepted logit minus its best other one: negative where it chose another token), the
    reference's least top-1 minus top-2 margin, the first position that failed, and how far the logits are."""
    tokens, refs, margins, ref_margins, failed = [], [], [], [], None
    for row, p in zip(logits, test.positions):
        reference = wt.reference[p]
        accepted = tied_tokens(reference, tie)
        tokens.append(int(np.argmax(row)))
        refs.append(int(np.argmax(reference)))
        margins.append(margin_for(row, accepted))
        ref_margins.append(top2_margin(reference))
        if tokens[-1] not in accepted and failed is None:
            failed = {"position": p, "token": tokens[-1], "accepted": accepted}
    reference = np.stack([wt.reference[p] for p in test.positions])
    return {"passed": failed is None, "margin": float(min(margins)), "token": tokens[-1], "token_ref": refs[-1],
            "positions": len(tokens), "tokens_equal": int(sum(a == b for a, b in zip(tokens, refs))),
            "first_failure": failed, "ref_top2_margin": float(min(ref_margins)),
            "max_abs_logit_diff": float(np.max(np.abs(logits.astype(np.float64) - reference))),
            "nmse": nmse(reference, logits)}


def verdict_record(row: str, spec_name: str, wt: WeightType, test: Test, threads: int, judged: dict | None,
                   refused: str | None, evidence, tie: float) -> Record:
    case = f"{wt.name}/{test.name}/{row}"
    params = {"engine": spec_name, "row": row, "weights": wt.name, "test": test.name, "threads": threads,
              "position": test.position, "positions": len(test.positions), "tie": tie}
    if refused:
        return Record("engine_compare", case, "oracle", "token", "not supported", None, {}, params=params,
                      artifacts=wt.artifacts, detail=refused, evidence=evidence)
    where = (f"{judged['tokens_equal']} of {judged['positions']} tokens the reference's (positions "
             f"{test.positions[0]}-{test.positions[-1]}), the last {judged['token']}" if judged["positions"] > 1
             else f"token {judged['token']} at position {test.position}, reference {judged['token_ref']}")
    failure = judged["first_failure"]
    if failure:
        where += (f"; first wrong at position {failure['position']}: token {failure['token']}, accepted "
                  f"{failure['accepted']}")
    detail = f"{where}; max |logit - float64| {judged['max_abs_logit_diff']:.3g}"
    return Record("engine_compare", case, "oracle", "token", "pass" if judged["passed"] else "fail", judged["margin"],
                  {k: v for k, v in judged.items() if k not in ("passed", "margin")}, params=params,
                  artifacts=wt.artifacts, detail=detail if judged["passed"] else f"never timed: {detail}",
                  evidence=evidence)


# --- the experiment ---------------------------------------------------------------------------------------


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    model, w, _ = chunk_prefill.load_model(*chunk_prefill._model_key(cfg))
    the_tests = tests(cfg)
    prompt = np.random.default_rng([cfg.seed, 45]).integers(0, model.vocab, max(t.past + t.tokens for t in the_tests))
    emulated = ctx.device.profile.has("emulated")
    threads = as_list(cfg.threads)
    if emulated:  # counted, not timed: the profile's thread counts only
        threads = [t for t in threads if t in (ctx.device.profile.threads or [1])] or [1]
    target = kernel_build.target_for_abi(ctx.device.profile.abi)
    engines = []
    for row, spec in (("testbed", specs.load(cfg.engine)), ("llama.cpp", specs.load(cfg.reference_engine))):
        # the yamls' timeout_s bounds the requests they expect; this model's plans under emulation take longer
        spec = dataclasses.replace(spec, timeout_s=max(spec.timeout_s, cfg.timeout_s))
        built = None if spec.refusal("chunk_prefill", target) else engine_build.program_for(spec, target)
        engines.append(ContractEngine(row, spec, built, model, ctx.device, target))
    bench_program = None
    if cfg.llama_bench and not emulated and ctx.device.profile.transport == "local":
        ctx.progress("building llama.cpp's llama-bench for this host (once per source)")
        bench_program = llama_build.build("host", "", ("llama-bench",), progress=ctx.progress).program("llama-bench")
    for index, weights in enumerate(cfg.weights):
        ctx.progress(f"engine_compare {weights}: the model's files (written once per content)")
        wt = model_files(model, w, weights)
        positions = sorted({p for t in the_tests for p in t.positions})
        ctx.progress(f"engine_compare {weights}: the float64 reference at {len(positions)} positions")
        for p, row in zip(positions, naive_gemma.logits_at(wt.held, model, prompt, positions)):
            wt.reference[p] = row
        tie = float(cfg.judge.tie[weights])
        passed = {}
        for test in the_tests:
            for engine in engines:
                ctx.progress(f"engine_compare {weights} {test.name}: judging {engine.spec.name}")
                record, response = judged_run(engine, wt, prompt, test, threads[0], tie)
                passed[engine.row, test] = record.verdict == "pass"
                yield record
                if emulated and passed[engine.row, test]:
                    yield count_record(engine, wt, test, model, w, response, threads[0])
        if emulated:
            continue
        for n_threads in threads:
            for k, test in enumerate(the_tests):
                yield from measure(cfg, ctx, engines, bench_program, wt, prompt, test, n_threads, model, w, tie,
                                   passed, seed=cfg.seed * 1000 + index * 100 + n_threads * 10 + k)
        del wt


def judged_run(engine: ContractEngine, wt: WeightType, prompt, test: Test, threads: int, tie: float):
    """The engine's untimed run of the test's plan, judged: (its verdict record, its response or None)."""
    try:
        response = engine.run(wt, prompt, test, threads, None)
    except NotSupported as e:
        return verdict_record(engine.row, engine.spec.name, wt, test, threads, None, str(e), [], tie), None
    judged = judge(response.logits, wt, test, tie)
    return verdict_record(engine.row, engine.spec.name, wt, test, threads, judged, None,
                          [response.evidence.as_dict()], tie), response


def count_record(engine: ContractEngine, wt: WeightType, test: Test, model, w: dict, response: Response,
                 threads: int) -> Record:
    """An emulated device's instructions of the test's timed calls (the judged run's), per token: exact where
    the program ran one guest thread (the plugin's `exact`)."""
    counts = response.counts
    if counts is None or not counts.regions:
        return Record("engine_compare", f"{wt.name}/{test.name}/{engine.row}/instructions", "measure",
                      metrics={"not_counted": "the engine marks no calls or the device does not count"},
                      params=base_params(engine.row, engine.spec.name, wt, test, threads, model),
                      evidence=[response.evidence.as_dict()])
    per_call = counts.of("chunk")
    total = int(sum(per_call))
    return Record("engine_compare", f"{wt.name}/{test.name}/{engine.row}", "measure",
                  figures={"instructions_per_token": Figure.of([total / test.tokens], "instructions"),
                           "instructions": Figure.of([total], "instructions")},
                  metrics={"counter": counts.counter, "exact": counts.exact, "calls": len(per_call),
                           "size_bytes": file_bytes(model, w, wt.name, engine.row), "params_count": params_count(w)},
                  work={"flops": test.flops(model), "tokens": test.tokens,
                        "flops_counted": "refimpl.gemma.graph_flops of the timed calls (no pad rows)"},
                  params=base_params(engine.row, engine.spec.name, wt, test, threads, model),
                  artifacts=wt.artifacts, evidence=[response.evidence.as_dict()])


def base_params(row: str, engine: str, wt: WeightType, test: Test, threads: int, model) -> dict:
    return {"row": row, "engine": engine, "weights": wt.name, "layout": LAYOUT.get((
        "testbed" if row == "testbed" else "llama.cpp", wt.name)), "threads": threads, "test": test.name,
            "kind": test.kind, "past": test.past, "tokens": test.tokens, "chunk": test.chunk,
            "layers": model.layers, "hidden": model.hidden, "vocab": model.vocab}


def measure(cfg, ctx, engines: list[ContractEngine], bench_program: Path | None, wt: WeightType, prompt, test: Test,
            threads: int, model, w: dict, tie: float, passed: dict, seed: int) -> Iterator[Record]:
    """The test at `threads`, every engine that passed it interleaved: cfg.reps repetitions, one process each."""
    runs: dict[str, list] = {row: [] for row in ROWS}
    wrong: dict[str, str] = {}

    def contract_variant(engine: ContractEngine) -> Callable[[], dict]:
        def once() -> dict:
            response = engine.run(wt, prompt, test, threads, {"reps": 1, "warmup": cfg.warmup})
            judged = judge(response.logits, wt, test, tie)
            if not judged["passed"] and engine.row not in wrong:
                failure = judged["first_failure"]
                wrong[engine.row] = (f"a timed run gave token {failure['token']} at position {failure['position']} "
                                     f"(accepted: {failure['accepted']})")
            calls = timed_calls(response, test)
            runs[engine.row].append(response)
            return {"wall": sum(float(c["wall_s"]) for c in calls), "cpu": sum(float(c["cpu_s"]) for c in calls)}
        return once

    def bench_variant() -> dict:
        argv = ["-m", str(wt.gguf), "-t", str(threads), "-r", "1", "-o", "json", "-fa", cfg.flash_attn,
                *test.llama_bench_args()]
        ran = llama_bench.run(bench_program, argv, cfg.timeout_s, ctx.device.name)
        runs["llama-bench"].append(ran)
        return {"wall": float(ran.raw["samples_ns"][0]) / 1e9}

    variants = {e.row: contract_variant(e) for e in engines if passed[e.row, test]}
    if bench_program is not None and passed["llama.cpp", test]:
        variants["llama-bench"] = bench_variant
    if not variants:
        return
    ctx.progress(f"engine_compare {wt.name} {test.name} t={threads}: {', '.join(variants)} interleaved, "
                 f"{cfg.reps} repetitions")
    loads = []

    def timer(fn):
        loads.append(__import__("os").getloadavg()[0])
        return fn()

    timed = time_interleaved(variants, reps=cfg.reps, warmup=0, seed=seed, timer=timer)
    for row, why in wrong.items():
        yield Record("engine_compare", f"{wt.name}/{test.name}/{row}/timed", "oracle", "token", "fail", None,
                     params=base_params(row, variants and next(e.spec.name for e in engines if e.row == row), wt,
                                        test, threads, model), detail=f"{why}; its times are dropped")
    figures = {}
    for row in variants:
        if row in wrong:
            continue
        samples = timed.samples[row]
        wall = np.asarray(samples["wall"], float)
        record = row_record(cfg, row, engines, wt, test, threads, model, w, wall,
                            np.asarray(samples["cpu"], float) if "cpu" in samples else None, runs[row], loads, timed)
        figures[row] = (wall, samples.get("cpu"))
        yield record
    yield from ratio_records(wt, test, threads, model, figures, loads)


def row_record(cfg, row: str, engines, wt: WeightType, test: Test, threads: int, model, w: dict, wall: np.ndarray,
               cpu: np.ndarray | None, runs: list, loads: list[float], timed) -> Record:
    engine = next((e.spec.name for e in engines if e.row == row), "llama-bench")
    tokens = test.tokens
    figures = {"tokens_per_s": Figure.of(tokens / wall, "tokens/s"), "seconds": Figure.of(wall, "s")}
    metrics = {"load_1m": [min(loads), max(loads)]}
    evidence = [r.evidence.as_dict() for r in runs]
    if cpu is not None:
        figures["cpu_seconds"] = Figure.of(cpu, "s")
        figures["cpu_ms_per_token"] = Figure.of(1e3 * cpu / tokens, "ms")
        figures["cpu_use"] = Figure.of(cpu / wall / threads, "x")  # 1: every thread busy all the time
    else:  # llama-bench: its own figures; the process's CPU from this process's children's rusage
        figures["process_cpu_seconds"] = Figure.of([r.process_cpu_s for r in runs], "s")
        raw = runs[0].raw
        metrics |= {"llama_bench": {k: raw.get(k) for k in ("model_type", "model_size", "model_n_params", "backends",
                                                            "n_batch", "n_ubatch", "flash_attn", "type_k", "type_v",
                                                            "n_prompt", "n_gen", "n_depth", "build_commit",
                                                            "cpu_info")},
                    "process_cpu_seconds_is": "the whole llama-bench process: model load, warm-up and the "
                                              "repetition (not per token)"}
    rss = [r.peak_rss_bytes for r in runs]  # tb_peak_rss's reading of each process, where it was read
    if all(isinstance(x, int) for x in rss):
        figures["peak_rss"] = Figure.of([x / 2**20 for x in rss], "MiB")
    size = int(runs[0].raw.get("model_size")) if row == "llama-bench" else file_bytes(model, w, wt.name, row)
    metrics |= {"size_bytes": size, "params_count": params_count(w),
                "order": [rep.index(row) for rep in timed.order]}
    return Record("engine_compare", f"{wt.name}/t{threads}/{test.name}/{row}", "measure", figures=figures,
                  metrics=metrics,
                  work={"tokens": tokens, "flops": test.flops(model),
                        "flops_counted": "refimpl.gemma.graph_flops of the timed calls (projections, attention, MLP, "
                                         "LM head on one row per call; no pad rows)",
                        "timed": ("the call(s) named chunk in timings.json, by the engine's own clocks" if cpu is not None
                                  else "llama-bench's samples_ns (-r 1: one repetition per process)"),
                        "warmup": cfg.warmup if cpu is not None else "llama-bench's own"},
                  params=base_params(row, engine, wt, test, threads, model) | {
                      **({"flash_attn": cfg.flash_attn} if row == "llama-bench" else {}),
                      **({"flash_attn": "off"} if row == "llama.cpp" else {})},
                  artifacts=wt.artifacts, evidence=evidence)


def ratio_records(wt: WeightType, test: Test, threads: int, model, figures: dict, loads: list[float]) -> Iterator[Record]:
    """testbed's tokens/s over each llama.cpp row's, per repetition (the runs of one repetition are a pair,
    interleaved), against the goal: at least 1."""
    if "testbed" not in figures:
        return
    mine_wall, mine_cpu = figures["testbed"]
    for other in ("llama-bench", "llama.cpp"):
        if other not in figures:
            continue
        their_wall, their_cpu = figures[other]
        clocks = {"wall": np.asarray(their_wall) / np.asarray(mine_wall)}  # t/s ratio = their time / mine
        if their_cpu is not None:
            clocks["cpu"] = np.asarray(their_cpu) / np.asarray(mine_cpu)
        for clock, ratio in clocks.items():
            median = float(np.median(ratio))
            yield Record("engine_compare", f"{wt.name}/t{threads}/{test.name}/testbed_vs_{other}/{clock}", "measure",
                         figures={"ratio": Figure.of(ratio, "x")},
                         metrics={"goal": GOAL, "goal_is": "at least", "met": bool(median >= GOAL),
                                  "short_by": blas_reference.shortfall(median, GOAL, at_most=False),
                                  "load_1m": [min(loads), max(loads)]},
                         work={"ratio": f"testbed's tokens/s over {other}'s by the {clock} clock, per repetition"},
                         params={"row": f"testbed / {other}", "weights": wt.name, "threads": threads,
                                 "test": test.name, "clock": clock, "layers": model.layers, "hidden": model.hidden},
                         artifacts=wt.artifacts)


# --- tables --------------------------------------------------------------------------------------------


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _params(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def model_name(r: pd.Series) -> str:
    """llama-bench's model column: arch, parameters, weight type, the same for every engine's row of one model
    (llama-bench's own model_type is kept in its records' metrics.llama_bench)."""
    n = float(r.get("metrics.params_count"))
    label = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"
    return f"gemma3 {label} {str(r.get('params.weights')).upper()}"


def bench_view(df: pd.DataFrame) -> pd.DataFrame:
    """llama-bench's columns, one row per engine, weight type, thread count and test: t/s median ± sd."""
    rows = []
    for _, r in _rows(df).iterrows():
        samples = r.get("figures.tokens_per_s.samples")
        sd = float(np.std(samples, ddof=1)) if isinstance(samples, list) and len(samples) > 1 else 0.0
        rows.append({"engine": r["params.row"], "model": model_name(r), "size": _size(r["metrics.size_bytes"]),
                     "params": _params(r["metrics.params_count"]), "backend": "CPU",
                     "threads": r["params.threads"], "test": r["params.test"],
                     "t/s": f"{r['figures.tokens_per_s.median']:.2f} ± {sd:.2f}"})
    return pd.DataFrame(rows)


def _rows(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty or "params.row" not in df or "figures.tokens_per_s.median" not in df:
        return df.iloc[0:0]
    m = df[(df["kind"] == "measure") & df["params.row"].isin(ROWS) & df["figures.tokens_per_s.median"].notna()]
    return m.sort_values(["params.weights", "params.threads", "params.test", "params.row"], kind="stable",
                         key=lambda c: c.map({**{w: i for i, w in enumerate(WEIGHTS)},
                                              **{r: i for i, r in enumerate(ROWS)}}).fillna(c) if c.name in (
                             "params.weights", "params.row") else c)


def view(df: pd.DataFrame) -> pd.DataFrame:
    """testbed's table: per row the engine, weight type, threads and test, its tokens/s with min and max, CPU,
    memory, the ratios and the load, then llama-bench's columns of the model; an emulated device's rows are its
    instruction counts."""
    rows = []
    ratios = df[(df["kind"] == "measure") & df["case"].str.contains("/testbed_vs_")] if len(df) else df
    for _, r in _rows(df).iterrows():
        key = (r["params.weights"], r["params.threads"], r["params.test"])
        ratio = {}
        for other, clock in (("llama-bench", "wall"), ("llama.cpp", "wall"), ("llama.cpp", "cpu")):
            hit = ratios[(ratios["params.weights"] == key[0]) & (ratios["params.threads"] == key[1])
                         & (ratios["params.test"] == key[2]) & ratios["case"].str.endswith(f"_vs_{other}/{clock}")] \
                if len(ratios) else ratios
            ratio[other, clock] = hit.iloc[-1] if len(hit) else None
        mine = r["params.row"] == "testbed"

        def ratio_cell(other, clock):
            hit = ratio[other, clock]
            if not mine or hit is None:
                return None
            return f"{hit['figures.ratio.median']:.2f} [{hit['figures.ratio.min']:.2f}-{hit['figures.ratio.max']:.2f}]"

        load = r.get("metrics.load_1m")
        rows.append({"device": r["device"], "engine": r["params.row"], "type": r["params.weights"],
                     "model": model_name(r),
                     "weights": r.get("params.layout"), "size": _size(r["metrics.size_bytes"]),
                     "params": _params(r["metrics.params_count"]), "backend": "CPU", "threads": r["params.threads"],
                     "test": r["params.test"], "t/s": r["figures.tokens_per_s.median"],
                     "min": r["figures.tokens_per_s.min"], "max": r["figures.tokens_per_s.max"],
                     "reps": r["figures.tokens_per_s.reps"], "CPU ms/token": r.get("figures.cpu_ms_per_token.median"),
                     "CPU use": r.get("figures.cpu_use.median"), "peak RSS MiB": r.get("figures.peak_rss.median"),
                     "vs llama-bench": ratio_cell("llama-bench", "wall"),
                     "vs llama.cpp wall": ratio_cell("llama.cpp", "wall"),
                     "vs llama.cpp CPU": ratio_cell("llama.cpp", "cpu"),
                     "goal met": (None if not mine or ratio["llama-bench", "wall"] is None
                                  else bool(ratio["llama-bench", "wall"]["metrics.met"])),
                     "load": f"{load[0]:.1f}-{load[1]:.1f}" if isinstance(load, list) else None,
                     "samples": tables.samples(r)})
    counted = df[(df["kind"] == "measure") & df.get("figures.instructions_per_token.median", pd.Series(dtype=float))
                 .notna()] if len(df) and "figures.instructions_per_token.median" in df else df.iloc[0:0]
    for _, r in counted.iterrows():
        rows.append({"device": r["device"], "engine": r["params.row"], "type": r["params.weights"],
                     "model": model_name(r),
                     "weights": r.get("params.layout"), "size": _size(r["metrics.size_bytes"]),
                     "params": _params(r["metrics.params_count"]), "backend": "CPU", "threads": r["params.threads"],
                     "test": r["params.test"], "instructions/token": round(r["figures.instructions_per_token.median"]),
                     "exact": bool(r.get("metrics.exact")), "samples": tables.samples(r)})
    table = pd.DataFrame(rows)
    # the figures first (a terminal keeps the columns that fit from the first); the model's words, which
    # llama-bench's table gives too, last
    words = [c for c in ("model", "weights", "size", "params", "backend") if c in table]
    return table[[c for c in table.columns if c not in words] + words]


def summary(df: pd.DataFrame) -> list[pd.DataFrame]:
    """What `testbed run engine_compare` prints: the verdicts, llama-bench's columns, then testbed's table."""
    oracles = df[df["kind"] == "oracle"] if len(df) else df
    judged = pd.DataFrame([{"weights": r.get("params.weights"), "test": r.get("params.test"),
                            "engine": r.get("params.engine"), "verdict": r["verdict"], "margin": r["margin"],
                            "max |logit - float64|": r.get("metrics.max_abs_logit_diff"),
                            "token": r.get("metrics.token"), "reference": r.get("metrics.token_ref")}
                           for _, r in oracles.iterrows()])
    full = view(df)
    return [t for t in (judged, bench_view(df), full.drop(columns=[c for c in ("device",) if c in full])) if len(t)]
