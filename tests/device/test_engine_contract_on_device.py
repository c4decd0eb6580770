"""testbed's own C engine through engine contract v1 (engines/testbed-c.yaml, kernels/bench/tb_model_engine.c)
on the selected device (`pytest --device=NAME -m device`): the same bits as backend=native's program
(tb_model_bench) for the chunk path's logits and every K/V row, pads included, and for the tail's cache
bytes and first-token logits, and for the tail continued from a restored state (state_in); the hybrid's
logits at every call's last row and its state bytes (conv, recurrent, K/V) the same as backend=native's
(tb_hybrid_bench), the past's partial call and the tail padded, unpadded or scalar; the same verdicts from
the token oracle; the evidence names the engine,
its yaml's hash, the program's sha256 and machine, and the request's hash. heavy_emulation: the verdicts
and the int8 cache (the bits of the chunk path and the float32 tail stay in every device session)."""

import dataclasses

import numpy as np
import pytest

from refimpl import gemma, qwen35
from testbed.backends.engine import gemma as engine_gemma, hybrid as engine_hybrid, spec as engine_spec, \
    tail as engine_tail
from testbed.backends.engine.models import HybridModel
from testbed.backends.native import engine as native_engine, gemma as native_gemma, hybrid as native_hybrid
from testbed.oracles.tokens import Reference, TokenCase, check_token_at_position

pytestmark = [pytest.mark.device, pytest.mark.requires("native")]

TINY = gemma.tiny_config()
CASE = TokenCase(21, 13, 8)      # a partial past call, three utterance calls, the last one partial


@pytest.fixture(scope="module")
def weights():
    return gemma.init_weights(TINY, 0)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(7).integers(0, TINY.vocab, 64)



def engine_runner(weights, device):
    from omegaconf import OmegaConf

    return engine_gemma.backend(weights, TINY, OmegaConf.create({"engine": "testbed-c"}), device)


def test_chunk_prefill_bits_equal_native(device, weights, prompt):
    native = native_gemma.backend(weights, TINY, None, device).utterance(prompt, CASE)
    runner = engine_runner(weights, device)
    through = runner.utterance(prompt, CASE)
    assert np.array_equal(native.chunk_logits, through.chunk_logits)
    for a, b in zip(native.k + native.v + native.pad_k + native.pad_v,
                    through.k + through.v + through.pad_k + through.pad_v):
        assert a.shape == b.shape and np.array_equal(a, b)
    evidence = runner.evidence.take()
    spec = engine_spec.load("testbed-c")
    assert len(evidence) == 2 and all(e["device"] == device.name for e in evidence)
    detail = evidence[0]["detail"]
    assert detail["engine"] == "testbed-c" and detail["engine_yaml_sha256"] == spec.yaml_sha256
    assert len(detail["request_sha256"]) == 64 and len(evidence[0]["sha256"]) == 64
    assert evidence[0]["ran"] == "tb_model_engine"


@pytest.mark.heavy_emulation
def test_same_verdicts_as_native(device, weights, prompt):
    ref = Reference(weights, TINY, prompt)
    native = check_token_at_position(native_gemma.backend(weights, TINY, None, device), ref, CASE)
    through = check_token_at_position(engine_runner(weights, device), ref, CASE)
    assert [(v.oracle, v.verdict) for v in native] == [(v.oracle, v.verdict) for v in through]
    assert all(v.passed for v in through), {v.oracle: v.detail for v in through}


@pytest.mark.parametrize("dtype", ["float32", pytest.param("int8", marks=pytest.mark.heavy_emulation)])
def test_tail_bytes_equal_native(device, weights, dtype):
    model = dataclasses.replace(TINY, window=24)
    tokens = np.random.default_rng(3).integers(0, TINY.vocab, 8 * 3 + 5)
    settings = native_engine.TailSettings(8, dtype, 16, 2, threshold=0)
    native = native_engine.tail(device, model, weights, tokens, settings, kill_switch=False)
    spec = engine_spec.load("testbed-c")
    through = engine_tail.prefill(device, spec, model, weights, tokens, settings, "padded")
    assert np.array_equal(native.prefill.logits, through.logits[0])
    assert through.state.read_bytes() == engine_tail.native_state_bytes(model, native)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("int8", marks=pytest.mark.heavy_emulation)])
def test_a_restored_state_continues_with_the_bits_of_native(device, weights, dtype, tmp_path):
    """state_in: testbed-c restores the state backend=native's program leaves after the prompt without its last
    3 tokens (its tail scalar: decode steps) and decodes those 3 one per call. Its last logits and its state.bin
    after them equal, bit for bit, backend=native's scalar prefill of the whole prompt, whose tail is the same
    decode steps: the restore loses nothing and the engine continues as if it had never stopped."""
    from testbed.backends.engine.state import StateFile

    model = dataclasses.replace(TINY, window=24)
    tokens = np.random.default_rng(5).integers(0, TINY.vocab, 8 * 3 + 5)
    settings = native_engine.TailSettings(8, dtype, 16, 2, threshold=0)
    short = native_engine.tail(device, model, weights, tokens[:-3], settings, kill_switch=True)
    whole = native_engine.tail(device, model, weights, tokens, settings, kill_switch=True)
    (tmp_path / "state.bin").write_bytes(engine_tail.native_state_bytes(model, short))
    spec = engine_spec.load("testbed-c")
    through = engine_tail.continue_from(device, spec, model, weights, tokens, settings, StateFile(tmp_path / "state.bin"),
                                        tokens.size - 3, state_out=True)
    assert [c["name"] for c in through.timings["calls"]] == ["decode"] * 3
    assert np.array_equal(through.logits[-1], whole.prefill.logits)
    assert through.state.read_bytes() == engine_tail.native_state_bytes(model, whole)


# the hybrid experiment's oracles' model (experiments/experiment/hybrid.yaml: shape)
HYBRID = qwen35.HybridConfig(vocab=256, hidden=64, layers=4, mlp=128, heads=4, kv_heads=2, head_dim=32,
                             linear_k_heads=2, linear_v_heads=4, linear_head_dim=16)
# P past tokens in calls of C (the last one partial: padded on both paths), then n; the tails on P = 0
HYBRID_CASES = [(21, 27, "padded"), (0, 16 + 5, "none"), (0, 16 + 5, "scalar")]


def state_bytes(state: qwen35.HybridState) -> bytes:
    """backend=native's state in testbed-c's state.bin order: per layer conv, recurrent or k, v, float32."""
    return b"".join(np.ascontiguousarray(a, np.float32).tobytes() for layer in state.layers for a in layer.values())


@pytest.mark.parametrize("past, tokens, tail", HYBRID_CASES)
def test_hybrid_bits_equal_native(device, past, tokens, tail):
    w = qwen35.init_weights(HYBRID, 0)
    prompt = np.random.default_rng(5).integers(0, HYBRID.vocab, past + tokens)
    native = native_hybrid.prefill(device, HYBRID, w, prompt, past=past, tokens=tokens, chunk=16,
                                   tail={"none": "exact"}.get(tail, tail))
    spec = engine_spec.load("testbed-c")
    ends = [int(p) for p in native.call_positions]  # every call's last row
    model = HybridModel(HYBRID, w).file_for(spec)
    through = engine_hybrid.prefill(device, spec, engine_hybrid.program(device, spec), model, HYBRID, prompt, past, 16,
                                    ends, tail, state=True)
    assert np.array_equal(native.call_logits, through.logits)
    assert through.state.read_bytes() == state_bytes(native.state) and through.state.size > 0
    assert through.evidence.as_dict()["ran"] == "tb_model_engine"
