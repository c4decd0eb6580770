"""The Gemma graphs compiled with IREE (testbed.backends.iree.graphs.gemma) as a backend: `backend=iree`.

On a device (every experiment run: the host too is a Device, through its local transport) the case
runs there, one iree-run-module per graph call, on .npy files in a run folder on the device
(testbed.backends.iree.device): the host pushes the small inputs it builds for each call (tokens,
RoPE tables, masks, select: refimpl.gemma.chunk_inputs in testbed.models.contract's argument order), the K/V
a call returns stay on the device as the next call's inputs, and the host pulls only what the oracle
compares: the last chunk call's selected logits and K/V (its real and pad rows, and the cache's empty
rows between them: fewer than `iree.past_bucket`), and the last decode step's logits. The device path is used for the host as well, so a host record is made the same way as a
phone's and carries the same evidence; the in-process Python runtime (`device=None`) is kept for the
graphs' own unit tests, which call the graphs directly without files.

One module serves many past lengths: the cache is a fixed-capacity buffer of a multiple of
`iree.past_bucket` rows whose empty rows every mask hides (masked columns contribute exactly zero),
which is what a device's fixed-capacity cache does.
  - the cache of positions 0..P-1: prefill_at over the tokens zero-padded to the capacity (causal: real
    rows never see the pad tokens; the pads' rows are masked as empty);
  - chunk calls: prefill_with_past, the seed's contract unchanged, against that cache; each call's
    K/V (past rows + C) are the next call's past as they are;
  - the token-by-token path: decode_in_cache steps, each writing its row into the cache in place, so
    one module serves every step.
In-process, the empty rows sit between the past and the chunk and results come back without them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from refimpl import gemma as ref
from testbed.backends import ContractBroken, EvidenceLog, GemmaBackend, Utterance
from testbed.backends.iree.artifacts import Artifact, compile_graph
from testbed.backends.iree.device import IreeDevice, RunFolder, StagedModule, check_target_fits
from testbed.backends.iree.graphs import gemma as graphs
from testbed.backends.iree.runtime import TargetRunner, compile_progress_on_terminal
from testbed.models.contract import pack_prefill_with_past
from testbed.results import Figure


def backend(w, cfg: ref.GemmaConfig, run_cfg, device=None, progress=compile_progress_on_terminal):
    options = run_cfg.get("iree", {}) or {}
    bucket = int(options.get("past_bucket", 128))
    constants = options.get("weights", "parameters") == "constants"
    if device is not None:
        check_target_fits(run_cfg.target, device.profile)
        iree = IreeDevice(device, EvidenceLog(), int(run_cfg.get("threads", 1)), progress, options.get("driver"))
        if options.get("artifact"):  # a user's prefill_with_past module instead of testbed's graphs
            from testbed.backends.iree.user_module import UserModuleRunner, load
            from testbed.config import project_path

            return UserModuleRunner(load(project_path(options["artifact"]), cfg, run_cfg.target, progress), iree)
        return DeviceGemma(w, cfg, run_cfg.target, iree, bucket, constants, progress)
    return in_process(w, cfg, run_cfg.target, options.get("driver"), bucket, constants)


def _kv_names(tag: str, layers: int) -> tuple[list[str], list[str]]:
    return [f"{tag}_k{i}.npy" for i in range(layers)], [f"{tag}_v{i}.npy" for i in range(layers)]


def _interleaved(ks: list[str], vs: list[str]) -> list[str]:
    return [name for kv in zip(ks, vs) for name in kv]


class DeviceGemma:
    """The chunk-prefill case and its timings on one device (see the module docstring)."""

    name = "iree"

    def __init__(self, w, cfg: ref.GemmaConfig, target: str, iree: IreeDevice, bucket: int, constants: bool,
                 progress):
        self.w, self.cfg, self.target, self.iree = w, cfg, target, iree
        self.bucket, self.constants, self.progress = bucket, constants, progress
        self.artifacts: dict[str, Artifact] = {}
        self.staged: dict[str, StagedModule] = {}  # graph name -> its module on the device

    @property
    def evidence(self) -> EvidenceLog:
        return self.iree.evidence

    def module(self, graph) -> StagedModule:
        """Compiled for the target (through the artifact cache) and staged on the device, once per graph
        (a graph's name carries every shape and option its text depends on)."""
        if graph.name not in self.staged:
            artifact = compile_graph(graph, self.target, progress=self.progress)
            self.artifacts[graph.name] = artifact
            self.staged[graph.name] = self.iree.stage(artifact)
        return self.staged[graph.name]

    def capacity(self, rows: int) -> int:
        return -(-rows // self.bucket) * self.bucket

    def call(self, run: RunFolder, module: StagedModule, tag: str, args: list, outputs: list[str]) -> None:
        """One graph call: host arrays are pushed as TAG_inI.npy, names are files already on the device."""
        inputs = [a if isinstance(a, str) else run.put(f"{tag}_in{i}.npy", a) for i, a in enumerate(args)]
        self.iree.run(run, module, inputs, outputs)

    def prefill(self, run: RunFolder, tokens: np.ndarray, capacity: int) -> tuple[list[str], list[str]]:
        """The cache of positions 0..P-1 on the device, `capacity` rows (rows P.. hold pad tokens' K/V)."""
        past = tokens.size
        padded = np.zeros(capacity, np.int32)
        padded[:past] = tokens
        select = np.eye(capacity, dtype=np.float32)[past - 1]
        ks, vs = _kv_names("past", self.cfg.layers)
        self.call(run, self.module(graphs.prefill_at(self.cfg, self.w, capacity, self.constants)), "past",
                  [padded, select], ["", *_interleaved(ks, vs)])
        return ks, vs

    def utterance(self, prompt, case, build: Callable = ref.chunk_inputs) -> Utterance:
        cfg, P, n, C = self.cfg, case.past, case.tokens, case.chunk
        capacity = self.capacity(P + n)
        empty = np.full(capacity - P, -1, np.int64)
        with self.iree.folder() as run:
            past_k, past_v = self.prefill(run, np.asarray(prompt[:P]), capacity)
            positions = np.concatenate([np.arange(P), empty])  # what each cache row holds (-1 empty)
            ks, vs = past_k, past_v
            for j, start in enumerate(range(P, P + n, C)):
                part = prompt[start: min(start + C, P + n)]
                inp = build(cfg, part, positions.size, C, past_positions=positions, start=start)
                module = self.module(graphs.prefill_with_past(cfg, self.w, C, positions.size, self.constants))
                out_k, out_v = _kv_names(f"c{j}", cfg.layers)
                self.call(run, module, f"c{j}", pack_prefill_with_past(cfg, inp, ks, vs),
                          [f"c{j}_logits.npy", *_interleaved(out_k, out_v)])
                ks, vs = out_k, out_v
                positions = np.concatenate([positions, inp.positions])
            chunk_logits = run.get(f"c{j}_logits.npy")
            raw_k, raw_v = [run.get(k) for k in ks], [run.get(v) for v in vs]
            want = (cfg.kv_heads, positions.size, cfg.head_dim)
            for name, a in zip(_interleaved(ks, vs), _interleaved(raw_k, raw_v)):
                if a.shape != want:
                    raise ContractBroken(f"{name} has shape {a.shape}; the call's K/V must be {want} "
                                         f"(its past extended by the chunk's {C} rows)")
            real = np.flatnonzero(positions >= 0)  # in position order: the cache is written in order
            pads = positions.size - C + np.arange(inp.n, C)
            decode_logits = self.decode(run, prompt, P, n, capacity, past_k, past_v, build)
        return Utterance(chunk_logits, decode_logits, [k[:, real] for k in raw_k], [v[:, real] for v in raw_v],
                         [k[:, pads] for k in raw_k], [v[:, pads] for v in raw_v], inp)

    def decode(self, run: RunFolder, prompt, P: int, n: int, capacity: int, ks: list[str], vs: list[str],
               build: Callable) -> np.ndarray:
        """n decode_in_cache steps from the prefilled cache; the last step's logits. Steps alternate
        between two sets of K/V files (one step reads the other's), so the device holds two caches."""
        cfg = self.cfg
        module = self.module(graphs.decode_in_cache(cfg, self.w, capacity, self.constants))
        cache = np.concatenate([np.arange(P), np.full(capacity - P, -1, np.int64)])
        for step, pos in enumerate(range(P, P + n)):
            inp = build(cfg, prompt[pos: pos + 1], capacity, 1, past_positions=cache, start=pos)
            write = np.eye(capacity, dtype=np.float32)[pos]
            out_k, out_v = _kv_names(f"d{step % 2}", cfg.layers)
            # decode_in_cache's order: prefill_with_past's without the select, then the write row
            self.call(run, module, "step", [*pack_prefill_with_past(cfg, inp, ks, vs)[:-1], write],
                      ["decode_logits.npy", *_interleaved(out_k, out_v)])
            ks, vs = out_k, out_v
            cache[pos] = pos
        return run.get("decode_logits.npy")

    def bench(self, prompt, past: int, chunk: int, reps: int, warmup: int) -> dict:
        """One chunk call of C rows and one decode step against `past` cached positions, timed on the
        device by iree-benchmark-module, alternating (chunk, decode, chunk, ...) one repetition each;
        warm-up repetitions are run and dropped. Evidence says which timer."""
        cfg = self.cfg
        capacity = self.capacity(past + chunk)
        layout = np.concatenate([np.arange(past), np.full(capacity - past, -1, np.int64)])
        with self.iree.folder() as run:
            ks, vs = self.prefill(run, np.asarray(prompt[:past]), capacity)
            chunk_in = ref.chunk_inputs(cfg, prompt[past: past + chunk], capacity, chunk, past_positions=layout,
                                        start=past)
            step_in = ref.chunk_inputs(cfg, prompt[past: past + 1], capacity, 1, past_positions=layout, start=past)
            write = np.eye(capacity, dtype=np.float32)[past]
            forms = {
                "chunk_call": (self.module(graphs.prefill_with_past(cfg, self.w, chunk, capacity, self.constants)),
                               pack_prefill_with_past(cfg, chunk_in, ks, vs)),
                "decode_step": (self.module(graphs.decode_in_cache(cfg, self.w, capacity, self.constants)),
                                [*pack_prefill_with_past(cfg, step_in, ks, vs)[:-1], write]),
            }
            inputs = {form: [a if isinstance(a, str) else run.put(f"{form}_in{i}.npy", a) for i, a in enumerate(args)]
                      for form, (_, args) in forms.items()}
            samples: dict[str, list[float]] = {form: [] for form in forms}
            for rep in range(warmup + reps):
                for form, (module, _) in forms.items():
                    figure = self.iree.benchmark(run, module, inputs[form])
                    if rep >= warmup:
                        samples[form].append(figure.median)
        return {form: Figure.of(s, "s") for form, s in samples.items()}


def in_process(w, cfg: ref.GemmaConfig, target: str, driver: str | None, bucket: int, constants: bool) -> GemmaBackend:
    """The graphs in this process's IREE runtime, K/V handed back and forth as arrays."""
    runner = TargetRunner(target, driver)

    def with_past(inp: ref.ChunkInputs, past_k, past_v, decode: bool):
        past = past_k[0].shape[1]
        empty = -past % bucket
        padded = past + empty
        chunk = inp.tokens.size
        graph = (graphs.decode_with_past(cfg, w, padded, constants) if decode
                 else graphs.prefill_with_past(cfg, w, chunk, padded, constants))
        hidden = np.full((1, cfg.heads, chunk, empty), ref.MASKED, np.float32)
        masks = {t: np.concatenate([m[..., :past], hidden, m[..., past:]], axis=-1) for t, m in inp.masks.items()}
        rows = np.zeros((cfg.kv_heads, empty, cfg.head_dim), np.float32)
        ks = [np.concatenate([k, rows], axis=1) for k in past_k]
        vs = [np.concatenate([v, rows], axis=1) for v in past_v]
        args = pack_prefill_with_past(cfg, dataclasses.replace(inp, masks=masks), ks, vs)
        if decode:  # decode_with_past's contract: prefill_with_past's order without the select
            args = args[:-1]
        out = runner(graph, *args)
        keep = np.r_[0:past, padded:padded + chunk]
        return out[0], [k[:, keep] for k in out[1::2]], [v[:, keep] for v in out[2::2]]

    def prefill_at(tokens, row):
        tokens = np.asarray(tokens).reshape(-1)
        select = np.eye(tokens.size, dtype=np.float32)[int(row)]
        out = runner(graphs.prefill_at(cfg, w, tokens.size, constants), tokens.astype(np.int32), select)
        return out[0], list(out[1::2]), list(out[2::2])

    return GemmaBackend(
        name="iree",
        prefill_at=prefill_at,
        prefill_with_past=lambda inp, k, v: with_past(inp, k, v, decode=False),
        decode_with_past=lambda inp, k, v: with_past(inp, k, v, decode=True),
        cfg=cfg,
    )
