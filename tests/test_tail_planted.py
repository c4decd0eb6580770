"""Planted bugs in the padded-tail engine: each must fail the first-token suite's oracles."""

import os

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from refimpl import gemma, tail_prefill as tp
from testbed.cli import main
from testbed.oracles.tail import Engine, check_first_token
from testbed.results import ResultsStore

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
    return {v.oracle: v for v in check_first_token(eng, tokens, CHUNK, tp.DEFAULT_THRESHOLD)}


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


@pytest.mark.quick
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


class PadsAtTheThreshold(tp.TailPolicy):
    """`tail < threshold` where the design keeps `tail <= threshold` scalar: a tail of exactly the
    threshold is padded. Padded and scalar still agree on every byte and token; only the decision is off."""

    def decide(self, tail, chunk, caches):
        if tail == 0:
            return False, "no tail"
        if os.environ.get(tp.KILL_SWITCH) == "1":
            return False, f"kill switch {tp.KILL_SWITCH}=1"
        if tail < self.threshold:
            return False, f"tail {tail} < threshold {self.threshold}"
        reason = self.state_guard(caches) or self.window_guard(caches, chunk)
        return (False, reason) if reason else (True, "padded")


def test_padding_a_tail_at_the_threshold_is_caught(model):
    at = verdicts(model, CHUNK + tp.DEFAULT_THRESHOLD, policy=PadsAtTheThreshold())
    assert at["first_token"].metrics["padded_mode"] == "padded"
    assert [o for o, v in at.items() if not v.passed] == ["telemetry"]
    assert f"a tail of {tp.DEFAULT_THRESHOLD} ran padded" in at["telemetry"].detail
    above = verdicts(model, CHUNK + tp.DEFAULT_THRESHOLD + 1, policy=PadsAtTheThreshold())
    assert all(v.passed for v in above.values()), "one above the threshold both rules pad"


def test_a_tail_left_scalar_above_the_threshold_is_caught(model):
    v = verdicts(model, CHUNK + 40, policy=tp.TailPolicy(threshold=64))  # the engine's policy, not the configured 8
    assert v["first_token"].metrics["padded_mode"] == "scalar"
    assert not v["telemetry"].passed and "the rule (pad tails > threshold 8" in v["telemetry"].detail


# --- `testbed run tail` with the bug in refimpl ---------------------------------------------------------

TINY_RUN = ["run", "tail", "mode=oracle", "shape.vocab=256", "shape.hidden=64", "shape.heads=4", "shape.head_dim=16",
            "shape.mlp=128", "oracle.grid_windows=[16]", "oracle.grid_sinks=[0]"]


def failed_records(results_dir):
    rows = ResultsStore(results_dir).records("tail")
    return [r for r in rows if r["run_id"] == rows[-1]["run_id"] and r["verdict"] != "pass"]


def test_cli_run_fails_when_the_policy_pads_at_the_threshold(results_dir, monkeypatch):
    monkeypatch.setattr(tp.TailPolicy, "decide", PadsAtTheThreshold.decide)
    assert main(TINY_RUN) == 1
    failed = failed_records(results_dir)
    assert [(r["oracle"], r["params"]["tail"]) for r in failed] == [("telemetry", tp.DEFAULT_THRESHOLD)]


def test_cli_run_fails_when_refimpl_norms_lose_the_weight_offset(results_dir, monkeypatch):
    """Padded and scalar tails both run refimpl.gemma, so they agree on its bug: only the naive float64
    model can fail them."""
    def rms_norm_without_offset(x, w, eps):
        x = x.astype(gemma.DTYPE)
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + gemma.DTYPE(eps)) * w

    monkeypatch.setattr(gemma, "rms_norm", rms_norm_without_offset)
    assert main(TINY_RUN) == 1
    failed = failed_records(results_dir)
    assert [r["oracle"] for r in failed] == ["naive"]
    assert failed[0]["metrics"]["max_abs_padded_naive_diff"] > failed[0]["metrics"]["naive_atol"]
