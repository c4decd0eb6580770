"""GDN through IREE: the jax graphs of graphs/gdn.py compiled for the run's target and run by the
runtime in this process (the targets that run on this machine: host, lavapipe)."""

from __future__ import annotations

from testbed.backends import EvidenceLog
from testbed.backends.refimpl.gdn import serial_in_chunks
from testbed.measure import time_alternating


class IreeGDN:
    def __init__(self, target: str, head_map: str, progress=lambda msg: None):
        from testbed.backends.iree.runtime import TargetRunner

        self.run, self.head_map = TargetRunner(target, progress=progress), head_map
        self.evidence = EvidenceLog()
        self.artifacts: dict = {"target": target}

    def serial(self, x):
        from testbed.backends.iree.graphs import gdn as graphs

        return tuple(self.run(graphs.graph("serial", x, head_map=self.head_map), *x.arrays()))

    def chunkwise(self, x, chunk: int):
        from testbed.backends.iree.graphs import gdn as graphs

        return tuple(self.run(graphs.graph("chunkwise", x, chunk, self.head_map), *x.arrays()))

    def serial_chunk_loop(self, x, chunk: int):
        return serial_in_chunks(self.serial, x, chunk)

    def bench(self, x, chunk: int, reps: int, warmup: int, between=None) -> dict:
        fns = {"serial": lambda: self.serial(x), "chunkwise": lambda: self.chunkwise(x, chunk)}
        times = time_alternating(fns | ({"between": between} if between else {}), reps=reps, warmup=warmup)
        times.pop("between", None)
        return times


def runner(cfg, device, progress=lambda msg: None) -> IreeGDN:
    return IreeGDN(cfg.target, cfg.head_map, progress)
