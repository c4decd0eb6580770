"""Gated DeltaNet through IREE ON a device (the jax graphs of testbed.backends.iree.graphs.gdn): the
entry point `runner(cfg, device, progress) -> GDNRunner` of testbed.backends.

Each form is one iree-run-module on the device (testbed.backends.iree.device): the inputs pushed as
.npy, out and the final state pulled. serial_chunk_loop runs the serial graph chunk by chunk, the
state one call returns staying on the device as the next call's input, so it restructures only the
loop around the same per-token recurrence. bench times the serial and chunkwise forms on the device
with iree-benchmark-module, alternating one repetition each.
"""

from __future__ import annotations

import numpy as np

from refimpl import gdn as ref
from testbed.backends import EvidenceLog
from testbed.backends.iree.artifacts import Artifact, compile_graph
from testbed.backends.iree.device import IreeDevice, RunFolder, StagedModule, check_target_fits, file_digest
from testbed.backends.iree.graphs import gdn as graphs
from testbed.backends.iree.graphs.gdn import ARG_NAMES
from testbed.backends.iree.runtime import compile_progress_on_terminal
from testbed.results import Figure


def runner(cfg, device, progress=compile_progress_on_terminal) -> "IreeGDN":
    check_target_fits(cfg.target, device.profile)
    iree = IreeDevice(device, EvidenceLog(), int(cfg.get("threads", 1)), progress)
    return IreeGDN(cfg.target, cfg.get("head_map", "tiled"), iree, progress)


class IreeGDN:
    def __init__(self, target: str, head_map: str, iree: IreeDevice, progress=lambda msg: None):
        self.target, self.head_map, self.iree, self.progress = target, head_map, iree, progress
        self.compiled: dict[str, Artifact] = {}
        self.staged: dict[str, StagedModule] = {}  # graph name -> its module on the device

    @property
    def artifacts(self) -> dict:
        """What the records name: the target and each compiled module's sha256."""
        return {"target": self.target, **{f"module:{name}": file_digest(a.module) for name, a in self.compiled.items()}}

    @property
    def evidence(self) -> EvidenceLog:
        return self.iree.evidence

    def module(self, form: str, x: ref.GDNInputs, chunk: int = 64) -> StagedModule:
        graph = graphs.graph(form, x, chunk, self.head_map)
        if graph.name not in self.staged:
            artifact = compile_graph(graph, self.target, progress=self.progress)
            self.compiled[graph.name] = artifact
            self.staged[graph.name] = self.iree.stage(artifact)
        return self.staged[graph.name]

    def _once(self, module: StagedModule, x: ref.GDNInputs) -> tuple[np.ndarray, np.ndarray]:
        with self.iree.folder() as run:
            self.iree.run(run, module, self._put(run, "", x.arrays()), ["out.npy", "state_out.npy"])
            return run.get("out.npy"), run.get("state_out.npy")

    @staticmethod
    def _put(run: RunFolder, tag: str, arrays) -> list[str]:
        return [a if isinstance(a, str) else run.put(f"{tag}{name}.npy", a) for name, a in zip(ARG_NAMES, arrays)]

    def serial(self, x: ref.GDNInputs) -> tuple[np.ndarray, np.ndarray]:
        return self._once(self.module("serial", x), x)

    def chunkwise(self, x: ref.GDNInputs, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        return self._once(self.module("chunkwise", x, chunk), x)

    def serial_chunk_loop(self, x: ref.GDNInputs, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = x.q.shape[1]
        outs = []
        with self.iree.folder() as run:
            state = x.state
            for j, start in enumerate(range(0, tokens, chunk)):
                part = ref.GDNInputs(*(a[:, start:start + chunk] for a in x.arrays()[:5]), x.state)
                inputs = self._put(run, f"c{j}_", (*part.arrays()[:5], state))
                self.iree.run(run, self.module("serial", part), inputs, [f"c{j}_out.npy", f"c{j}_state.npy"])
                state = f"c{j}_state.npy"  # stays on the device: the next chunk's input
                outs.append(run.get(f"c{j}_out.npy"))
            return np.concatenate(outs, axis=1), run.get(state)

    def bench(self, x: ref.GDNInputs, chunk: int, reps: int, warmup: int, between=None) -> dict:
        forms = {"serial": self.module("serial", x), "chunkwise": self.module("chunkwise", x, chunk)}
        samples: dict[str, list[float]] = {form: [] for form in forms}
        with self.iree.folder() as run:
            inputs = self._put(run, "", x.arrays())
            for rep in range(warmup + reps):
                for form, module in forms.items():
                    figure = self.iree.benchmark(run, module, inputs)
                    if rep >= warmup:
                        samples[form].append(figure.median)
                if between is not None and rep >= warmup:
                    between()
        return {form: Figure.of(s, "s") for form, s in samples.items()}
