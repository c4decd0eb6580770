"""refimpl.gdn's reduced-precision chunkwise products (an NPU matrix unit's fp16 tiles): they drift
from f32 by the amounts fp16 rounding explains, fp16 accumulation more than f32 accumulation."""

import numpy as np
import pytest

from refimpl import gdn
from testbed.oracles.numerical import nmse


@pytest.fixture(scope="module")
def run():
    x = gdn.draw_inputs(1, 150, 2, 32, v_repeat=2, gate="mild")
    return {p: gdn.gdn_chunkwise(*x.arrays(), chunk=64, precision=p) for p in gdn.PRECISIONS}


def test_f32_is_the_default(run):
    x = gdn.draw_inputs(1, 150, 2, 32, v_repeat=2, gate="mild")
    out, state = gdn.gdn_chunkwise(*x.arrays(), chunk=64)
    assert np.array_equal(out, run["f32"][0]) and np.array_equal(state, run["f32"][1])


def test_fp16_drift_is_fp16_sized_and_accumulation_adds_to_it(run):
    ref_out = run["f32"][0]
    acc32, acc16 = nmse(ref_out, run["fp16-acc32"][0]), nmse(ref_out, run["fp16-acc16"][0])
    # fp16 has an 11-bit significand: relative errors ~ 2^-11 per rounding, NMSE ~ 1e-7 .. 1e-4
    assert 1e-9 < acc32 < 1e-4 and acc32 < acc16 < 1e-3


def test_unknown_precision_is_refused():
    x = gdn.draw_inputs(1, 4, 1, 8)
    with pytest.raises(ValueError, match="precision 'bf16' is not one of"):
        gdn.gdn_chunkwise(*x.arrays(), precision="bf16")
