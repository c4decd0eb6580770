"""The hybrid engine in C (kernels/tb_hybrid.h, program tb_hybrid_bench) on the selected device
(`pytest --device=NAME -m device`): a tiny Qwen3.5 made by transformers here, loaded as a checkpoint,
run ON the device, judged on the host against transformers' own logits and states; the hybrid
experiment's oracles, crossover, tail and drift with backend=native on the device, every record
carrying the device's evidence; bad requests refused by the program before it runs."""

import numpy as np
import pytest

from testbed import config, runner
from testbed.backends.native import hybrid as engine
from testbed.backends.native.device import NativeRunFailed
from testbed.devices import connect, load_profile
from testbed.experiments import hybrid as experiment
from testbed.models.hybrid_checkpoints import load_hf_folder
from testbed.oracles.hybrid import check_boundaries, check_tail_bytes
from testbed.oracles.numerical import check_nmse, digest, nmse
from tests.device.test_gdn_on_device import assert_computed_on
from tests.hybrid_support import VARIANTS, make_tiny_qwen35

pytestmark = [pytest.mark.device, pytest.mark.requires("native")]
pytest.importorskip("transformers", exc_type=ImportError)

PROMPT = 150
PAST, TOKENS, CHUNK = 86, 64, 64  # the past's calls end at 63 (full) and 85 (22 padded to 64); the case at 149


@pytest.fixture(scope="module", params=VARIANTS)
def made(request, tmp_path_factory):
    return make_tiny_qwen35(tmp_path_factory.mktemp("qwen35") / "tiny", VARIANTS[request.param], PROMPT)


@pytest.fixture(scope="module")
def lllf(tmp_path_factory):
    """Qwen3.5's own layer pattern alone, for the runs that need one checkpoint."""
    return make_tiny_qwen35(tmp_path_factory.mktemp("qwen35") / "lllf", VARIANTS["lllf"], PROMPT)


def test_transformers_tokens_at_every_chunk_boundary_and_logits_on_the_device(device, made):
    """The engine on the device gives transformers' argmax at every chunk boundary (the tie rule),
    the final logits within NMSE 1e-10 and every state within the oracles' threshold; the padded tail's
    state is byte for byte the unpadded one's, and its logits equal."""
    cfg, w = load_hf_folder(made.folder)
    runs = {tail: engine.prefill(device, cfg, w, made.prompt, past=PAST, tokens=TOKENS, chunk=CHUNK, tail=tail)
            for tail in ("padded", "exact")}
    run = runs["padded"]
    assert list(run.call_positions) == [63, 85, 149] and list(run.call_rows) == [64, 64, 64]
    boundaries = check_boundaries(made.logits, run.call_logits, run.call_positions)
    assert boundaries.passed, boundaries.detail
    assert nmse(made.logits[-1], run.call_logits[-1]) <= 1e-10
    states = check_nmse(made.states, run.state.arrays())
    assert states.passed, states.detail
    same = check_tail_bytes(runs["padded"], runs["exact"])
    assert same.passed and same.metrics["length"] == PROMPT, same.detail
    assert run.evidence.device == device.name and run.evidence.ran == "tb_hybrid_bench"
    if device.profile.has("counts"):
        assert run.counts and run.counts.per_call > 0
    # the same bytes as the host's build computes (unfused, one summation order on every target): what
    # the planted-bug tests establish on the host holds for the device's build
    here = engine.prefill(connect(load_profile("host")), cfg, w, made.prompt, past=PAST, tokens=TOKENS, chunk=CHUNK)
    assert digest(here.call_logits, *here.state.arrays().values()) == digest(run.call_logits, *run.state.arrays().values())


def run_on(device, overrides):
    return runner.execute(config.load([f"device={device.name}", "experiment=hybrid", "backend=native", *overrides]),
                          device=device)


def test_the_experiments_oracles_pass_on_the_device_with_the_checkpoint(device, lllf, results_dir, tmp_path):
    made = lllf
    np.save(tmp_path / "prompt.npy", made.prompt)
    best = int(made.logits[-1].argmax())
    outcome = run_on(device, ["mode=oracle", f"model.checkpoint={made.folder}", f"model.prompt={tmp_path / 'prompt.npy'}",
                              f"oracle.past=[{PAST}]", f"oracle.tokens=[{TOKENS}]", "oracle.tails=[22]",
                              f"model.expected_token={best}"])
    oracles = [r for r in outcome.rows if r["kind"] == "oracle"]
    assert outcome.failed == 0, [(r["case"], r["detail"]) for r in oracles if r["verdict"] != "pass"]
    assert {r["oracle"] for r in oracles} == {"token", "state", "naive", "first_token", "tail_state", "tail_bytes"}
    assert len(oracles) == 2 * 6  # per GDN form: one case, one tail
    assert_computed_on(device, outcome.rows, "tb_hybrid_bench")


SMALL_BENCH = ["bench.shape.vocab=64", "bench.shape.hidden=32", "bench.shape.layers=4", "bench.shape.mlp=48",
               "bench.shape.heads=2", "bench.shape.kv_heads=1", "bench.shape.head_dim=16",
               "bench.shape.linear_k_heads=1", "bench.shape.linear_v_heads=2", "bench.shape.linear_head_dim=16",
               "bench.prefill_chunk=16", "bench.reps=1", "bench.warmup=0", "chunk=16", "gdn_chunk=8",
               "bench.contexts=[24,48]", "bench.tails=[0,5]", "bench.drift_tokens=[40]"]


def test_crossover_tail_and_drift_come_from_the_device(device, results_dir):
    """Every figure from the device's own runs; on an emulated device the crossover's rate is tokens per
    1e9 counted instructions, labelled, never a time."""
    outcome = run_on(device, ["mode=bench", *SMALL_BENCH])
    measures = [r for r in outcome.rows if r["kind"] == "measure"]
    assert {r["params"]["part"] for r in measures} == {"crossover", "tail", "drift"}
    assert_computed_on(device, outcome.rows, "tb_hybrid_bench")
    cross = [r for r in measures if r["params"]["part"] == "crossover"]
    assert sorted({r["params"]["model"] for r in cross}) == sorted(experiment.MODELS)
    table = experiment.crossover_table(outcome.frame())
    if device.profile.has("emulated"):
        assert all("instructions" in r["figures"] for r in cross)
        assert set(table["rate"]) == {experiment.RATE_COUNTS}
        # exact counts: the serial recurrence executes more instructions than none at all
        by = {r["params"]["model"]: r["figures"]["instructions"]["median"] for r in cross if r["params"]["context"] == 48}
        assert by["hybrid-serial"] > by["hybrid-no-recurrence"]
    else:
        assert set(table["rate"]) == {experiment.RATE_CPU}
    drift = {r["params"]["precision"]: r["metrics"] for r in measures if r["params"]["part"] == "drift"}
    assert 0 < drift["fp16-acc32"]["nmse_logits"] < drift["fp16-acc16"]["nmse_logits"] < 1e-2


def test_requests_the_engine_cannot_carry_out_are_refused_before_running(device, lllf, monkeypatch):
    import dataclasses

    made = lllf
    cfg, w = load_hf_folder(made.folder)
    with pytest.raises(NativeRunFailed, match="outside the vocabulary"):
        engine.prefill(device, cfg, w, np.full(PROMPT, cfg.vocab), past=0, tokens=8, chunk=8)
    real_args = engine.model_args
    # a weights file of another shape: the program names the tensor
    wider = dataclasses.replace(cfg, hidden=96)
    monkeypatch.setattr(engine, "model_args", lambda c: real_args(wider))
    with pytest.raises(NativeRunFailed, match=r"model.embed_tokens.weight has shape \[256, 64\], expected \[256, 96\]"):
        engine.prefill(device, cfg, w, made.prompt, past=0, tokens=8, chunk=8)
    # a cache smaller than the calls need
    monkeypatch.setattr(engine, "model_args", lambda c: [*real_args(c), "capacity=16"])
    with pytest.raises(NativeRunFailed, match="refused: P=0 and n=40 tokens in calls of C=8 rows need 48 cache rows"):
        engine.prefill(device, cfg, w, made.prompt, past=0, tokens=40, chunk=8)
