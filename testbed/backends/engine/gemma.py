"""backend=engine for experiment chunk_prefill: the engine under test serves each utterance through the
contract, and the token oracle judges it as it judges every backend.

One utterance is two requests: the chunk path (tokens[0:P] then tokens[P:P+n] in calls of C rows,
the logits row at P+n-1, the engine's cache when it exposes one) and the token-by-token path (the same
tokens in calls of one row). The K/V rows past P+n, where an engine leaves its last call's pad rows in
its cache (testbed-c does, as backend=native's program does), are judged as the pad rows they are.
A refusal raises NotSupported: the experiment records "not supported".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from omegaconf import OmegaConf

from refimpl import gemma
from testbed.backends import ContractBroken, EvidenceLog, NotSupported, Utterance
from testbed.backends.engine import build, spec as specs
from testbed.backends.engine.models import GemmaModel
from testbed.backends.engine.runner import Expect, Request, Response, call, keep_request
from testbed.backends.native import build as kernel_build
from testbed.backends.native.engine import model_args
from testbed.devices import Device
from testbed.results import Figure


def model_config(cfg: gemma.GemmaConfig, dtype: str, group: int) -> dict:
    """request.json's model.config: the model's shape as testbed's engine programs take it."""
    return dict(a.split("=", 1) for a in model_args(cfg, dtype, group))


@dataclass
class EngineRunner:
    w: dict
    cfg: gemma.GemmaConfig
    device: Device
    spec: specs.EngineSpec
    program: Path
    threads: int = 1
    weights_dtype: str = "f32"
    weights_group: int = 32
    count: bool = False
    # the model the engine reads, in a format its yaml accepts (testbed.backends.engine.models)
    model_file: Path | None = None
    model_format: str = "safetensors"
    evidence: EvidenceLog = field(default_factory=EvidenceLog)
    # the last utterance's requests and responses by path ("chunk", "decode"): what a failing case is
    # localised from and kept as
    last: dict[str, tuple[Request, Response]] = field(default_factory=dict)
    progress: Callable[[str], None] | None = None  # hears an exporter's progress and heartbeats

    @property
    def name(self) -> str:
        return f"engine:{self.spec.name}"

    def request(self, tokens, past: int, chunk: int, logits_at: list[int], bench: dict | None = None) -> Request:
        return Request("chunk_prefill", np.asarray(tokens, np.int32), self.model_file, self.model_format,
                       self.weights_dtype,
                       model_config(self.cfg, self.weights_dtype, self.weights_group), past, chunk, logits_at,
                       threads=self.threads, bench=bench, count=self.count and bench is not None)

    @property
    def expect(self) -> Expect:
        c = self.cfg
        return Expect(c.vocab, c.layers, c.kv_heads, c.head_dim)

    def ask(self, request: Request, measured: bool = False) -> Response:
        response = call(self.device, self.spec, request, self.expect, self.program, measured=measured,
                        say=self.progress)
        if response.evidence:
            self.evidence.add(response.evidence)
        if response.refused:
            raise NotSupported(f"engine {self.spec.name} refused: {response.reason}")
        return response

    def utterance(self, prompt, case, build_inputs=gemma.chunk_inputs) -> Utterance:
        real = case.past + case.tokens
        tokens = np.asarray(prompt)[:real]
        requests = {"chunk": self.request(tokens, case.past, case.chunk, [real - 1]),
                    "decode": self.request(tokens, case.past, 1, [real - 1])}
        self.last = {path: (request, self.ask(request)) for path, request in requests.items()}
        chunked, stepped = self.last["chunk"][1], self.last["decode"][1]
        if chunked.cache_k is None:  # cache/ is optional: the token and logits oracles still judge
            return Utterance(chunked.logits[0], stepped.logits[0], None, None, None, None, None)
        rows = chunked.cache_k[0].shape[1]
        if rows < real or rows > real + case.chunk:
            raise ContractBroken(f"response/cache/k_0.npy holds {rows} rows; P + n = {real} real rows (and at most "
                                 f"C - n_last = {case.calls * case.chunk - case.tokens} pad rows) were due")
        last_start = case.past + (case.calls - 1) * case.chunk
        # the rows past P+n are the last call's pad rows, where the engine keeps them (the oracle judges
        # as many as there are; an engine that removed them has none to judge)
        last = build_inputs(self.cfg, tokens[last_start:real], last_start, case.chunk,
                            past_positions=np.arange(last_start))
        ks, vs = chunked.cache_k, chunked.cache_v
        return Utterance(chunked.logits[0], stepped.logits[0], [k[:, :real] for k in ks], [v[:, :real] for v in vs],
                         [k[:, real:] for k in ks], [v[:, real:] for v in vs], last)

    def logits_at(self, prompt, past: int, chunk: int, positions: list[int], end: int) -> np.ndarray:
        """The logits rows at `positions` of the plan (P = past, C = chunk) over prompt[:end]; a cut inside
        the past keeps the past's calls before the cut's call as the past (the plan's calls are the same up
        to the cut). For localising a failing case (testbed.oracles.where); a refusal raises NotSupported."""
        if end <= past:
            past = (end - 1) // chunk * chunk
        return self.ask(self.request(np.asarray(prompt)[:end], past, chunk, list(positions))).logits

    def keep(self, path: str, why: str):
        """The last utterance's request of `path` kept for replay in the run's store
        (testbed.backends.engine.keep), or None outside a run."""
        request, _ = self.last[path]
        return keep_request(self.device, self.spec, self.program, request, self.expect, why)

    def bench(self, prompt, past: int, chunk: int, reps: int, warmup: int) -> dict:
        """The engine's own times of its calls: the chunk call of C rows and a one-row call, each after
        `past` positions, by the wall clock and (NAME_cpu) the CPU clock the engine reports per call (on a
        loaded host wall time alone misleads: llama.cpp read 111 ms wall against 17.7 ms CPU); with the
        instructions of each where the engine marks its calls and the device counts; the engine process's
        peak RSS where the device lets it be read, and an exporter-based engine's export size
        ({name}_peak_rss, export_bytes: one value each)."""
        times = {}
        for name, rows in (("chunk_call", chunk), ("decode_step", 1)):
            request = self.request(np.asarray(prompt)[:past + rows], past, rows, [past + rows - 1],
                                   {"reps": reps, "warmup": warmup})
            response = self.ask(request, measured=True)
            timed = [c for c in response.timings["calls"] if c.get("name") == "chunk"]
            timed = timed[-reps:] if len(timed) >= reps else timed
            if not timed:
                raise ContractBroken(f"engine {self.spec.name}'s timings.json has no call named \"chunk\"")
            times[name] = Figure.of([float(c["wall_s"]) for c in timed], "s")
            times[f"{name}_cpu"] = Figure.of([float(c["cpu_s"]) for c in timed], "s")
            if response.peak_rss_bytes is not None:
                times[f"{name}_peak_rss"] = Figure.of([response.peak_rss_bytes], "bytes")
            if response.export is not None:
                times["export_bytes"] = Figure.of([response.export.size_bytes], "bytes")
            if response.counts and response.counts.regions:
                times[f"{name}_instructions"] = Figure.of(response.counts.of("chunk")[-reps:], "instructions")
        return times

    def mask_heads(self, case, seed: int = 0):
        raise NotSupported("an engine builds its own masks; per-head masks are judged for backend=native and iree")


def backend(w, cfg, run_cfg=None, device: Device | None = None, progress=None) -> EngineRunner:
    def option(key, default):
        return OmegaConf.select(run_cfg, key, default=default) if run_cfg is not None else default

    if device is None:
        raise ValueError("an engine runs on a device: pass the connected Device")
    spec = specs.load(option("engine", None))
    target = kernel_build.target_for_abi(device.profile.abi)
    weights, group = option("native.weights", "f32"), int(option("native.group", 32))
    if (why := spec.refusal("chunk_prefill", target, weights)) is not None:
        raise NotSupported(why)
    model_file, model_format = GemmaModel(cfg, w, option("model.checkpoint", None), option("model.gguf", None),
                                          weights, group).file_for(spec)
    return EngineRunner(w, cfg, device, spec, build.program_for(spec, target), int(option("threads", 1)),
                        weights, group, count=bool(option("counts", False)), model_file=model_file,
                        model_format=model_format, progress=progress)


# --- testbed ab over two engines (testbed.lab.ab) ------------------------------------------------------


@dataclass
class EngineCall:
    """One measured call for `testbed ab engine:A engine:B`: the request both engines serve (a chunk call
    of C rows after `past` positions, timed once per run by the engine's own clock), each handed `model` in a
    format its yaml accepts."""

    label: str
    request: Request
    expect: Expect
    model: GemmaModel
    program: str = "engine"
    work: dict = field(default_factory=dict)

    def request_for(self, spec: specs.EngineSpec) -> Request:
        model_file, model_format = self.model.file_for(spec)
        return dataclasses.replace(self.request, model_file=model_file, model_format=model_format)


@dataclass
class EngineRun:
    """What testbed.lab.ab reads of one run: the timed call's seconds, its count, the outputs, evidence."""

    timings: dict
    counts: object
    outputs: dict
    evidence: object


def ab_calls(w: dict, cfg: gemma.GemmaConfig, prompt, past: int, chunk: int, weights: str = "f32",
             group: int = 32, threads: int = 1, checkpoint: str | None = None,
             gguf: str | None = None) -> list[EngineCall]:
    tokens = np.asarray(prompt, np.int32)[:past + chunk]
    request = Request("chunk_prefill", tokens, None, "safetensors", weights, model_config(cfg, weights, group), past,
                      chunk, [past + chunk - 1], threads=threads, bench={"reps": 1, "warmup": 0})
    expect = Expect(cfg.vocab, cfg.layers, cfg.kv_heads, cfg.head_dim)
    model = GemmaModel(cfg, w, checkpoint, gguf, weights, group)
    return [EngineCall(f"P={past},C={chunk}/chunk_call", request, expect, model, work={"rows": chunk, "keys": past + chunk})]


def ab_run(device: Device, spec: specs.EngineSpec, call: EngineCall, program: Path) -> EngineRun:
    """One run of `call` by the engine: the bench repetition's chunk call (the last call named "chunk")."""
    from testbed.measure import counts as counting

    response = call_engine(device, spec, call.request_for(spec), call.expect, program)
    timed = [c for c in response.timings.get("calls", []) if c.get("name") == "chunk"][-1:]
    if not timed:
        raise ContractBroken(f"engine {spec.name}: timings.json has no call named \"chunk\"")
    counts = response.counts
    if counts is not None and counts.regions:  # the chunk call's count alone (the past's calls are marked too)
        counts = counting.Counts(tuple(counts.of("chunk")[-1:]), counts.total, counts.counter, counts.exact, ("chunk",))
    elif counts is not None:
        counts = None  # a process count is not a call's: ab does not judge it
    return EngineRun({"seconds": [float(timed[0]["wall_s"])], "cpu_seconds": [float(timed[0]["cpu_s"])],
                      "kernel": f"engine:{spec.name}"}, counts, {"logits": response.logits}, response.evidence)


def call_engine(device, spec, request, expect, program):
    response = call(device, spec, request, expect, program, measured=True)
    if response.refused:
        raise NotSupported(f"engine {spec.name} refused: {response.reason}")
    return response
