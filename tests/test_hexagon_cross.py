"""kernels/ built by zig (`pip install 'testbed[cross]'`): for Hexagon (hexagon-linux-musl, core v67,
run under qemu-hexagon) and as static-musl arm32 (ARMv7-A NEON, hard float) and aarch64 programs (run
under qemu-arm / qemu-aarch64), each compared byte for byte with the host build (glibc, AVX2) and by
NMSE with the float64 reference: GDN serial and chunkwise over llama.cpp's 36 cases and the awkward
ones, attention, the sliding-cache ops, and the model engine (chunk calls, and a padded tail rolled
back on int8 caches). FUSED=0 and -ffp-contract=off make every target round the same operations the
same way; the kernels take no libm function whose result differs between glibc and musl (their exp
and tanh are tb_simd.h's own; sqrtf and rintf are exact everywhere). The one libm dependency left is
the engine's RoPE table (double pow, cos, sin rounded to float32): checked here for every position a
run may use.

Where Hexagon and the others differ the test says which op, by how many ulps, and why: none differ.
The default run compares the Hexagon build, on a third of the GDN matrix (emulated Hexagon floating
point is slow); `pytest -m slow_build` adds the whole matrix and the static-musl ARM builds.
The programs are ELF for the right machine (Hexagon: e_machine 164, "QUALCOMM DSP6"), and say which
toolchain built them (build.json). Timings under emulation are never used."""

import json
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from refimpl import gemma
from testbed.backends.native import build as kernel_build, engine, programs as native_programs
from testbed.devices.transport import elf_machine
from testbed.oracles.numerical import check_bitexact, check_nmse
from tests.native_support import GDN_CASES, reference64
from tests.test_native import attention_inputs
from tests.test_native_cross import _cache_case_arrays
from testbed.oracles.tail import HEAD_DIM, grid

# name -> (build target, toolchain); the emulator follows the build target
BUILDS = {"hexagon": ("hexagon", "zig"), "arm32-musl": ("arm32", "zig"), "aarch64-musl": ("aarch64", "zig")}
GDN_FORMS = (("serial", 64), ("chunkwise", 16))


def _build(name):
    target, toolchain = BUILDS.get(name, (name, None))
    missing = native_programs.emulator_missing(target)
    if missing:
        return missing
    try:
        return kernel_build.build_programs(target, toolchain=toolchain)
    except kernel_build.BuildError as e:
        return str(e)


class Builds(dict):
    """Each build made at first use (zig builds musl once per target, then reuses it): the default run
    needs the host's and Hexagon's only; the static-musl ARM builds come with -m slow_build."""

    def __missing__(self, name):
        self[name] = _build(name)
        return self[name]


@pytest.fixture(scope="module")
def programs():
    built = Builds()
    with ThreadPoolExecutor(2) as pool:
        for name, result in zip(("host", "hexagon"), pool.map(_build, ("host", "hexagon"))):
            built[name] = result
    if isinstance(built["host"], str):
        pytest.skip(built["host"])
    return built


def need(programs, name):
    if isinstance(programs[name], str):
        pytest.skip(f"{name}: {programs[name]}")
    return programs[name], BUILDS[name][0]


# The default run: Hexagon; the static-musl arm32/aarch64 builds (another 2 min of cold builds) with
# -m slow_build (Debian's gcc builds for them are compared in every run by tests/test_native_cross.py).
NAMES = ["hexagon", pytest.param("arm32-musl", marks=pytest.mark.slow_build),
         pytest.param("aarch64-musl", marks=pytest.mark.slow_build)]


@pytest.mark.parametrize("name", NAMES)
def test_each_build_is_an_elf_for_its_machine_and_says_what_built_it(programs, name):
    folder, target = need(programs, name)
    info = json.loads((folder / "build.json").read_text())
    assert info["toolchain"] == "zig" and info["compiler"].startswith("zig 0.") and "musl" in info["libc"]
    for program in kernel_build.PROGRAMS:
        assert elf_machine(folder / program) == kernel_build.ELF_MACHINE[target]
    if target == "hexagon":
        assert "-mcpu=hexagonv67" in info["target"] and info["elf_machine"] == 164
        # the e_flags' low byte is the core (0x67: v67), which qemu-hexagon 7.2 requires <= v67
        flags = int.from_bytes((folder / "tb_gdn_bench").read_bytes()[36:40], "little")
        assert flags & 0xFF == 0x67


def test_the_toolchain_is_part_of_the_cache_key(programs):
    gnu = kernel_build._programs_hash("arm32", False, toolchain="gnu")
    zig = kernel_build._programs_hash("arm32", False, toolchain="zig")
    assert gnu != zig
    folder, _ = need(programs, "hexagon")
    assert folder.name.startswith("hexagon-") and "zig" in (folder / "build.json").read_text()


# Emulated Hexagon floating point is slow (the 48-case matrix takes about 2 min of CPU): the default run
# compares every third case, which spans the scalar and vector gates, grouped value heads, snapshots and
# the awkward lengths; `pytest -m slow_build` compares all 48 (the qemu-hexagon device suite judges all
# 48 against the float64 reference in every run; Debian's gcc builds for arm32 and aarch64 are compared
# over all 48 in tests/test_native_cross.py).
SUBSET = GDN_CASES[::3]


def run_gdn_matrix(folder, target, cases=GDN_CASES):
    jobs = [(case, form, chunk) for case in cases for form, chunk in GDN_FORMS]

    def one(job):
        case, form, chunk = job
        out, state, _ = native_programs.gdn(folder, target, case.inputs(seed=3), form, chunk)
        return (case, form), {"out": out, "state": state}

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(one, jobs))


@pytest.fixture(scope="module")
def host_gdn(programs):
    return run_gdn_matrix(programs["host"], "host")


@pytest.mark.parametrize("name", NAMES)
def test_gdn_is_bitexact_with_the_host_build(programs, host_gdn, name):
    folder, target = need(programs, name)
    assert_gdn_bitexact(name, run_gdn_matrix(folder, target, SUBSET), host_gdn)


@pytest.mark.slow_build
@pytest.mark.parametrize("name", list(BUILDS))
def test_gdn_is_bitexact_with_the_host_build_over_all_48_cases(programs, host_gdn, name):
    folder, target = need(programs, name)
    assert_gdn_bitexact(name, run_gdn_matrix(folder, target), host_gdn)


def assert_gdn_bitexact(name, runs, host_gdn):
    for (case, form), got in runs.items():
        v = check_nmse(reference64(case.inputs(seed=3), "tiled"), got)
        assert v.passed, f"{name} {case.name} {form}: {v.detail}"
        same = check_bitexact(host_gdn[(case, form)], got)
        assert same.passed, f"{name} {case.name} {form}: {same.detail}"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", [(4, 1, 64, 150, 1, 1, "global"), (8, 2, 32, 90, 24, 20, "local")], ids=str)
def test_attention_is_bitexact_with_the_host_build(programs, case, name):
    q, k, v, mask, scale = attention_inputs(*case)
    want = {"out": gemma.attention(*(a.astype(np.float64) for a in (q, k, v, mask)), scale)}
    host = {"out": native_programs.attention(programs["host"], "host", q, k, v, mask, scale)[0]}
    folder, target = need(programs, name)
    got = {"out": native_programs.attention(folder, target, q, k, v, mask, scale)[0]}
    assert check_nmse(want, got).passed, name
    assert check_bitexact(host, got).passed, f"{name}: {check_bitexact(host, got).detail}"


@pytest.mark.parametrize("name", NAMES)
def test_cache_ops_are_byte_identical(programs, name):
    folder, target = need(programs, name)
    for case in grid(windows=(16,), dtypes=("float32",)):
        before, exact, new = _cache_case_arrays(case)
        for field, empty in (("k", 0), ("positions", 0xFF)):
            as_rows = lambda a: (a[None] if field == "positions" else a).view(np.uint8).reshape(  # noqa: E731
                -1 if field != "positions" else 1, a.shape[-1 if field == "positions" else 1],
                8 if field == "positions" else HEAD_DIM * 4)
            outputs, _ = native_programs.cache_ops(folder, target, as_rows(getattr(before.rows, field)),
                                                   as_rows(new[field]), before.length, case.sink, case.pads,
                                                   empty_byte=empty)
            for result in ("exact", "rolled"):
                v = check_bitexact({"cache": as_rows(getattr(exact.rows, field))}, {"cache": outputs[result]})
                assert v.passed, f"{name} {case.name} {field} {result}: {v.detail}"


# The engine: the same runs as tests/test_engine_cross.py (tiny shapes, window 24).
MODEL = gemma.tiny_config(window=24)
WEIGHTS = gemma.init_weights(MODEL, 3)
PROMPT = np.random.default_rng(5).integers(0, MODEL.vocab, 80).astype(np.int32)
ENGINE_RUNS = {
    "chunk": ["mode=chunk", "past=30", "tokens=13", "chunk=8"],
    "tail": ["mode=tail", "chunk=8", "cache=int8", "cache_group=8", "sink=3", "threshold=0", "generate=3"],
}


def run_engine(folder, target, mode):
    weights_dtype = "f16" if mode == "tail" else "f32"
    path = engine.export_weights(MODEL, WEIGHTS, weights_dtype, 32)
    args = dict(a.split("=", 1) for a in [f"weights={path}", *engine.model_args(MODEL, weights_dtype, 32),
                                          *ENGINE_RUNS[mode], "warmup=0", "reps=1"])
    tokens = PROMPT[:43] if mode == "chunk" else PROMPT[:2 * 8 + 5 + 24]
    return native_programs.run_program(folder, target, engine.PROGRAM, {"tokens": tokens}, args, timeout=1800)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ENGINE_RUNS)
def test_engine_is_bitexact_with_the_host_build(programs, mode, name):
    want, want_timings = run_engine(programs["host"], "host", mode)
    folder, target = need(programs, name)
    outputs, timings = run_engine(folder, target, mode)
    assert set(outputs) == set(want)
    v = check_bitexact(want, outputs)
    assert v.passed, f"{name} {mode}: {v.detail}"
    if mode == "tail":
        assert timings["telemetry"] == want_timings["telemetry"]


# --- the one libm dependency: the engine's RoPE tables ------------------------------------------------

ROPE_SOURCE = kernel_build.ROOT / "tests" / "data" / "rope_tables.c"
ROPE_ROWS = 4096  # positions 0..4095 (the seed cases reach 851)


def build_rope_tables(name, source=ROPE_SOURCE):
    """tests/data/rope_tables.c (which includes kernels/model.c) and the kernels, built like the
    programs: the host's cc against glibc, zig against musl for the others."""
    import subprocess

    target, toolchain = BUILDS.get(name, (name, None))
    # the library's sources but model.c, which the test program includes
    sources = [source] + [p for p in kernel_build.library_sources() if p.suffix == ".c" and p.name != "model.c"]
    flags = ["-std=c11", "-O3", "-ffp-contract=off", "-fno-math-errno", "-DTB_FUSED=0", '-DTB_SOURCE_HASH="rope"',
             f"-I{kernel_build.KERNELS_DIR}", "-static", "-pthread"]
    cc = ["cc"]
    if toolchain == "zig":
        cc = [str(kernel_build.zig_binary()), "cc", *kernel_build.toolchain_identity(target, "zig")["target"].split()]
    out = kernel_build.ROOT / ".cache" / "test-programs" / f"rope_tables-{name}-{Path(source).parent.name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([*cc, *flags, "-o", str(out), *map(str, sources), "-lm"], capture_output=True, text=True,
                       env=kernel_build.zig_env())
    assert p.returncode == 0, p.stderr[-500:]
    return out, target


def rope_lines(name, source=ROPE_SOURCE):
    import subprocess

    program, target = build_rope_tables(name, source)
    p = subprocess.run([*native_programs.EMULATORS[target], str(program), str(ROPE_ROWS)], capture_output=True,
                       text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-300:]
    return p.stdout.splitlines()


@pytest.fixture(scope="module")
def host_rope():
    return rope_lines("host")


@pytest.mark.parametrize("name", ["hexagon", pytest.param("arm32-musl", marks=pytest.mark.slow_build),
                                  pytest.param("aarch64-musl", marks=pytest.mark.slow_build)])
def test_rope_tables_from_musl_are_glibcs_bits(programs, host_rope, name):
    """model.c's rope_tables takes double pow, cos and sin from libm and rounds them to float32: glibc
    (the host) and musl (zig's builds) must give the same float32 tables on every target, for every
    position up to 4096, head sizes 16 to 256, bases 1e4 and 1e6, linear scaling 1 and 8. (musl's
    pow, cos and sin are the same C on every target: the ARM builds are compared with -m slow_build.)"""
    assert len(host_rope) == 32
    need(programs, name)
    got = rope_lines(name)
    differ = [f"{a} != {b.split()[-1]}" for a, b in zip(host_rope, got) if a != b]
    assert len(got) == 32 and not differ, f"{name}: RoPE tables differ from glibc's: {differ[:3]}"


def test_a_libm_difference_in_the_rope_tables_is_caught(host_rope, tmp_path):
    """The planted difference: a libm whose cos rounds to the next float32 for one angle (1000 rad, one
    element of the tables with scaling 1), as a last-place difference in double does when it crosses a
    float32 rounding boundary: the check sees exactly those tables change."""
    planted = tmp_path / "rope_tables.c"
    planted.write_text(ROPE_SOURCE.read_text().replace(
        '#include "model.c"', '#include <math.h>\n'
        '#define cos(x) ((x) == 1000.0 ? (double)nextafterf((float)cos(x), 2.0f) : cos(x))\n#include "model.c"'))
    got = rope_lines("host", planted)
    changed = {" ".join(a.split()[:4]) for a, b in zip(host_rope, got) if a != b}
    assert changed == {f"{hd} 10000 1 cos" for hd in (16, 64, 128, 256)} | {f"{hd} 1e+06 1 cos" for hd in (16, 64, 128, 256)}


# --- llama.cpp's harness on Hexagon: its real output, in the default run --------------------------------

TBO_HEXAGON = kernel_build.ROOT / "tests" / "data" / "test-backend-ops-gdn-qemu-hexagon.out"


def test_test_backend_ops_output_from_qemu_hexagon_is_ingested_under_its_name(results_dir, capsys):
    """The stdout of test-backend-ops test -o GATED_DELTA_NET -b CPU, built by zig for Hexagon and run
    under qemu-hexagon (tests/test_hexagon_llamacpp.py builds and runs it: `pytest -m slow_build`, a
    cold build of about half an hour here), read as the device's: 36 cases, each OK, the tool's tally
    agreeing. Cut short, it is refused."""
    from testbed.cli import main
    from testbed.results import ResultsStore

    assert main(["ingest", str(TBO_HEXAGON), "--device", "qemu-hexagon", "--experiment", "gdn"]) == 0
    assert "GATED_DELTA_NET/CPU/tally: 36/36 OK (pass)" in capsys.readouterr().out
    rows = [r for r in ResultsStore(results_dir).records() if r["kind"] == "oracle"]
    assert len(rows) == 37 and {r["device"] for r in rows} == {"qemu-hexagon"}
    assert all(r["verdict"] == "pass" for r in rows)
    cut = results_dir / "cut.out"
    cut.write_text(TBO_HEXAGON.read_text().split("  36/36 tests passed")[0])
    assert main(["ingest", str(cut), "--device", "qemu-hexagon", "--experiment", "gdn", "--force"]) == 1
    tally = [r for r in ResultsStore(results_dir).records() if r["case"].endswith("/tally")][-1]
    assert tally["verdict"] == "error"


def test_gemm_on_hexagon_gives_the_host_bits(programs):
    """tb_gemm's portable micro-kernel (all Hexagon has) under qemu-hexagon: the bits of the host's
    reference loop (one chain per element over k, FUSED=0), across tile edges, a transposed A or B,
    accumulation and the lower-triangular skip."""
    from tests.test_gemm import FLAGS, SHAPES, operands

    folder, target = need(programs, "hexagon")
    host = programs["host"]  # the fixture skips when it did not build
    for shape in SHAPES[:5]:
        for flags in FLAGS[::5]:
            a, b, c = operands(*shape, flags["trans"], flags["lower"], 2, flags["transa"])
            want, _ = native_programs.gemm(host, "host", a, b, c, form="loop", **flags)
            got, timings = native_programs.gemm(folder, target, a, b, c, **flags)
            assert timings["gemm_isa"] == "portable"
            assert got.tobytes() == want.tobytes(), f"{shape} {flags}"
