"""Instructions per FLOP against the ISA's FMA ideal (issue 35): native_bench on a counting device stores,
per kernel, its exact instructions per FLOP over the ideal of the ISA it ran on, and judges the goals
(tb_gemm at most 1.5x, GDN chunkwise and attention at most 2x): met, or short_by what is left."""

import pytest

from testbed.experiments import native_bench


@pytest.mark.parametrize("name,ipf,target,over,goal,short", [
    ("gemm", 0.2175, "aarch64", 1.74, 1.5, 1.16),               # the tb_gemm 128^3: 1.74x, short by 1.16
    ("gemm", 0.1875, "aarch64", 1.5, 1.5, None),                # exactly the goal: met
    ("attention keys=256", 0.25, "arm32", 2.0, 2.0, None),
    ("gdn chunkwise T=64", 0.35, "aarch64", 2.8, 2.0, 1.4),     # GDN chunkwise 2.7-2.8x: short by 1.4
    ("gdn chunkwise T=64", 1.5, "hexagon", 3.0, 2.0, 1.5),      # scalar Hexagon's ideal is 1/2
    ("gemm loop", 0.5, "aarch64", 4.0, None, None),             # the reference loop: a yardstick, no goal
])
def test_instructions_over_the_fma_ideal_are_judged(name, ipf, target, over, goal, short):
    m = native_bench.fma_ideal_metrics(name, ipf, target)
    assert m["instructions_vs_fma_ideal"] == pytest.approx(over)
    assert m["fma_ideal_instructions_per_flop"] == native_bench.FMA_IDEAL[target][0] and m["fma_ideal"]
    if goal is None:
        assert "fma_ideal_target" not in m
        return
    assert m["fma_ideal_target"] == goal and m["meets_fma_ideal_target"] is (short is None)
    assert m["fma_ideal_short_by"] == (pytest.approx(short) if short else None)
