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
from testbed.backends import EvidenceLog, TokenCase, Utterance
from testbed.backends.native import build as kernel_build, engine
from testbed.backends.native.device import NativeJob, run_native
from testbed.devices import Device
from testbed.oracles.numerical import Verdict, check_nmse, head_biased_mask
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
    counts: bool = False         # on the host: the bench's calls counted once more under valgrind
    fused: bool = False          # the FMA build (judged by tolerance) instead of the bit-exact one
    name: str = "native"
    evidence: EvidenceLog = field(default_factory=EvidenceLog)

    def _run(self, prompt, case, **timing) -> engine.ChunkRun:
        run = engine.chunk_prefill(self.device, self.cfg, self.w, prompt, case, weights_dtype=self.weights_dtype,
                                   group=self.weights_group, threads=self.threads,
                                   program=self.program or engine.program_for(self.device, self.fused), **timing)
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

    def mask_heads(self, case, seed: int = 0) -> Verdict:
        """The engine builds its masks itself, the same for every head, so a kernel that reads every
        head's mask rows from one head (a head stride of 0) passes every utterance. So the attention
        kernel the engine calls is also run on the device (tb_attention_bench, same kernels/) at the
        model's shape and the case's P and C with masks that differ per head (head_biased_mask): the
        chunk call's rows and the C decode steps, each against refimpl.gemma.attention in float64
        (NMSE). Verdict mask_heads; the worse form's margin."""
        c = self.cfg
        rng = np.random.default_rng(seed)
        keys = case.past + case.chunk
        q = rng.standard_normal((c.heads, case.chunk, c.head_dim)).astype(np.float32)
        k, v = (rng.standard_normal((c.kv_heads, keys, c.head_dim)).astype(np.float32) for _ in range(2))
        queries, positions = np.arange(case.past, keys), np.arange(keys)
        mask = head_biased_mask(gemma.attention_mask(queries, positions, c.window, c.heads, "global"), queries, positions)
        want = gemma.attention(*(a.astype(np.float64) for a in (q, k, v, mask)), 1 / np.sqrt(c.head_dim))
        program = kernel_build.build_programs(kernel_build.target_for_abi(self.device.profile.abi),
                                              fused=self.fused) / "tb_attention_bench"
        verdicts = {}
        for form in ("chunk", "decode_steps"):
            result = run_native(self.device, NativeJob(program, {"q": q, "k": k, "v": v, "mask": mask}, ["out"],
                                                       [".", ".", f"form={form}", f"threads={self.threads}",
                                                        "warmup=0", "reps=1"], measured=False,
                                                       shapes={"out": q.shape}))
            self.evidence.add(result.evidence)
            verdicts[form] = check_nmse({"out": want}, {"out": result.outputs["out"]})
        worst = min(verdicts.values(), key=lambda x: x.margin if x.margin is not None else -np.inf)
        failed = [f"{form}: {x.detail}" for form, x in verdicts.items() if not x.passed]
        return Verdict("mask_heads", not failed, worst.margin,
                       {f"{form}.{key}": value for form, x in verdicts.items() for key, value in x.metrics.items()},
                       "with masks that differ per head the attention kernel differs from refimpl.gemma's: "
                       + "; ".join(failed) if failed else "")

    def bench(self, prompt, past: int, chunk: int, reps: int, warmup: int) -> dict:
        """One chunk call of C rows and one decode step against `past` cached positions, interleaved,
        timed by the program on the device. Instructions per call on a device that counts, and on the
        host with `counts` from one more run under valgrind (apart from the timed ones)."""
        case = TokenCase(past, chunk, chunk)
        run = self._run(prompt, case, reps=reps, warmup=warmup)
        times = {"chunk_call": Figure.of(run.timings["seconds"], "s"),
                 "decode_step": Figure.of(run.timings["decode_seconds"], "s"),
                 "chunk_call_cpu": Figure.of(run.timings["cpu_seconds"], "s"),
                 "decode_step_cpu": Figure.of(run.timings["decode_cpu_seconds"], "s")}
        counted = run.counts
        if counted is None and self.counts and not self.device.profile.has("counts"):
            counted = self._run(prompt, case, reps=1, warmup=0, count=True).counts
        if counted:  # each call's instructions, exact
            times |= {"chunk_call_instructions": Figure.of(counted.of("chunk"), "instructions"),
                      "decode_step_instructions": Figure.of(counted.of("decode"), "instructions")}
        return times


def backend(w, cfg, run_cfg=None, device: Device | None = None, progress=None) -> EngineRunner:
    def option(key, default):
        return OmegaConf.select(run_cfg, key, default=default) if run_cfg is not None else default

    if device is None:
        raise ValueError("the native engine runs on a device: pass the connected Device")
    dtype, group = option("native.weights", "f32"), int(option("native.group", 32))
    return EngineRunner(w, cfg, device, int(option("threads", 1)), dtype, group, counts=bool(option("counts", False)),
                        fused=bool(option("fused", False)))
