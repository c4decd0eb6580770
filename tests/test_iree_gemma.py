"""The Gemma graphs through IREE: the token-at-position oracle on the seed's cases, a planted mask bug,
parameters vs constants, the FunctionGemma contract's 44/37 signature, Vulkan, device targets."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from omegaconf import OmegaConf

from refimpl import gemma
from testbed import backends, config, runner
from testbed.backends.iree.artifacts import Artifact, compile_graph, parse_declaration
from testbed.backends.iree.graphs import gemma as graphs
from testbed.backends.iree.runtime import ModuleRequirements, RuntimeSession, TargetRunner, run_tool
from testbed.models.contract import pack_prefill_with_past
from testbed.oracles.tokens import Reference, TokenCase, check_mask_heads, check_token_at_position


@pytest.fixture(scope="session")
def tiny():
    cfg = gemma.tiny_config()
    return cfg, gemma.init_weights(cfg, 0)


@pytest.fixture(scope="session")
def prompt(tiny):
    return np.random.default_rng(0).integers(0, tiny[0].vocab, 852)


def iree_backend(tiny, target="host"):
    cfg, w = tiny
    run_cfg = OmegaConf.create({"target": target, "iree": {"driver": None, "past_bucket": 128, "weights": "parameters"}})
    return backends.load("iree", "gemma").backend(w, cfg, run_cfg, None)


@pytest.fixture(scope="session")
def host_backend(tiny):
    return iree_backend(tiny)


def test_chunk_prefill_experiment_passes_on_iree_host(results_dir):
    """`testbed run chunk_prefill backend=iree target=host` on the seed's first case (its second,
    P=820 n=32 C=32, adds two compiles: `testbed run chunk_prefill backend=iree chunk=32`)."""
    rc = config.load(["backend=iree", "target=host", "mode=oracle", "chunk=64", "cases=[{past: 800, tokens: 52}]"],
                     experiment="chunk_prefill")
    outcome = runner.execute(rc)
    verdicts = {r["oracle"]: r["verdict"] for r in outcome.rows}
    assert verdicts == {"token": "pass", "logits": "pass", "cache": "pass", "naive": "pass", "mask_heads": "pass"}, \
        outcome.rows
    token = next(r for r in outcome.rows if r["oracle"] == "token")
    assert token["metrics"]["token_chunk"] == token["metrics"]["token_ref"]
    cache = next(r for r in outcome.rows if r["oracle"] == "cache")
    assert cache["metrics"]["nmse_kv"] < 1e-7  # K/V as refimpl's by NMSE (test-backend-ops' threshold)


def test_planted_wrong_mask_fails_through_a_correct_module(tiny, prompt, host_backend):
    """A host-side mask builder that forgets the local layers' sliding window, fed to the correct
    module: at 800 cached positions (window 512) the logits and the cache move, and the oracle fails."""
    cfg, w = tiny
    no_window = dataclasses.replace(cfg, window=10**6)

    def wrong_masks(model_cfg, *args, **kwargs):
        inp = gemma.chunk_inputs(model_cfg, *args, **kwargs)
        return dataclasses.replace(inp, masks=gemma.chunk_inputs(no_window, *args, **kwargs).masks)

    verdicts = check_token_at_position(host_backend, Reference(w, cfg, prompt), TokenCase(800, 52, 64),
                                       build=wrong_masks)
    failed = {v.oracle for v in verdicts if not v.passed}
    assert {"logits", "cache"} <= failed, [(v.oracle, v.detail) for v in verdicts]


def test_planted_mask_head_stride_fails_only_with_masks_that_differ_per_head(tiny, prompt, monkeypatch):
    """The graph adding head 0's mask to every head's scores (mask[:, :1] broadcast over the heads): the
    real masks are the same for every head, so every token-oracle verdict passes; with masks that
    differ per head the module's logits leave refimpl's."""
    real = graphs.attention
    monkeypatch.setattr(graphs, "attention", lambda q, k, v, mask, scale: real(q, k, v, mask[:, :1], scale))
    cfg, w = tiny
    planted, ref, case = iree_backend(tiny), Reference(w, cfg, prompt), TokenCase(40, 12, 16)
    assert all(v.passed for v in check_token_at_position(planted, ref, case))
    v = check_mask_heads(planted, ref, case)
    assert not v.passed and v.margin < 0 and "another head's mask" in v.detail


def test_redecode_graph_matches_refimpl(tiny, prompt):
    cfg, w = tiny
    n = 40
    select = np.eye(n, dtype=np.float32)[n - 1]
    (logits,) = TargetRunner("host")(graphs.redecode(cfg, w, n), prompt[:n].astype(np.int32), select)
    want = gemma.redecode(w, cfg, prompt, n - 1)
    assert int(np.argmax(logits)) == int(np.argmax(want))
    assert np.abs(logits - want).max() < 1e-4


def test_one_module_serves_other_weights_and_constants_agree(tiny, prompt):
    """Weights are parameters: new weights reuse the compiled module (no compile) and give refimpl's
    answer for those weights; the constants build gives the same numbers."""
    cfg, w = tiny
    other = gemma.init_weights(cfg, 1)
    chunk, past = 8, 64
    inp = gemma.chunk_inputs(cfg, prompt[past:past + 5], past, chunk)
    _, past_k, past_v = gemma.prefill_at(other, cfg, prompt[:past], past - 1)
    args = pack_prefill_with_past(cfg, inp, past_k, past_v)
    want = gemma.prefill_with_past(other, cfg, inp.tokens, inp.tables, past_k, past_v, inp.masks, inp.select)

    first = compile_graph(graphs.prefill_with_past(cfg, w, chunk, past), "host")
    reused = compile_graph(graphs.prefill_with_past(cfg, other, chunk, past), "host")
    assert not reused.compiled and reused.folder == first.folder and reused.parameters != first.parameters
    # the archive is stored once per cache and linked into each artifact folder that loads it
    assert reused.parameters.stat().st_nlink >= 2
    assert (reused.folder.parent / "parameters" / reused.parameters.name).samefile(reused.parameters)
    by_params = RuntimeSession(reused)(*args)
    by_constants = TargetRunner("host")(graphs.prefill_with_past(cfg, other, chunk, past, constants=True), *args)
    assert np.abs(by_params[0] - want[0]).max() < 1e-4
    assert np.abs(by_params[1] - want[1][0]).max() < 1e-4
    assert np.abs(by_constants[0] - by_params[0]).max() < 1e-5


def test_functiongemma_contract_is_the_compiled_signature(tiny):
    """18 layers of two types (the FunctionGemma layout, at the tiny width): 44 arguments and 37
    results in the contract's order, read back from the compiled module's reflection."""
    cfg = gemma.tiny_config(layers=18)
    graph = graphs.prefill_with_past(cfg, gemma.init_weights(cfg, 0), 8, 64)
    art = compile_graph(graph, "host")
    session = RuntimeSession(art)  # checks the contract against the module's signature
    _, args, results = parse_declaration(session._function.reflection["iree.abi.declaration"])
    assert (len(args), len(results)) == (44, 37)
    names = [a.name for a in graph.contract.args]
    assert names[:6] == ["tokens", "cos_local", "sin_local", "k_0", "v_0", "mask_local"]
    assert names[-1] == "select" and "mask_global" in names[names.index("k_5") - 3:names.index("k_5") + 3]


def test_gemma_on_lavapipe(tiny, prompt):
    """The Vulkan path end to end on a short case (the seed's cases run in `testbed run
    chunk_prefill backend=iree target=lavapipe`)."""
    cfg, w = tiny
    verdicts = check_token_at_position(iree_backend(tiny, "lavapipe"), Reference(w, cfg, prompt),
                                       TokenCase(40, 12, 16))
    assert all(v.passed for v in verdicts), [(v.oracle, v.detail) for v in verdicts]


@pytest.mark.parametrize("target, fmt", [("arm32", "embedded-elf-arm_32"), ("aarch64", "embedded-elf-arm_64"),
                                         ("mali", "vulkan-spirv-fb")])
def test_chunk_graph_compiles_for_device_targets(tiny, target, fmt):
    cfg, w = tiny
    art = compile_graph(graphs.prefill_with_past(cfg, w, 8, 64), target)
    assert ModuleRequirements.of(art.module).formats == (fmt,)
    assert art.parameters is not None and art.parameters.stat().st_size > sum(a.nbytes for a in w.values())


def test_user_artifact_with_parameters_runs_through_the_same_runners(tiny, prompt, tmp_path):
    """A user's export: module, parameter archive and a manifest naming both, run in-process and
    through iree-run-module, against refimpl."""
    cfg, w = tiny
    art = compile_graph(graphs.prefill_with_past(cfg, w, 8, 64), "host")
    user = tmp_path / "exported"
    user.mkdir()
    shutil.copy(art.module, user / "prefill.vmfb")
    shutil.copy(art.parameters, user / "weights.irpa")
    (user / "manifest.json").write_text(json.dumps({**art.contract.to_json(), "module": "prefill.vmfb",
                                                    "parameters": {"scope": "model", "archive": "weights.irpa"}}))
    theirs = Artifact.load(user)
    inp = gemma.chunk_inputs(cfg, prompt[64:70], 64, 8)
    _, past_k, past_v = gemma.prefill_at(w, cfg, prompt[:64], 63)
    args = pack_prefill_with_past(cfg, inp, past_k, past_v)
    want, _, _ = gemma.prefill_with_past(w, cfg, inp.tokens, inp.tables, past_k, past_v, inp.masks, inp.select)
    for got in (RuntimeSession(theirs)(*args), run_tool(theirs, "local-sync", args, work_dir=tmp_path)):
        assert np.abs(got[0] - want).max() < 1e-4


def test_chunk_bench_records_both_calls_and_the_ratio(results_dir):
    """`testbed run iree_chunk_bench` at a small shape: figures from iree-benchmark-module, FLOPs
    counted, the ratio stated beside the seed's (the numbers themselves are measured, not tested)."""
    rc = config.load(["past=64", "chunk=8", "reps=2"], experiment="iree_chunk_bench")
    rows = {r["params"]["form"]: r for r in runner.execute(rc).rows}
    assert set(rows) == {"chunk_call", "decode_step", "ratio"}
    for form in ("chunk_call", "decode_step"):
        assert rows[form]["figures"]["time"]["reps"] == 2 and rows[form]["work"]["flops"] > 0
    ratio = rows["ratio"]["metrics"]
    assert ratio["decode_steps_per_chunk_call"] == pytest.approx(
        rows["chunk_call"]["figures"]["time"]["median"] / rows["decode_step"]["figures"]["time"]["median"])
    assert ratio["seed_decode_steps_per_chunk_call"] == pytest.approx(4.58 / 0.26)


def test_chunk_bench_with_both_timers_records_the_cost_around_the_module(results_dir):
    """timer=both: the tool's time (the module's work) and the in-process call's (inputs marshalled,
    outputs read back) in one job; the python call's record carries the difference."""
    rc = config.load(["past=64", "chunk=8", "reps=2", "timer=both"], experiment="iree_chunk_bench")
    rows = {(r["params"]["form"], r["params"]["timer"]): r for r in runner.execute(rc).rows}
    assert set(rows) == {(form, timer) for form in ("chunk_call", "decode_step", "ratio") for timer in ("tool", "python")}
    for form in ("chunk_call", "decode_step"):
        tool, python = rows[form, "tool"]["figures"]["time"], rows[form, "python"]["figures"]["time"]
        assert rows[form, "python"]["metrics"]["around_module_s"] == pytest.approx(python["median"] - tool["median"])
