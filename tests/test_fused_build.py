"""The fast build is the judged build (issue 35): `fused=true` runs the FMA programs through the CLI's own
oracles (chunk_prefill, hybrid), every record's evidence says how the program it ran computes its
multiply-adds: what ran, not what was asked. arm32's FUSED=1 build targets VFPv4 (NEON VFMA.F32) and
fuses; its FUSED=0 build stays VFPv3 (no FMA), and an arm32 FUSED=1 build cached from before it targeted
VFPv4 reads back as unfused."""

import json

import pytest

from testbed import cli
from testbed.backends.native import build
from testbed.results import ResultsStore

HYBRID_SMALL = ["chunk=16", "gdn_chunk=8", "oracle.prompt_tokens=60", "oracle.past=[0,20]", "oracle.tokens=[16,5]",
                "oracle.tails=[3]"]
CHUNK_SMALL = ["mode=oracle", "cases=[{past: 100, tokens: 20}]", "chunk=32"]


def ran_fused(records) -> set:
    return {e["detail"].get("multiply_add") for r in records for e in r["evidence"] if e.get("ran")}


def test_chunk_prefill_judges_the_fused_build(results_dir):
    assert cli.main(["run", "chunk_prefill", "backend=native", "fused=true", *CHUNK_SMALL]) == 0
    rows = ResultsStore(results_dir).records("chunk_prefill")
    oracles = [r for r in rows if r["kind"] == "oracle"]
    assert {r["oracle"] for r in oracles} >= {"token", "logits", "cache", "naive", "mask_heads"}
    assert all(r["verdict"] == "pass" for r in oracles)
    # the engine's runs and the attention kernel's (mask_heads) came from the FMA build
    assert ran_fused(oracles) == {"fused"}


def test_hybrid_judges_the_fused_build(results_dir):
    assert cli.main(["run", "hybrid", "backend=native", "mode=oracle", "fused=true", *HYBRID_SMALL]) == 0
    rows = ResultsStore(results_dir).records("hybrid")
    assert len(rows) == 2 * 9 and all(r["verdict"] == "pass" and r["params"]["fused"] is True for r in rows)
    # the padded tail leaves the bytes of an exact-length call in the fused build too
    assert all(r["metrics"]["bitexact"] for r in rows if r["oracle"] == "tail_bytes")
    assert ran_fused(rows) == {"fused"}


@pytest.mark.parametrize("experiment", ["chunk_prefill", "hybrid", "tail"])
def test_fused_without_native_programs_is_refused(experiment, capsys):
    assert cli.main(["run", experiment, "backend=refimpl", "fused=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fused=true" in err[0] and "backend=refimpl" in err[0]


@pytest.mark.parametrize("target,fused,fma", [("arm32", True, True), ("arm32", False, False), ("aarch64", True, True),
                                              ("hexagon", True, True), ("aarch64", False, False)])
def test_a_build_says_how_it_computes(target, fused, fma):
    computes = build.multiply_add(target, fused)
    assert (computes == "fused") is fma


@pytest.mark.parametrize("toolchain", ["gnu", "zig"])
def test_arm32s_fused_build_is_built_for_vfpv4(toolchain):
    """The FPU each arm32 build targets is part of its identity (its cache key and build.json): VFPv4 for
    FUSED=1 only; FUSED=0 keeps ARMv7-A NEON VFPv3's flags."""
    try:
        unfused, fused = (build.toolchain_identity("arm32", toolchain, f) for f in (False, True))
    except build.ToolMissing as e:
        pytest.skip(str(e))
    assert "VFPv3" in unfused["fpu"] and "vfpv4" in fused["fpu"]
    if toolchain == "zig":
        assert unfused["target"].endswith("+neon+vfp3") and fused["target"].endswith("+neon+vfp4")


def test_a_build_from_before_the_label_reads_as_what_ran(tmp_path):
    """A cached arm32 FUSED=1 build from before the label (VFPv3 then) said fused: true: read back, it says
    what it computed."""
    folder = tmp_path / "arm32-fused-0123456789abcdef"
    folder.mkdir()
    (folder / "build.json").write_text(json.dumps({"target": "arm32", "toolchain": "gnu", "fused": True}))
    info = build.build_info(folder / "tb_gemm_bench")
    assert info["fused"] is False and info["fused_requested"] is True and "unfused" in info["multiply_add"]


TAIL_TINY = ["mode=oracle", "shape.vocab=256", "shape.hidden=64", "shape.heads=4", "shape.head_dim=16", "shape.mlp=128",
             "oracle.grid_windows=[16]", "oracle.grid_sinks=[0]"]


def test_tail_judges_the_fused_build(results_dir):
    assert cli.main(["run", "tail", "backend=native", "fused=true", *TAIL_TINY]) == 0
    rows = ResultsStore(results_dir).records("tail")
    oracles = [r for r in rows if r["kind"] == "oracle"]
    assert oracles and all(r["verdict"] == "pass" for r in oracles)
    assert ran_fused(oracles) == {"fused"}
