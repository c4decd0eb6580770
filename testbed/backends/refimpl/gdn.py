"""GDN with the numpy references, on the host: the forms under test when the question is the
algorithm itself (the chunkwise WY form against the serial recurrence), not a kernel."""

from __future__ import annotations

import numpy as np

from refimpl import gdn as ref
from testbed.backends import EvidenceLog
from testbed.measure.timing import time_alternating


class RefimplGDN:
    def __init__(self, head_map: str):
        self.head_map = head_map
        self.evidence = EvidenceLog()  # nothing ran on a device: records say device=host
        self.artifacts: dict = {}

    def serial(self, x):
        return ref.gdn_serial(*x.arrays(), head_map=self.head_map)

    def chunkwise(self, x, chunk: int):
        return ref.gdn_chunkwise(*x.arrays(), chunk=chunk, head_map=self.head_map)

    def serial_chunk_loop(self, x, chunk: int):
        return serial_in_chunks(self.serial, x, chunk)

    def bench(self, x, chunk: int, reps: int, warmup: int, between=None) -> dict:
        fns = {"serial": lambda: self.serial(x), "chunkwise": lambda: self.chunkwise(x, chunk)}
        times = time_alternating(fns | ({"between": between} if between else {}), reps=reps, warmup=warmup)
        times.pop("between", None)
        return times


def serial_in_chunks(serial, x: ref.GDNInputs, chunk: int):
    """The serial recurrence restructured as a loop over chunks that carries the state: the same
    arithmetic in the same order, so it must be bit-exact with one serial call."""
    t_len = x.q.shape[1]
    outs, state = [], x.state
    for c0 in range(0, t_len, chunk):
        sl = slice(c0, c0 + chunk)
        o, state = serial(ref.GDNInputs(x.q[:, sl], x.k[:, sl], x.v[:, sl], x.g[:, sl], x.beta[:, sl], state))
        outs.append(o)
    return np.concatenate(outs, axis=1), state


def runner(cfg, device, progress=lambda msg: None) -> RefimplGDN:
    return RefimplGDN(cfg.head_map)
