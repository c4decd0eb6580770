"""The model engine program built for arm32 and aarch64, run under qemu-user, byte for byte against
the same program built for the host (FUSED=0, -ffp-contract=off, denormals flushed: every target
computes the same bits). Tiny shapes: emulation is slow, and its timings are never used."""

import shutil

import numpy as np
import pytest

from refimpl import gemma
from testbed.backends.native import build as kernel_build, engine, programs as native_programs
from testbed.oracles.numerical import check_bitexact, nmse

ARM_TARGETS = ("arm32", "aarch64")
COMPILERS = {"arm32": "arm-linux-gnueabihf-gcc", "aarch64": "aarch64-linux-gnu-gcc", "host": "cc"}
MODEL = gemma.tiny_config(window=24)
WEIGHTS = gemma.init_weights(MODEL, 3)
PROMPT = np.random.default_rng(5).integers(0, MODEL.vocab, 80).astype(np.int32)
RUNS = {
    # P past rows across the window, then n tokens in chunk calls, the last one padded
    "chunk": ["mode=chunk", "past=30", "tokens=13", "chunk=8"],
    # a padded tail rolled back on int8 caches with sinks, over an evicting window, with f16 weights
    "tail": ["mode=tail", "chunk=8", "cache=int8", "cache_group=8", "sink=3", "threshold=0", "generate=3"],
}


class Programs(dict):
    """Each target's programs, built when a test first asks for them (None: no toolchain or emulator): a
    run of one test builds what it uses, never every target."""

    def __missing__(self, target):
        missing = native_programs.emulator_missing(target) or (
            None if shutil.which(COMPILERS[target]) else f"{COMPILERS[target]} is not installed")
        self[target] = None if missing else kernel_build.build_programs(target)
        return self[target]


@pytest.fixture(scope="module")
def programs():
    return Programs()


def run(programs_dir, target, mode):
    weights_dtype = "f16" if mode == "tail" else "f32"
    path = engine.export_weights(MODEL, WEIGHTS, weights_dtype, 32)
    args = dict(a.split("=", 1) for a in [f"weights={path}", *engine.model_args(MODEL, weights_dtype, 32), *RUNS[mode],
                                          "warmup=0", "reps=1"])
    tokens = PROMPT[:43] if mode == "chunk" else PROMPT[:2 * 8 + 5 + 24]
    outputs, timings = native_programs.run_program(programs_dir, target, engine.PROGRAM, {"tokens": tokens}, args,
                                                   timeout=600)
    return outputs, timings


@pytest.fixture(scope="module")
def host_runs(programs):
    return {mode: run(programs["host"], "host", mode) for mode in RUNS}


def test_host_chunk_run_matches_refimpl(host_runs):
    outputs, _ = host_runs["chunk"]
    _, k, _ = gemma.prefill_at(WEIGHTS, MODEL, PROMPT[:43], 0)
    assert nmse(np.stack(k), outputs["k"][:, :, :43]) <= 1e-10


@pytest.mark.parametrize("mode", RUNS)
@pytest.mark.parametrize("target", ARM_TARGETS)
def test_engine_under_qemu_is_bitexact_with_the_host_build(programs, host_runs, target, mode):
    if programs[target] is None:
        pytest.skip(f"no {target} toolchain or emulator")
    outputs, timings = run(programs[target], target, mode)
    want, want_timings = host_runs[mode]
    assert set(outputs) == set(want)
    v = check_bitexact(want, outputs)
    assert v.passed, f"{target} {mode}: {v.detail}"
    if mode == "tail":
        assert timings["telemetry"] == want_timings["telemetry"] and timings["telemetry"]["tail_mode"] == "padded"
        assert timings["vector_path"] != want_timings["vector_path"]  # a NEON build, not the host's code


# --- weights stored as f16 / int8: the engine converts them where it reads them (the decode step's dot
# products in registers, the chunk call's products panel by panel); either way it must compute the bits
# of float32 weights holding exactly the values they stand for (engine.dequantized). ---------------------


def run_chunk(program_dir, weights: dict, dtype: str):
    path = engine.export_weights(MODEL, weights, dtype, 32)
    args = dict(a.split("=", 1) for a in [f"weights={path}", *engine.model_args(MODEL, dtype, 32), *RUNS["chunk"],
                                          "warmup=0", "reps=1"])
    outputs, _ = native_programs.run_program(program_dir, "host", engine.PROGRAM, {"tokens": PROMPT[:43]}, args,
                                             timeout=600)
    return outputs


# The host's two builds: with AVX-512 where this CPU has it (int8 decode two rows per 512-bit register), and
# without (the 8-lane code ARM's NEON runs too, int8 decode four rows at a time: kernels/model.c dot8_stored)
HOST_BUILDS = {"host": lambda: kernel_build.build_programs("host"),
               "host 8 lanes": lambda: kernel_build.build_programs("host", avx512=False)}


@pytest.mark.quick
@pytest.mark.parametrize("build", list(HOST_BUILDS))
@pytest.mark.parametrize("dtype", ["f16", "int8"])
def test_stored_weights_give_the_bits_of_their_float32_values(dtype, build):
    program_dir = HOST_BUILDS[build]()
    stored = run_chunk(program_dir, WEIGHTS, dtype)
    as_f32 = run_chunk(program_dir, engine.dequantized(WEIGHTS, dtype, 32), "f32")
    v = check_bitexact(as_f32, stored)
    assert v.passed, f"{dtype}: {v.detail}"


def test_a_scale_read_from_the_wrong_group_is_caught():
    """Planted: the decode step's int8 dot products take every input's scale from the row's first group
    (one scale per row, a plausible slip). The logits move (decode steps and the LM head read the
    weights that way); the caches do not: a chunk call's layer products dequantise through another path."""
    from tests.native_support import mutant_program

    mutant = mutant_program("host", "model.c", "(w->cols / w->group) + g];", "(w->cols / w->group) + 0 * g];")
    stored = run_chunk(mutant.parent, WEIGHTS, "int8")
    as_f32 = run_chunk(mutant.parent, engine.dequantized(WEIGHTS, "int8", 32), "f32")
    v = check_bitexact(as_f32, stored)
    assert not v.passed and "decode_logits" in v.detail, v.detail
    assert v.metrics["differing_k"] == v.metrics["differing_v"] == 0, v.detail


@pytest.mark.quick
def test_a_scale_read_from_the_wrong_group_on_8_lanes_is_caught():
    """Planted (issue 44) in the 8-lane int8 decode alone (ARM NEON's and AVX2's code; the AVX-512 host never
    runs it): the second of every four rows takes the next group's scale. The host's 8-lane build (one
    program, tests/native_support.mutant_one_program) shows it in the logits, as qemu-aarch64 would."""
    from tests.native_support import MODEL_SOURCES, mutant_one_program

    line = "s1 = vf_set1(group_scale(w, row0 + r0 + 1, g));"
    program = mutant_one_program("host", "model.c", line, line.replace(", g));", ", (g + 1) % groups));"),
                                 engine.PROGRAM, MODEL_SOURCES, avx512=False)
    stored = run_chunk(program.parent, WEIGHTS, "int8")
    as_f32 = run_chunk(program.parent, engine.dequantized(WEIGHTS, "int8", 32), "f32")
    v = check_bitexact(as_f32, stored)
    assert not v.passed and "decode_logits" in v.detail, v.detail
