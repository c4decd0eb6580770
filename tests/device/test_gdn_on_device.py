"""`pytest --device=NAME -m device`: the gdn experiment's whole oracle matrix (llama.cpp's 36 cases, the
awkward lengths, the mild gates) with backend=native, computed ON the selected device by the
benchmark-and-dump program built for its ABI, judged here against the float64 reference.

Each test checks the device-side evidence of every record (the program's sha256 is the one built for
the device's ABI, the device clock's seconds are there), so a computation on the host cannot pass."""

import pytest

from testbed import config, runner
from testbed.backends.native.build import build_programs, target_for_abi
from testbed.backends.native.device import program_digest

pytestmark = [pytest.mark.device, pytest.mark.requires("native")]


def run_on(device, overrides):
    rc = config.load([f"device={device.name}", "backend=native", *overrides])
    return runner.execute(rc, device=device)


def assert_computed_on(device, rows, program: str):
    expected = program_digest(build_programs(target_for_abi(device.profile.abi)) / program)
    for row in rows:
        assert row["device"] == device.name and row["emulated"] == device.profile.has("emulated")
        if row["params"].get("role") == "machine_probe":  # numpy on this host, the device itself: no program ran
            assert device.profile.transport == "local" and not row["evidence"]
            continue
        assert row["evidence"], f"{row['case']} carries no evidence"
        for ran in row["evidence"]:
            assert (ran["device"], ran["ran"], ran["sha256"]) == (device.name, program, expected)
            assert ran["device_seconds"] is not None and ran["device_seconds"] >= 0


def test_gdn_oracle_matrix_passes_on_the_device(device, results_dir):
    outcome = run_on(device, ["experiment=gdn", "mode=oracle", "matrix=all", "chunk=16"])
    oracles = [r for r in outcome.rows if r["kind"] == "oracle"]
    assert len(oracles) > 36 * 2 and outcome.failed == 0, [r["detail"] for r in oracles if r["verdict"] != "pass"][:3]
    assert {r["oracle"] for r in oracles} == {"nmse", "bitexact"}
    assert_computed_on(device, outcome.rows, "tb_gdn_bench")


def test_gdn_benchmark_times_the_kernel_with_the_devices_clock(device, results_dir):
    outcome = run_on(device, ["experiment=gdn", "mode=bench", "bench.heads=2", "bench.head_size=32",
                              "bench.tokens=[65]", "bench.reps=2", "bench.warmup=0"])
    probes = [r for r in outcome.rows if r["params"].get("role") == "machine_probe"]
    measures = [r for r in outcome.rows if r["kind"] == "measure" and r not in probes]
    assert sorted(r["params"]["form"] for r in measures) == ["chunkwise", "serial"]
    # numpy's sgemm probes the machine only where the kernels ran on it: this host, not a device
    assert len(probes) == (device.profile.transport == "local" and not device.profile.has("emulated"))
    for r in measures:
        assert r["figures"]["time"]["reps"] == 2 and r["figures"]["cpu_time"]["reps"] == 2
        # the figure is the program's own per-call time, not the command's round trip
        device_ms = sorted(1e3 * ran["device_seconds"] for ran in r["evidence"] if f"form={r['params']['form']}" in ran["command"])
        assert r["figures"]["time"]["min"] == pytest.approx(device_ms[0]) and len(device_ms) == 2
    assert_computed_on(device, outcome.rows, "tb_gdn_bench")


def test_native_bench_runs_on_the_device(device, results_dir):
    # ratios.gemm: the matrix product at 32^3, not the default 512^3 (with the reference loop beside it on
    # a counting device: about two minutes of CPU under qemu-hexagon for a figure this test does not judge)
    outcome = run_on(device, ["experiment=native_bench", "attention.past=40", "attention.chunk=8",
                              "attention.head_dim=32", "cache.window=32", "cache.real=5", "bench.reps=2",
                              "bench.warmup=0", "ratios.reps=2", "ratios.key_counts=[16,64]", "ratios.gdn.heads=2",
                              "ratios.gdn.head_size=16", "ratios.gdn.tokens=40", "ratios.gdn.chunk=16",
                              "ratios.gemm=32"])
    assert outcome.failed == 0
    attention = [r for r in outcome.rows if r["params"].get("kernel") == "attention"]
    cache = [r for r in outcome.rows if r["params"].get("kernel") == "sliding_cache"]
    assert_computed_on(device, attention, "tb_attention_bench")
    assert_computed_on(device, cache, "tb_cache_bench")
    # the ratio is the device clocks' quotient: it carries the evidence of both runs it divides
    (ratio,) = [r for r in outcome.rows if r["params"].get("kernel") == "ratio"
                and r["params"]["top"].startswith("attention") and r["params"]["bottom"].startswith("attention")]
    assert [e["ran"] for e in ratio["evidence"]] == ["tb_attention_bench"] * 2
