"""`pytest --device=NAME -m device`: the chunk_prefill and tail experiments with backend=native, every
prefill computed ON the selected device by the model engine built for its ABI, judged here against
refimpl; every record carries the device's evidence of the engine program built for that ABI."""

import pytest

from testbed import config, runner
from tests.device.test_gdn_on_device import assert_computed_on

pytestmark = [pytest.mark.device, pytest.mark.requires("native")]
TINY_TAIL = ["shape.vocab=256", "shape.hidden=64", "shape.heads=4", "shape.head_dim=16", "shape.mlp=128"]


def run_on(device, overrides):
    return runner.execute(config.load([f"device={device.name}", "backend=native", *overrides]), device=device)


@pytest.mark.heavy_emulation  # both seed cases and their bench: minutes each under qemu-hexagon
def test_chunk_prefill_seed_cases_pass_on_the_device(device, results_dir):
    # the seed's two cases by name: an emulated profile's sizes run one smaller case by default
    outcome = run_on(device, ["experiment=chunk_prefill", "mode=all", "cases=[{past:800,tokens:52},{past:820,tokens:32}]",
                              "bench.past=800", "bench.reps=1", "bench.warmup=0"])
    oracles = [r for r in outcome.rows if r["kind"] == "oracle"]
    assert len(oracles) == 9 and outcome.failed == 0, [r["detail"] for r in oracles if r["verdict"] != "pass"]
    assert_computed_on(device, [r for r in outcome.rows if r["oracle"] != "mask_heads"], "tb_model_bench")
    assert_computed_on(device, [r for r in outcome.rows if r["oracle"] == "mask_heads"], "tb_attention_bench")
    weights = {ran["detail"]["weights_sha256"] for r in outcome.rows for ran in r["evidence"] if ran["ran"] == "tb_model_bench"}
    assert len(weights) == 1 and len(weights.pop()) == 64


@pytest.mark.heavy_emulation  # about 20 engine runs of 137 tokens: many minutes under qemu-hexagon
def test_tail_oracles_and_bench_pass_on_the_device(device, results_dir):
    outcome = run_on(device, ["experiment=tail", "mode=all", *TINY_TAIL, "oracle.grid_windows=[16]",
                              "oracle.grid_sinks=[3]", "oracle.around_chunk=[[1,9]]", "prompt_tokens=[137]",
                              "reps=1", "warmup=0"])
    oracles = [r for r in outcome.rows if r["kind"] == "oracle"]
    assert outcome.failed == 0, [r["detail"] for r in oracles if r["verdict"] != "pass"][:3]
    assert {r["oracle"] for r in oracles} == {"cache_bytes", "first_token", "determinism", "telemetry", "exact_state",
                                            "naive"}
    assert_computed_on(device, outcome.rows, "tb_model_bench")


@pytest.mark.heavy_emulation  # the hexagon suite judges the tail at C=16 below
def test_tail_on_an_int8_cache_judges_its_encoding_against_refimpl(device, results_dir):
    """Issue 24, item 8: with a float16 or int8 cache the tail experiment also judges the stored rows
    against refimpl's encoding (cache_encoding), not only padded against exact (cache_bytes)."""
    outcome = run_on(device, ["experiment=tail", "mode=oracle", *TINY_TAIL, "cache.dtype=int8", "cache.group=8",
                              "oracle.grid_windows=[16]", "oracle.grid_sinks=[3]", "oracle.around_chunk=[[1,9]]"])
    (encoding,) = [r for r in outcome.rows if r["oracle"] == "cache_encoding"]
    assert encoding["verdict"] == "pass" and encoding["metrics"]["group"] == 8, encoding["detail"]
    assert outcome.failed == 0


def test_tail_oracles_at_chunk_16_pass_on_the_device(device, results_dir):
    """The emulated devices' stand-in for the 137-token tail test (heavy_emulation): the same oracles,
    byte-identical caches pulled from the device over the grid and the first token padded vs scalar, with
    C=16, so every prompt is a fifth as long (25 tokens: one chunk and a padded tail of 9)."""
    outcome = run_on(device, ["experiment=tail", "mode=oracle", *TINY_TAIL, "chunk=16", "tail=[9]", "oracle.grid_windows=[16]",
                              "oracle.grid_sinks=[3]", "oracle.around_chunk=[[1,9]]", "oracle.generate=4"])
    oracles = [r for r in outcome.rows if r["kind"] == "oracle"]
    assert outcome.failed == 0, [r["detail"] for r in oracles if r["verdict"] != "pass"][:3]
    assert {"cache_bytes", "first_token"} <= {r["oracle"] for r in oracles}
    assert_computed_on(device, outcome.rows, "tb_model_bench")
    if device.profile.abi == "hexagon":
        assert all(ran["detail"]["elf_machine"] == 164 for r in outcome.rows for ran in r["evidence"])
