"""Planted bugs in the padded-tail engine: each must fail the first-token suite's oracles."""

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from refimpl import gemma
from refimpl import tail_prefill as tp
from testbed.tail_oracles import Engine, check_first_token

CHUNK = 128


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with threadpool_limits(limits=1):
        yield


@pytest.fixture(scope="module")
def model():
    cfg = gemma.tiny_config()
    return cfg, gemma.init_weights(cfg, seed=0)


def verdicts(model, n, graph=None, policy=tp.TailPolicy(), ops=tp.sc.CacheOps(), **cache):
    cfg, w = model
    graph = graph or tp.trace_chunk_graph(CHUNK, np.arange(46))
    tokens = np.random.default_rng(n).integers(0, cfg.vocab, n)
    eng = Engine(w, cfg, graph, policy, lambda: tp.model_caches(cfg, **cache), ops=ops)
    return {v.oracle: v for v in check_first_token(eng, tokens, CHUNK)}


class FamilyNamePolicy(tp.TailPolicy):
    """The seed's bug: padding gated on the model family's name, not on a conv cache being present,
    so a hybrid model with a conv layer gets padded."""

    def state_guard(self, caches):
        return None


def test_padding_allowed_for_a_conv_cache_is_caught(model):
    v = verdicts(model, CHUNK + 40, policy=FamilyNamePolicy(), conv_kernel=4)
    assert v["first_token"].metrics["padded_mode"] == "padded"
    assert not v["exact_state"].passed and "state0.ring" in v["exact_state"].detail


def test_chunk_size_from_the_calibration_prompt_is_caught(model):
    # The converter's bug: the chunk graph sliced its trace input from the calibration prompt.
    def traced_at_calibration_length(chunk, calibration_prompt):
        return tp.ChunkGraph(rows=np.asarray(calibration_prompt)[:chunk].size)

    v = verdicts(model, 2 * CHUNK - 1, graph=traced_at_calibration_length(CHUNK, np.arange(46)))
    assert not v["telemetry"].passed
    assert "chunk graph has 46 rows, configured chunk is 128" in v["telemetry"].detail


def test_pads_left_in_the_engine_caches_are_caught(model):
    v = verdicts(model, 8 * CHUNK - 1, ops=tp.sc.CacheOps(rollback=lambda cache, snap: None))
    assert not v["exact_state"].passed



class IgnoresKillSwitch(tp.TailPolicy):
    """A kill switch read once at start-up (or never): setting it later changes nothing."""

    def decide(self, tail, chunk, caches):
        with pytest.MonkeyPatch.context() as env:
            env.delenv(tp.KILL_SWITCH, raising=False)
            return super().decide(tail, chunk, caches)


def test_a_kill_switch_that_does_not_turn_padding_off_is_caught(model):
    v = verdicts(model, CHUNK + 40, policy=IgnoresKillSwitch())
    assert not v["telemetry"].passed and "padded with the kill switch set" in v["telemetry"].detail
