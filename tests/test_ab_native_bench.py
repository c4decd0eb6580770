"""`testbed ab A B experiment=native_bench` (issue 45): the kernels native_bench's ratios time (chunk
attention per key count, GDN chunkwise per length and gate, tb_gemm) measured on both trees interleaved,
in the build the experiment's `fused` asks for: a change to a kernel is A/B'd as the ratios run it."""

import json
import os
import subprocess
import sys

import pytest

SMALL = ["experiment=native_bench", "ratios.key_counts=[16,48]", "attention.head_dim=32", "attention.chunk=8",
         "attention.past=40", "cache.window=32", "cache.real=5", "ratios.gdn.heads=2", "ratios.gdn.head_size=32",
         "ratios.gdn.tokens=40", "ratios.gdn.chunk=16", "ratios.gemm=48", "bench.warmup=0"]


@pytest.mark.parametrize("fused", [True, False])
def test_native_benchs_kernels_are_ab_calls_in_the_build_fused_asks_for(tmp_path, fused):
    env = {**os.environ, "TESTBED_RESULTS": str(tmp_path / "results")}
    p = subprocess.run([sys.executable, "-m", "testbed", "ab", "HEAD", "HEAD", *SMALL, f"fused={str(fused).lower()}",
                        "--reps", "1", "--format", "json"], capture_output=True, text=True, env=env, timeout=1200)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = {r["call"]: r for r in json.loads(p.stdout)["rows"]}
    assert set(rows) == {"attention keys=16", "attention keys=48", "gdn chunkwise T=40", "gdn chunkwise T=40 kda",
                         "gemm"}
    assert rows["attention keys=48"]["kernel"] == "tb_attention" and rows["gemm"]["kernel"] == "tb_gemm"
    assert rows["gdn chunkwise T=40 kda"]["kernel"] == "tb_gdn_chunkwise"
    records = [json.loads(line) for line in (tmp_path / "results" / "records.jsonl").read_text().splitlines()
               if '"ab/' in line]
    builds = {r["artifacts"]["a_programs"] for r in records} | {r["artifacts"]["b_programs"] for r in records}
    assert builds and all(("-fused-" in b) is fused for b in builds), builds
