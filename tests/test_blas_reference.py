"""Ratios over a reference (testbed/measure/blas_reference.py): "sgemm" only where a library computed the
reference (numpy's OpenBLAS, or oneMKL where installed and faster on the shape), at the kernel's thread
count; the project's own gemm only under its own name; no target judged from a reference that spins.
No timing is asserted: speed goals live in benchmark records; the choice between libraries is tested on
recorded timings."""

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
    """Records that call something sgemm (in the case, a figure or a metric) without a library (numpy's
    OpenBLAS, or oneMKL) as the reference they name: what must never be stored."""
    bad = []
    for _, r in df[df["kind"] == "measure"].iterrows():
        named = "sgemm" in r["case"] or any(col.startswith(("figures.sgemm", "metrics.sgemm")) and r[col] == r[col]
                                            and r[col] is not None for col in df.columns)
        if not named:
            continue
        library = r.get("work.reference.internal_api")
        if library not in (numpy_blas()["internal_api"], "mkl"):
            bad.append(r["case"])
    return bad


def test_engine_bench_on_the_host_divides_by_the_best_library_on_the_engines_shapes(results_dir):
    df = run(["threads=2", *TINY_ENGINE], "engine_bench").frame()
    matmul = df[df["params.form"] == "matmul_vs_sgemm"]
    assert len(matmul) == 2 and not sgemm_labels_are_honest(df)
    for _, r in matmul.iterrows():
        assert r["work.reference.threads"] == 2
        assert r["work.reference.candidates.openblas.kernel_isa"] == blas_reference.cpu_isa()
        # the same products as the chunk call: its FLOP count; the own gemm only beside it, named
        chosen = r["work.reference.library"]
        assert blas_reference.LIBRARY_NAMES[chosen] in r["work.sgemm"] and r["work.matmul_flops"] > 0
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
    # the reference is the faster library at 2 threads; OpenBLAS, its floor, on its own kernel either way
    chosen = ratio["metrics.reference_library"]
    assert chosen == ratio["work.reference.library"] and chosen in blas_reference.LIBRARIES
    assert ratio["work.reference.candidates.openblas.version"] == numpy_blas().get("version")
    assert ratio["work.reference.candidates.openblas.kernel_isa"] == ratio["metrics.cpu_isa"] == \
        blas_reference.cpu_isa()
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


# --- the best library present, per shape (issue 45) -----------------------------------------------------

# Recorded CPU seconds per call, one per repetition, interleaved (the repetitions paired): oneMKL's
# sequential cblas_sgemm and OpenBLAS's SkylakeX kernel at 1024^3 on the Intel Xeon where MKL was
# ~1.07x faster, and on the AMD EPYC (Zen 5) where MKL runs its AVX2 Zen kernel at ~0.45x.
XEON_1024 = {"openblas": [14.1e-3, 14.6e-3, 13.9e-3, 14.4e-3, 15.2e-3, 14.0e-3, 14.3e-3],
             "mkl": [13.2e-3, 13.5e-3, 13.0e-3, 13.6e-3, 14.1e-3, 13.1e-3, 13.4e-3]}
EPYC_512 = {"openblas": [1.23e-3, 1.18e-3, 1.25e-3, 1.21e-3, 1.30e-3], "mkl": [2.93e-3, 2.88e-3, 3.02e-3, 2.90e-3,
                                                                                2.95e-3]}
# within noise: the two alternate, 2% apart by median
TIED = {"openblas": [10.0, 10.9, 9.6, 11.2, 10.1, 10.8, 9.9], "mkl": [10.5, 10.0, 10.4, 10.3, 10.9, 9.7, 10.6]}


@pytest.mark.parametrize("recorded,library,decided,faster_in", [(XEON_1024, "mkl", True, 7),
                                                                (EPYC_512, "openblas", True, 5),
                                                                (TIED, "openblas", False, None)])
def test_the_reference_is_the_faster_library_on_recorded_timings(recorded, library, decided, faster_in):
    choice = blas_reference.choose({lib: {"cpu": s, "wall": [x * 4 for x in s]} for lib, s in recorded.items()})
    assert choice["library"] == library and choice["decided"] is decided
    assert choice["over_best"][library] == 1.0 and all(x >= 1.0 for x in choice["over_best"].values())
    assert choice["medians_s"] == {lib: pytest.approx(float(np.median(s))) for lib, s in recorded.items()}
    if faster_in is not None:
        assert choice["faster_in"] == faster_in
    # the confidence is said, and an undecided choice says so (the faster median is still the reference)
    assert ("undecided" in choice["says"]) is not decided and library in choice["says"]


def test_the_reference_is_chosen_by_the_clock_asked():
    # OpenBLAS spinning at 2 threads: charged more CPU, though faster by the wall clock
    recorded = {"openblas": {"cpu": [8.5, 8.9, 8.1, 8.7, 8.6], "wall": [1.5, 1.4, 1.6, 1.5, 1.5]},
                "mkl": {"cpu": [3.1, 3.0, 3.2, 3.1, 3.0], "wall": [1.9, 2.0, 1.8, 1.9, 2.0]}}
    assert blas_reference.choose(recorded)["library"] == "mkl"
    assert blas_reference.choose(recorded, clock="wall")["library"] == "openblas"


def test_one_candidate_is_the_reference_and_says_so():
    choice = blas_reference.choose({"openblas": {"cpu": EPYC_512["openblas"]}})
    assert choice["library"] == "openblas" and "only one" in choice["says"] and choice["faster_in"] == 5


@pytest.fixture
def without_mkl(monkeypatch):
    """This machine as one without oneMKL: the reference must say which library ran, and why alone."""
    monkeypatch.setattr(blas_reference, "mkl_runtime", lambda: (None, blas_reference.MKL_MISSING))


def test_a_machine_without_mkl_says_which_reference_ran(without_mkl):
    products = blas_reference.square_products(32)
    best = blas_reference.BestReference(products, 1, 1)
    assert best.candidates == ["openblas"] and list(best.variants()) == ["sgemm (openblas)"]
    samples = {name: timer() | {} for name, timer in best.variants().items()}
    pick = best.pick({name: {clock: [x] for clock, x in clocks.items()} for name, clocks in samples.items()})
    assert pick.library == "openblas" and pick.info["missing"] == {"mkl": blas_reference.MKL_MISSING}
    assert "not installed" in pick.describe() and "testbed[perf]" in pick.describe()
    assert list(pick.info["candidates"]) == ["openblas"] and pick.rule["reference_library"] == "openblas"


def test_a_broken_mkl_is_missing_and_says_why(monkeypatch):
    """A libmkl_rt that does not load (a broken install): the reference process exits at once; the
    reference is OpenBLAS alone and says oneMKL did not run, instead of the run failing."""
    monkeypatch.setattr(blas_reference, "mkl_runtime", lambda: ("/nonexistent/libmkl_rt.so.3", "planted"))
    best = blas_reference.BestReference(blas_reference.square_products(16), 1, 1)
    assert best.candidates == ["openblas"] and best.missing["mkl"].startswith("oneMKL did not run")


def test_native_bench_without_mkl_records_openblas_as_the_reference_and_why(without_mkl, results_dir):
    df = run([*SMALL_NATIVE_BENCH, "ratios.ggml=false", "ratios.torch=false"], "native_bench").frame()
    part = df[(df["params.part"] == "ratios") & (df["kind"] == "measure")]
    assert "sgemm (mkl)" not in set(part["params.kernel"])
    reference = part[part["params.kernel"] == "sgemm"].iloc[0]
    assert reference["metrics.reference_library"] == "openblas"
    assert reference["work.reference.missing.mkl"] == blas_reference.MKL_MISSING
    ratio = part[part["params.bottom"] == "sgemm"].iloc[0]
    assert ratio["metrics.reference_library"] == "openblas" and "not installed" in ratio["work.what"]


def test_the_mkl_reference_names_its_kernel_and_computes_the_products(monkeypatch):
    if blas_reference.mkl_runtime()[0] is None:
        pytest.skip(blas_reference.MKL_MISSING)
    monkeypatch.delenv("TB_ISA", raising=False)
    info = blas_reference.blas_info(1, "mkl")
    assert info["library"] == "mkl" and info["version"][:4].isdigit() and "Math Kernel Library" in info["version_string"]
    assert info["threading_layer"] == "sequential" and info["kernel_isa"] in blas_reference.ISA_RANK
    assert info["architecture"]  # the dispatch library it loaded for this CPU (def, avx2, avx512, ...)
    # a product as numpy's matmul takes it and one as the engine's x W^T (W row-major, passed transposed)
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((5, 24), dtype=np.float32), rng.standard_normal((7, 24), dtype=np.float32)
    a = rng.standard_normal((16, 24), dtype=np.float32)
    products = [(a, x.T.copy(), None), (x, w.T, None)]
    for threads in (1, 2):
        timer = blas_reference.products_timer(products, threads, library="mkl")
        assert set(timer()) == {"wall", "cpu"}
        for (left, right, _), out in zip(products, timer.outputs()):
            np.testing.assert_allclose(out, left.astype(np.float64) @ right.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_mkls_kernel_variables_are_not_passed_on_and_avx2_is_like_for_like(monkeypatch):
    environ = {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "MKL_CBWR": "COMPATIBLE", "MKL_VERBOSE": "1", "PATH": "/bin"}
    assert blas_reference.reference_environment(environ, "mkl") == {"PATH": "/bin"} or \
        blas_reference.cpu_isa() == "scalar"
    if blas_reference.cpu_isa() != "avx512":
        pytest.skip("needs a CPU wider than AVX2")
    forced = blas_reference.reference_environment(environ | {"TB_ISA": "avx2"}, "mkl")
    assert forced["MKL_ENABLE_INSTRUCTIONS"] == "AVX2" and "MKL_CBWR" not in forced
    assert blas_reference.reference_environment({"TB_ISA": "avx2"}, "openblas")["OPENBLAS_CORETYPE"] == "Haswell"


def test_a_faster_narrower_mkl_is_the_reference_and_openblas_is_its_floor():
    """oneMKL's own dispatch on an AMD CPU is AVX2: were it the faster, it is the reference (it can only
    raise the bar); the kernel rule judged is OpenBLAS's, on its own kernel."""
    openblas = {"library": "openblas", "architecture": "SkylakeX", "kernel_isa": "avx512", "cpu_isa": "avx512",
                "target_isa": "avx512"}
    assert blas_reference.kernel_rule(openblas)["reference_kernel_narrower"] is False
    forced = openblas | {"architecture": "Haswell", "kernel_isa": "avx2", "environment": {"OPENBLAS_CORETYPE": "Haswell"}}
    rule = blas_reference.kernel_rule(forced)
    assert rule["reference_kernel_narrower"] is True and "OPENBLAS_CORETYPE=Haswell" in rule["reference_kernel_why"]
    assert "OpenBLAS" in rule["reference_kernel_why"]
