"""ggml's GATED_DELTA_NET judged by testbed's own reference: the oracle test-backend-ops lacks on a CPU.

test-backend-ops judges a backend by comparing it with ggml's CPU backend. Asked about the CPU backend
itself (`-b CPU`, all an emulated aarch64 device or a phone without an NPU offers), it compares ggml
with ggml and passes whatever the CPU op computes: a bug in ggml's CPU GATED_DELTA_NET is invisible
to it. Here the op runs on the device in tb_ggml_gdn (built by testbed.backends.llamacpp.build against
the same ggml), over testbed's case matrix (llama.cpp's 36 cases and the awkward lengths with gates
that keep the state alive), and refimpl.gdn's serial recurrence in float64 judges its outputs, final
state and snapshots by NMSE (threshold 1e-7, test-backend-ops' own). Each record's `oracle` names
which oracle gave its verdict: "nmse" (this one, against refimpl) or "test-backend-ops".

tb_ggml_gdn builds contiguous tensors: strided (permuted) q/k/v are test-backend-ops' concern, so a
permuted case here checks the values of its logical shape only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from refimpl import gdn as ref
from testbed.backends.native.device import NativeJob, run_native
from testbed.devices import Device
from testbed.oracles.numerical import NMSE_THRESHOLD, check_nmse
from testbed.results import Record

INPUTS = ("q", "k", "v", "g", "beta", "state")
REFERENCE = "refimpl.gdn.gdn_serial in float64"


def ggml_outputs(device: Device, program: Path, x: ref.GDNInputs, K: int) -> tuple[dict[str, np.ndarray], dict]:
    """ggml's outputs for one call, named as refimpl.gdn.run_forms names them."""
    names = ["out", "state"] + (["snapshots"] if K > 1 else [])
    result = run_native(device, NativeJob(program, dict(zip(INPUTS, x.arrays())), names, ["{inputs}", ".", f"K={K}"],
                                          measured=False))
    return result.outputs, result.evidence.as_dict()


def oracle_records(experiment: str, device: Device, program: Path, cases, seed: int = 0,
                   threshold: float = NMSE_THRESHOLD, progress: Callable[[str], None] = lambda m: None,
                   artifacts: dict | None = None) -> Iterator[Record]:
    """One record per case: ggml's op on `device` against the float64 reference."""
    for i, case in enumerate(cases):
        progress(f"ggml GATED_DELTA_NET vs refimpl {i + 1}/{len(cases)} {case.name}")
        x = case.inputs(seed)
        x64 = ref.GDNInputs(*(a.astype(np.float64) for a in x.arrays()))
        reference = ref.run_forms(lambda y: ref.gdn_serial(*y.arrays()), x64, case.K)
        got, evidence = ggml_outputs(device, program, x, case.K)
        v = check_nmse(reference, got, threshold)
        yield Record(experiment, f"{case.name}/ggml-CPU", "oracle", v.oracle, v.verdict, v.margin, v.metrics,
                     params={**case.__dict__, "op": "GATED_DELTA_NET", "backend": "CPU", "reference": REFERENCE},
                     artifacts=dict(artifacts or {}), detail=v.detail, evidence=[evidence])
