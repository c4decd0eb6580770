"""The native backend's chunk prefill with past (experiment chunk_prefill): the model engine in C
(engine.py, kernels/tb_model.h) runs each utterance whole on the device, the KV cache staying there;
the logits and K/V the token oracle compares are pulled at the end.

The engine builds its masks and RoPE tables from positions, as refimpl.gemma.chunk_inputs does (the
contract's ground truth); the host still builds the last call's inputs with `build`, which tell the
oracle what that call's pad rows must hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from refimpl import gemma
from testbed.backends import EvidenceLog, Utterance
from testbed.backends.native import engine
from testbed.devices import Device
from testbed.results import Figure


@dataclass
class EngineRunner:
    w: dict
    cfg: gemma.GemmaConfig
    device: Device
    threads: int = 1
    weights_dtype: str = "f32"
    weights_group: int = 32
    program: Path | None = None  # another build of the engine program (the tests' planted bugs)
    name: str = "native"
    evidence: EvidenceLog = field(default_factory=EvidenceLog)

    def _run(self, prompt, case, **timing) -> engine.ChunkRun:
        run = engine.chunk_prefill(self.device, self.cfg, self.w, prompt, case, weights_dtype=self.weights_dtype,
                                   group=self.weights_group, threads=self.threads, program=self.program, **timing)
        self.evidence.add(run.evidence)
        return run

    def utterance(self, prompt, case, build=gemma.chunk_inputs) -> Utterance:
        run = self._run(prompt, case)
        real = case.past + case.tokens
        last_start = case.past + (case.calls - 1) * case.chunk
        last = build(self.cfg, np.asarray(prompt)[last_start:real], last_start, case.chunk,
                     past_positions=np.arange(last_start))
        return Utterance(run.call_logits[-1], run.decode_logits, [k[:, :real] for k in run.k],
                         [v[:, :real] for v in run.v], [k[:, real:] for k in run.k], [v[:, real:] for v in run.v], last)

    def bench(self, prompt, past: int, chunk: int, reps: int, warmup: int) -> dict:
        """One chunk call of C rows and one decode step against `past` cached positions, interleaved,
        timed by the program on the device."""
        from testbed.token_oracle import TokenCase

        run = self._run(prompt, TokenCase(past, chunk, chunk), reps=reps, warmup=warmup)
        times = {"chunk_call": Figure.of(run.timings["seconds"], "s"),
                 "decode_step": Figure.of(run.timings["decode_seconds"], "s")}
        if run.counts:  # a device that counts: each call's instructions, exact
            times |= {"chunk_call_instructions": Figure.of(run.counts.of("chunk"), "instructions"),
                      "decode_step_instructions": Figure.of(run.counts.of("decode"), "instructions")}
        return times


def backend(w, cfg, run_cfg=None, device: Device | None = None) -> EngineRunner:
    def option(key, default):
        return OmegaConf.select(run_cfg, key, default=default) if run_cfg is not None else default

    if device is None:
        raise ValueError("the native engine runs on a device: pass the connected Device")
    dtype, group = option("native.weights", "f32"), int(option("native.group", 32))
    return EngineRunner(w, cfg, device, int(option("threads", 1)), dtype, group)
