"""Planted bugs in the model engine (kernels/model*.c): each is a realistic one-line slip built into
its own engine program (tests/native_support.mutant_program) for the selected device, and the oracle
that guards it must catch it, while the real engine passes the same checks (tests/device/test_engine_on_device.py)."""

import numpy as np
import pytest

from refimpl import gemma, tail_prefill as tp
from testbed.backends.native import engine, gemma as native_gemma
from testbed.backends.native.build import target_for_abi
from testbed.oracles.tail import check_cache_encoding, check_engine_rollback, check_first_token, engine_grid
from testbed.oracles.tokens import Reference, TokenCase, check_token_at_position
from tests.native_support import mutant_program

# heavy_emulation: each mutant is an engine build and several engine runs; left out on qemu-hexagon
pytestmark = [pytest.mark.device, pytest.mark.requires("native"), pytest.mark.heavy_emulation]

SMALL = gemma.tiny_config(window=64)
CHUNK = 16


@pytest.fixture(scope="module")
def weights():
    return gemma.init_weights(SMALL, 0)


def program(device, file, find, replace):
    return mutant_program(target_for_abi(device.profile.abi), file, find, replace)


def grid_failures(device, weights, prog, **grid):
    """The byte-identical grid's cases the engine program fails."""
    settings = engine.TailSettings(chunk=7)
    failed = []
    for case in engine_grid(7, **grid):
        padded, exact = engine.rollback_runs(device, SMALL, weights, case, settings, program=prog)
        if not check_engine_rollback(case, SMALL.layer_types, padded.prefill, exact.prefill).passed:
            failed.append(case)
    return failed


def first_token_failures(device, weights, prog, n=CHUNK + 9):
    eng = engine.DeviceTailEngine(device, SMALL, weights, engine.TailSettings(chunk=CHUNK, generate=4), prog)
    tokens = np.random.default_rng([1, n]).integers(0, SMALL.vocab, n)
    return {v.oracle for v in check_first_token(eng, tokens, CHUNK, tp.DEFAULT_THRESHOLD, generate_steps=4) if not v.passed}


def test_pads_left_in_the_global_cache_are_caught(device, weights):
    # The rollback loop stops one layer short: the last layer (the global one) keeps its pad rows.
    prog = program(device, "model_prefill.c", "taken < layers && rc == TB_OK", "taken < layers - 1 && rc == TB_OK")
    assert "exact_state" in first_token_failures(device, weights, prog)
    assert grid_failures(device, weights, prog, windows=(16,), sinks=(0,), dtypes=("float32",))


def test_a_snapshot_one_row_short_is_caught(device, weights):
    # The snapshot saves the rows of a padded append one row smaller than the real one.
    prog = program(device, "model_cache.c", "tb_cache_snapshot(part, n_real, n_pad,",
                   "tb_cache_snapshot(part, n_real + 1, n_pad - 1,")
    failed = grid_failures(device, weights, prog, sinks=(0,), dtypes=("float32",))
    assert failed and all(c.covers in ("eviction by pads only", "overshoot") for c in failed)


def test_evicted_sinks_are_caught(device, weights):
    # The engine creates its sliding caches without their sink rows.
    prog = program(device, "model.c", "e->evicts[i] ? o->sink : 0", "0")
    failed = grid_failures(device, weights, prog, dtypes=("float32",))
    assert failed and all(c.sink > 0 and c.prompt > c.window for c in failed)


def test_int8_scales_not_restored_are_caught(device, weights):
    # The snapshot (written before the int8 cache had scales) saves and restores the data rows only.
    prog = program(device, "model_cache.c", "if (!tb_kv_has_part(c, p)) continue;\n        const tb_sliding_cache *part",
                   "if (!tb_kv_has_part(c, p) || p == TB_KV_K_SCALE || p == TB_KV_V_SCALE) continue;\n"
                   "        const tb_sliding_cache *part")
    failed = grid_failures(device, weights, prog, sinks=(0,))
    assert failed and all(c.dtype == "int8" for c in failed)


def test_an_int8_scale_in_the_next_group_is_caught(device, weights):
    # Each group's scale written into the next group's slot, and read back from there: the engine
    # computes right, padded and exact appends match byte for byte, but the cache is not the layout.
    prog = mutant_program(target_for_abi(device.profile.abi), "model_cache.c", "            scales[gi] = scale;",
                          "            scales[(gi + 1) % (d / c->group)] = scale;",
                          also=(("x[i] = (float)(int8_t)data[i] * scales[i / c->group];",
                                 "x[i] = (float)(int8_t)data[i] * scales[(i / c->group + 1) % (d / c->group)];"),))
    settings = engine.TailSettings(chunk=CHUNK, generate=1, cache_dtype="int8", cache_group=8, sink=3)
    tokens = np.random.default_rng([1, CHUNK + 9]).integers(0, SMALL.vocab, CHUNK + 9)
    judged, float_run = engine.encoding_runs(device, SMALL, weights, tokens, settings, program=prog)
    v = check_cache_encoding(float_run.prefill, judged.prefill)
    assert not v.passed and "k_scale" in v.detail


def test_the_last_token_not_re_run_is_caught(device, weights):
    # The first token taken from the padded chunk's last row (a pad's) instead of re-running the last
    # real token through the step graph.
    prog = program(device, "model_prefill.c",
                   "if (rc == TB_OK) rc = tb_model_decode_with_past(e, tokens[n - 1], n - 1, logits);",
                   "if (rc == TB_OK) rc = tb_model_prefill_with_past(e, tokens + start, tail, chunk, start, 0, "
                   "chunk - 1, logits);")
    assert {"first_token", "exact_state"} <= first_token_failures(device, weights, prog)


def test_a_window_off_by_one_is_caught(device):
    # A local layer's query at position a also attends the key at a - window.
    prog = program(device, "model.c", "p >= a - window + 1", "p >= a - window")
    cfg = gemma.tiny_config()
    w = gemma.init_weights(cfg, 0)
    prompt = np.random.default_rng(7).integers(0, cfg.vocab, 900)
    case = TokenCase(800, 52, 64)
    runner = native_gemma.EngineRunner(w, cfg, device, program=prog)
    failed = {v.oracle for v in check_token_at_position(runner, Reference(w, cfg, prompt), case) if not v.passed}
    assert {"logits", "cache"} <= failed


def test_padding_a_tail_at_the_threshold_is_caught(device, weights):
    # `tail < threshold` where the design keeps `tail <= threshold` scalar: a tail of exactly 8 is padded
    prog = program(device, "model_prefill.c", "else if (tail <= p->threshold)", "else if (tail < p->threshold)")
    assert first_token_failures(device, weights, prog, n=CHUNK + tp.DEFAULT_THRESHOLD) == {"telemetry"}
