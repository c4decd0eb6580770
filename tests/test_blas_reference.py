"""Ratios over a reference (testbed/measure/blas_reference.py): "sgemm" only where numpy's BLAS computed the
reference, at the kernel's thread count; the project's own gemm only under its own name; no target
judged from a reference that spins. No timing is asserted: speed goals live in benchmark records."""

import numpy as np
import pandas as pd
import pytest
from threadpoolctl import threadpool_info

from testbed import config, runner
from testbed.measure import blas_reference

TINY_ENGINE = ["shape.vocab=256", "shape.hidden=64", "shape.layers=2", "shape.heads=4", "shape.kv_heads=2",
               "shape.head_dim=16", "shape.mlp=128", "chunk=16", "past=32", "bench.reps=2", "bench.warmup=0"]
SMALL_NATIVE_BENCH = ["attention.past=40", "attention.chunk=8", "attention.head_dim=32", "cache.window=32",
                      "cache.real=5", "bench.reps=1", "bench.warmup=0", "bench.cold_mb=8", "ratios.reps=2",
                      "ratios.key_counts=[16,96]", "ratios.gdn.heads=2", "ratios.gdn.head_size=32",
                      "ratios.gdn.tokens=70", "ratios.gdn.chunk=16", "ratios.sgemm=64"]


def run(overrides, experiment):
    return runner.execute(config.load(overrides, experiment=experiment))


def numpy_blas() -> dict:
    """numpy's own OpenBLAS: the one its wheel ships in numpy.libs."""
    return next(m for m in threadpool_info() if m["user_api"] == "blas" and "/numpy.libs/" in m["filepath"])


def test_the_reference_is_labelled_with_numpys_blas_when_another_is_loaded():
    """scipy's wheel ships its own OpenBLAS (another version); once scipy is imported (transformers
    does, for the torch reference) threadpoolctl may list it first. The record must still name
    numpy's, the library that computed the reference (in its own process, where numpy's is the only one)."""
    pytest.importorskip("scipy.linalg")
    info = blas_reference.blas_info(1)
    assert info["version"] == numpy_blas()["version"] and info["libraries"] == 1
    blas = [m for m in threadpool_info() if m["user_api"] == "blas"]
    others = [m for m in blas if "/numpy.libs/" not in m["filepath"]]
    if others:  # whatever order threadpoolctl lists them in
        assert blas_reference.numpy_first(list(reversed(blas)))[0]["filepath"] == numpy_blas()["filepath"]


# --- the best kernel, whatever the environment says (issue 35) -----------------------------------------


def test_the_reference_runs_the_cpus_own_kernel_whatever_the_environment_forces(monkeypatch):
    # this machine's environment (and CI's) forces the AVX2 kernel on an AVX-512 CPU
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "512")
    monkeypatch.delenv("TB_ISA", raising=False)
    info = blas_reference.blas_info(1)
    assert info["kernel_isa"] == info["cpu_isa"] == blas_reference.cpu_isa()
    assert "OPENBLAS_CORETYPE" not in info.get("environment", {})
    assert info["environment_removed"] == {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "512"}
    rule = blas_reference.kernel_rule(info)
    assert rule["reference_kernel_narrower"] is False and rule["reference_kernel"] == info["architecture"]


def test_a_reference_that_honours_a_forced_narrower_kernel_judges_no_target(monkeypatch):
    """The planted bug: the reference process passes the environment's OPENBLAS_CORETYPE on (as the
    in-process reference did). On an AVX-512 or AVX2 CPU the forced kernel is narrower: refused."""
    if blas_reference.ISA_RANK[blas_reference.cpu_isa()] <= blas_reference.ISA_RANK["sse"]:
        pytest.skip(f"this CPU's widest ISA is {blas_reference.cpu_isa()}: no narrower OpenBLAS kernel to force")
    monkeypatch.setattr(blas_reference, "KERNEL_VARIABLES", ())
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Prescott")  # an SSE kernel, narrower than any AVX CPU's
    monkeypatch.delenv("TB_ISA", raising=False)
    info = blas_reference.blas_info(1)
    assert info["kernel_isa"] == "sse"
    spin = blas_reference.spinning(2.5e-3, 2.5e-3, 1) | blas_reference.kernel_rule(info)
    metrics = blas_reference.judge(0.8, {"cpu": 0.9, "wall": 0.9}, spin, threads=1)
    assert metrics["meets_target_cpu"] is None and metrics["reference_kernel_narrower"] is True
    assert "sse" in metrics["target_refused"] and "OPENBLAS_CORETYPE=Prescott" in metrics["target_refused"]


@pytest.mark.parametrize("kernel,cpu,target,narrower", [("Haswell", "avx512", "avx512", True),
                                                        ("SkylakeX", "avx512", "avx512", False),
                                                        ("Haswell", "avx512", "avx2", False),
                                                        ("Haswell", "avx2", "avx2", False),
                                                        ("NoSuchCore", "avx2", "avx2", True)])
def test_kernel_rule_by_isa(kernel, cpu, target, narrower):
    info = {"architecture": kernel, "kernel_isa": blas_reference.kernel_isa(kernel), "cpu_isa": cpu,
            "target_isa": target}
    rule = blas_reference.kernel_rule(info)
    assert rule["reference_kernel_narrower"] is narrower
    assert (blas_reference.refusal(rule, 1) is not None) is narrower


def test_a_target_forced_onto_avx2_is_judged_against_openblass_avx2_kernel(monkeypatch):
    if blas_reference.cpu_isa() != "avx512":
        pytest.skip("needs a CPU wider than AVX2")
    monkeypatch.setenv("TB_ISA", "avx2")
    info = blas_reference.blas_info(1)
    assert info["architecture"] == "Haswell" and info["target_isa"] == "avx2"
    assert blas_reference.kernel_rule(info)["reference_kernel_narrower"] is False


def test_cpu_isa_reads_the_widest_flag(tmp_path):
    for i, (flags, isa) in enumerate((("fpu sse2 avx avx2 fma avx512f", "avx512"), ("sse2 avx avx2 fma", "avx2"),
                                      ("sse2 avx avx2", "avx"), ("fp asimd", "neon"))):
        f = tmp_path / f"cpuinfo{i}"
        f.write_text(f"processor : 0\n{'Features' if 'asimd' in flags else 'flags'}\t\t: {flags}\n")
        assert blas_reference.cpu_isa(str(f)) == isa


# --- the spinning rule, fed figures -------------------------------------------------------------------


def test_a_reference_that_spins_judges_no_target():
    # OpenBLAS on 2 threads of a busy host: 8.5 ms of CPU per call where one thread takes 2.5 ms
    spin = blas_reference.spinning(8.5e-3, 2.5e-3, threads=2)
    assert spin["reference_spinning"] is True
    assert spin["reference_cpu_per_call_s"] == 8.5e-3 and spin["reference_cpu_per_call_1thread_s"] == 2.5e-3
    assert spin["reference_cpu_over_1thread"] == pytest.approx(3.4)
    metrics = blas_reference.judge(0.7, {"cpu": 3.8, "wall": 1.1}, spin, threads=2)
    assert metrics["meets_target_cpu"] is None and metrics["meets_target_wall"] is None
    assert "spins" in metrics["target_refused"] and "3.40x" in metrics["target_refused"]
    assert metrics["reference_spinning"] is True and metrics["target"] == 0.7


@pytest.mark.parametrize("cpu_n,threads", [(2.9e-3, 2), (3.0e-3, 2), (9.0e-3, 1)])
def test_a_reference_within_the_limit_is_judged(cpu_n, threads):
    # 1.16x and exactly 1.2x are within the limit; one thread has nothing to spin
    spin = blas_reference.spinning(cpu_n, 2.5e-3, threads)
    assert spin["reference_spinning"] is False
    metrics = blas_reference.judge(0.7, {"cpu": 0.75, "wall": 0.5}, spin, threads)
    assert metrics["meets_target_cpu"] is True and metrics["meets_target_wall"] is False
    assert "target_refused" not in metrics


def test_blas_info_names_what_the_reference_runs():
    info = blas_reference.blas_info(2)
    blas = numpy_blas()
    for key in ("internal_api", "version"):
        assert info[key] == blas.get(key)
    assert info["architecture"] and info["threads"] == 2 and "user_api='blas'" in info["limit"]


def test_the_reference_runs_under_the_limit_and_gives_it_back():
    before = blas_reference.blas_info()["num_threads"]
    products = blas_reference.square_products(48)
    for threads in (1, 2):
        timer = blas_reference.products_timer(products, threads)
        clocks = timer()
        assert set(clocks) == {"wall", "cpu"}
        a, b, _ = products[0]
        np.testing.assert_allclose(timer.outputs()[0], a.astype(np.float64) @ b.astype(np.float64), rtol=1e-4,
                                   atol=1e-3)
    assert blas_reference.blas_info()["num_threads"] == before


# --- the experiments' records ------------------------------------------------------------------------------


def sgemm_labels_are_honest(df) -> list[str]:
    """Records that call something sgemm (in the case, a figure or a metric) without numpy's BLAS as
    the reference they name: what must never be stored."""
    bad = []
    for _, r in df[df["kind"] == "measure"].iterrows():
        named = "sgemm" in r["case"] or any(col.startswith(("figures.sgemm", "metrics.sgemm")) and r[col] == r[col]
                                            and r[col] is not None for col in df.columns)
        if not named:
            continue
        library = r.get("work.reference.internal_api")
        if library != numpy_blas()["internal_api"]:
            bad.append(r["case"])
    return bad


def test_engine_bench_on_the_host_divides_by_openblas_on_the_engines_shapes(results_dir):
    df = run(["threads=2", *TINY_ENGINE], "engine_bench").frame()
    matmul = df[df["params.form"] == "matmul_vs_sgemm"]
    assert len(matmul) == 2 and not sgemm_labels_are_honest(df)
    for _, r in matmul.iterrows():
        assert r["work.reference.threads"] == 2 and r["work.reference.kernel_isa"] == blas_reference.cpu_isa()
        # the same products as the chunk call: its FLOP count; the own gemm only beside it, named
        assert "numpy" in r["work.sgemm"] and r["work.matmul_flops"] > 0
        assert r["figures.sgemm.median"] != r["figures.own_gemm.median"]
        assert r["figures.ratio.median"] == pytest.approx(r["figures.matmul.median"] / r["figures.sgemm.median"],
                                                          rel=0.5)
        # the spinning rule's figures are stored; a target is judged only when it does not spin
        assert r["metrics.reference_cpu_per_call_1thread_s"] > 0
        clock = r["params.clock"]
        if r["metrics.reference_spinning"]:
            assert pd.isna(r[f"metrics.meets_target_{clock}"]) and "spins" in r["metrics.target_refused"]
        else:
            assert r[f"metrics.meets_target_{clock}"] in (True, False)


def test_engine_bench_on_a_device_names_its_own_gemm(results_dir):
    from testbed.backends.native import programs as native_programs

    missing = native_programs.emulator_missing("aarch64")
    if missing:
        pytest.skip(missing)
    df = run(["device=qemu-aarch64", *TINY_ENGINE], "engine_bench").frame()
    measured = df[df["kind"] == "measure"]
    assert not sgemm_labels_are_honest(df)
    assert not any("sgemm" in c for c in measured["case"])
    assert not any(c.startswith(("figures.sgemm", "metrics.sgemm")) and measured[c].notna().any()
                   for c in measured.columns)
    own = measured[measured["params.form"] == "matmul_vs_own_gemm"]
    assert len(own) == 2 and (own["figures.own_gemm.median"] > 0).all()
    assert own["metrics.target"].isna().all() and (own["metrics.reference"] == "own_gemm").all()


def test_native_bench_at_two_threads_records_the_reference_and_its_spinning(results_dir):
    df = run(["threads=2", *SMALL_NATIVE_BENCH], "native_bench").frame()
    part = df[(df["params.part"] == "ratios") & (df["kind"] == "measure")]
    assert set(part["params.kernel"]) >= {"sgemm", "sgemm 1 thread"}
    assert not sgemm_labels_are_honest(df)
    ratio = part[part["params.bottom"] == "sgemm"].iloc[0]
    for key in ("internal_api", "version"):
        assert ratio[f"work.reference.{key}"] == numpy_blas().get(key)
    assert ratio["work.reference.kernel_isa"] == ratio["metrics.cpu_isa"] == blas_reference.cpu_isa()
    assert ratio["work.reference.threads"] == 2
    spins = ratio["metrics.reference_spinning"]
    over = ratio["metrics.reference_cpu_per_call_s"] / ratio["metrics.reference_cpu_per_call_1thread_s"]
    assert spins == (over > blas_reference.SPIN_LIMIT)
    for clock in ("cpu", "wall"):
        assert pd.isna(ratio[f"metrics.meets_target_{clock}"]) == bool(spins)
    # the attention ratio has no library under it: judged as before
    keys = part[part["params.bottom"] == "attention keys=16"].iloc[0]
    assert keys["metrics.meets_target_cpu"] in (True, False)


@pytest.mark.parametrize("ratio,target,at_most,short", [(0.6, 0.75, False, 1.25), (0.8, 0.75, False, None),
                                                         (1.5, 1.25, True, 1.2), (1.25, 1.25, True, None)])
def test_a_missed_target_says_by_how_much(ratio, target, at_most, short):
    got = blas_reference.shortfall(ratio, target, at_most)
    assert got == pytest.approx(short) if short else got is None
