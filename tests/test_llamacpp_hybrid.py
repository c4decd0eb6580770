"""libllama runs the Qwen3.5 hybrid from the GGUF testbed writes (testbed.models.gguf_files).

A tiny Qwen3.5 is made by transformers (tests/hybrid_support.py: Gated DeltaNet layers with grouped
value heads, gated full attention, random norms and gates), written to GGUF by testbed, and run by
llama.cpp's own loader and graph (src/models/qwen35.cpp) through tb_llama_logits, built from the
llama-cpp-python sdist's tree for the device. Its logits must give transformers' token at every
position, and agree by NMSE with transformers and with testbed's reference reading the same file
(refimpl.qwen35 through hybrid_checkpoints.load_gguf). A bug the writer and testbed's reader share
(the value heads left in Hugging Face's grouped order, which ggml's broadcasting reads tiled) passes
testbed's own round trip and is caught here, by llama.cpp.

Then through the engine contract (`testbed run hybrid backend=llamacpp`: tb_llama_engine): transformers'
token at every call boundary, the first token equal for every C, and the padded tail rolled back: refused
by llama.cpp without recurrent snapshots (recorded "not supported" in its words), byte-identical to the
unpadded tail with one snapshot per pad row (n_rs_seq); a planted kept pad row and a GGUF with grouped
value heads each fail.

libllama is a heavy build (about 10 minutes cold on two cores, per target), so this file is opt-in:
`pytest -m slow_build tests/test_llamacpp_hybrid.py` (about 2 minutes once built); qemu-aarch64 runs
one representative of each part.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from refimpl import qwen35
from testbed.backends.llamacpp import build, models
from testbed.devices import connect, load_profile
from testbed.errors import UsageError
from testbed.models import gguf_files, hybrid_checkpoints
from testbed.oracles.numerical import nmse
from tests.hybrid_support import VARIANTS, make_tiny_qwen35

pytestmark = [pytest.mark.slow_build,
              pytest.mark.skipif(shutil.which("cmake") is None, reason="libllama is built from source with cmake")]

PROMPT_TOKENS = 80  # past ggml's GDN chunk of 64: llama.cpp's chunked recurrence crosses a boundary
LLAMACPP_TOLERANCE = 1e-9  # ggml's float32 kernels (its own exp, softplus, l2 norm): measured 4e-12 to 7e-12


@pytest.fixture(scope="module", params=VARIANTS)
def made(request, tmp_path_factory):
    pytest.importorskip("transformers", exc_type=ImportError)
    return make_tiny_qwen35(tmp_path_factory.mktemp("qwen35") / "tiny", VARIANTS[request.param], PROMPT_TOKENS)


@pytest.fixture(scope="module")
def written(made, tmp_path_factory):
    return gguf_files.write_gguf(made.folder, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def host_program():
    return build.build("host", programs=("tb_llama_logits",))


@pytest.fixture(scope="module")
def host():
    device = connect(load_profile("host"))
    yield device
    device.close()


def refimpl_logits(path, tokens) -> np.ndarray:
    cfg, w = hybrid_checkpoints.load_checkpoint(path)
    return qwen35.redecode(w, cfg, tokens)[0]


def test_llamacpp_gives_transformers_token_at_every_position(made, written, host_program, host):
    theirs, evidence = models.logits(host, host_program, written, made.prompt)
    assert theirs.shape == made.logits.shape
    assert (theirs.argmax(-1) == made.logits.argmax(-1)).all()
    assert nmse(made.logits, theirs) < LLAMACPP_TOLERANCE
    assert nmse(refimpl_logits(written, made.prompt), theirs) < LLAMACPP_TOLERANCE
    assert evidence["sha256"]


def test_value_heads_left_grouped_pass_testbeds_round_trip_and_llamacpp_catches_them(made, tmp_path, host_program,
                                                                                    host, monkeypatch):
    monkeypatch.setattr(hybrid_checkpoints, "_reorder_v_heads", lambda name, a, cfg, to_tiled: a)
    planted = gguf_files.write_gguf(made.folder, tmp_path / "grouped.gguf")  # the round trip cannot see it
    assert nmse(made.logits, refimpl_logits(planted, made.prompt)) < 1e-9
    theirs, _ = models.logits(host, host_program, planted, made.prompt)
    assert nmse(made.logits, theirs) > 1e3 * LLAMACPP_TOLERANCE


def test_a_file_llamacpps_loader_refuses_is_an_error_quoting_it(made, tmp_path, host_program, host, monkeypatch):
    """Without rope.dimension_sections (which Qwen3.5's loader requires) libllama refuses the file;
    its own message reaches the error."""
    import gguf

    from testbed.backends.native.device import NativeRunFailed

    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_sections", lambda self, dims: None)
    cfg, w = hybrid_checkpoints.load_checkpoint(made.folder)
    path = hybrid_checkpoints.save_gguf(tmp_path / "nosections.gguf", cfg, w)
    with pytest.raises(UsageError, match="rope.dimension_sections' is missing"):
        hybrid_checkpoints.load_gguf(path)  # testbed's reader refuses it too
    with pytest.raises(NativeRunFailed, match="key not found in model: qwen35.rope.dimension_sections"):
        models.logits(host, host_program, path, made.prompt)


AARCH64 = pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None or shutil.which("qemu-aarch64") is None,
                             reason="g++-aarch64-linux-gnu and qemu-user (scripts/bootstrap.sh --test)")


@AARCH64
def test_llamacpp_on_qemu_aarch64_gives_the_hosts_tokens(made, written, host_program, host):
    program = build.build("aarch64", programs=("tb_llama_logits",))
    device = connect(load_profile("qemu-aarch64"))
    try:
        theirs, evidence = models.logits(device, program, written, made.prompt)
    finally:
        device.close()
    assert (theirs.argmax(-1) == made.logits.argmax(-1)).all()
    assert nmse(made.logits, theirs) < LLAMACPP_TOLERANCE
    assert evidence["device"] == "qemu-aarch64"


def test_the_logits_mode_judges_the_hybrids_gguf(made, written, host_program, results_dir):
    from testbed import config, runner

    outcome = runner.execute(config.load(["experiment=llamacpp", "device=host", "mode=logits", f"gguf={written}",
                                          f"logits.tokens={PROMPT_TOKENS}"]))
    (record,) = outcome.frame().query("kind == 'oracle'").to_dict("records")
    assert record["verdict"] == "pass" and record["metrics.argmax_agreement"] == 1.0, record["detail"]
    assert "refimpl.qwen35" in record["params.reference"]


# --- through the adapter: `testbed run hybrid backend=engine engine=llamacpp` (engine contract v1) -----------

ADAPTER_CASE = ["backend=engine", "mode=oracle", "chunk=64", "oracle.past=[0,30]",
                "oracle.tokens=[64,50]", "oracle.chunks=[16,32,64]", "oracle.tails=[1,9]"]


def run_hybrid(made, tmp_path, device="host", engine="engine=llamacpp", overrides=()):
    from testbed import config, runner

    prompt = tmp_path / "prompt.npy"
    np.save(prompt, made.prompt)
    outcome = runner.execute(config.load(["experiment=hybrid", *ADAPTER_CASE, engine, f"device={device}",
                                          f"model.checkpoint={made.folder}", f"model.prompt={prompt}", *overrides]))
    return {r["case"]: r for r in outcome.frame().query("kind == 'oracle'").to_dict("records")}


def test_the_adapter_gives_transformers_tokens_and_refuses_to_roll_back_recurrent_state(made, tmp_path, results_dir):
    records = run_hybrid(made, tmp_path)
    for case in ("P=0,n=64,C=64/engine", "P=30,n=50,C=64/engine"):
        token, naive = records[f"{case}/token"], records[f"{case}/naive"]
        assert token["verdict"] == "pass" and naive["verdict"] == "pass", (token["detail"], naive["detail"])
        position = int(token["params.position"])
        assert token["metrics.token"] == int(made.logits[position].argmax())  # transformers' token
        assert token["evidence"][0]["ran"] == "tb_llama_engine"
    chunks = records["N=80,C=16|32|64/engine/chunk_invariance"]
    assert chunks["verdict"] == "pass", chunks["detail"]
    tokens = {int(chunks[f"metrics.tokens.{c}"]) for c in (16, 32, 64)}
    assert tokens == {int(made.logits[79].argmax())}  # transformers' token, whatever the call boundaries
    # llama.cpp's recurrent memory cannot lose a partial range unless it keeps a snapshot per pad row (n_rs_seq,
    # at most C - 2 with ubatches of C): refused then, recorded "not supported" in its words, never passed
    for case in ("N=65,tail=1,C=64,rs=0", "N=65,tail=1,C=64,rs=62", "N=73,tail=9,C=64,rs=0"):
        rollback = records[f"{case}/engine/state_bytes"]
        assert rollback["verdict"] == "not supported", rollback
        assert "llama_memory_seq_rm(seq 0" in rollback["detail"] and "returned false" in rollback["detail"]
    # with 55 snapshots for 55 pads it rolls back to the bytes of the unpadded tail, and the same next token
    for oracle in ("state_bytes", "first_token"):
        rolled = records[f"N=73,tail=9,C=64,rs=55/engine/{oracle}"]
        assert rolled["verdict"] == "pass", rolled["detail"]
    assert records["N=73,tail=9,C=64,rs=55/engine/first_token"]["metrics.token"] == int(made.logits[72].argmax())


def test_an_adapter_that_keeps_a_pad_row_fails_the_rollback(made, tmp_path, results_dir, monkeypatch):
    """tb_llama_engine built with TB_PLANT_KEEP_PAD_ROW, as a lab's engine: the recurrent state rolled back one
    row short differs from the unpadded tail's."""
    lab = tmp_path / "lab"
    (lab / "engines").mkdir(parents=True)
    text = (build.ROOT / "engines" / "llamacpp.yaml").read_text().replace("name: llamacpp", "name: llamacpp-planted")
    text = text.replace("tb_llama_engine", "tb_llama_engine_plant_keep_pad_row")
    (lab / "engines" / "llamacpp-planted.yaml").write_text(text.replace("source: ../testbed/backends/llamacpp",
                                                                       f"source: {build.HERE}"))
    monkeypatch.setenv("TESTBED_LAB", str(lab))
    records = run_hybrid(made, tmp_path, "host", "engine=llamacpp-planted")
    planted = records["N=73,tail=9,C=64,rs=55/engine/state_bytes"]
    assert planted["verdict"] == "fail" and "state.bin holds" in planted["detail"], planted  # the kept row's K/V


def test_a_gguf_with_the_value_heads_grouped_fails_the_adapters_oracles(made, tmp_path, results_dir, monkeypatch):
    monkeypatch.setattr(gguf_files, "CACHE", tmp_path / "gguf")  # the planted file stays out of the shared cache
    monkeypatch.setattr(hybrid_checkpoints, "_reorder_v_heads", lambda name, a, cfg, to_tiled: a)
    records = run_hybrid(made, tmp_path)
    assert records["P=30,n=50,C=64/engine/naive"]["verdict"] == "fail"
    assert records["P=30,n=50,C=64/engine/naive"]["metrics.nmse"] > 1e-7


def test_a_gguf_that_lost_a_field_fails_against_its_folder_and_passes_alone(made, written, tmp_path, results_dir):
    """model.checkpoint=DIR model.gguf=FILE: llama.cpp reads FILE, the oracles the folder. A GGUF that lost its
    RoPE base (llama.cpp and testbed's reader then take 10000; the lflf variant's is 1e6) fails; alone, the same
    file passes against testbed's reading of it, which is why a folder, when there is one, is the reference."""
    from tests.test_llamacpp_engine import rewrite_gguf

    cfg, _ = hybrid_checkpoints.load_hf_folder(made.folder)
    if cfg.rope_theta == 10_000.0:
        pytest.skip("this variant's RoPE base is the one a GGUF without it reads")
    lossy = rewrite_gguf(written, tmp_path / "lossy.gguf", arch="qwen35", drop=("qwen35.rope.freq_base",))
    records = run_hybrid(made, tmp_path, overrides=(f"model.gguf={lossy}",))
    assert records["P=30,n=50,C=64/engine/naive"]["verdict"] == "fail", records["P=30,n=50,C=64/engine/naive"]
    alone = run_hybrid(made, tmp_path, overrides=(f"model.gguf={lossy}", "model.checkpoint=null"))
    assert alone["P=30,n=50,C=64/engine/naive"]["verdict"] == "pass"
    assert "lost on both sides" in alone["P=30,n=50,C=64/engine/naive"]["artifacts.reference"]


@AARCH64
def test_the_adapter_on_qemu_aarch64_gives_the_hosts_verdicts(made, tmp_path, results_dir):
    """libllama for aarch64 (static, under qemu-user): the same tokens, the same refusal to roll back."""
    records = run_hybrid(made, tmp_path, device="qemu-aarch64")
    verdicts = {case: r["verdict"] for case, r in records.items()}
    refused = ("N=65,tail=1,C=64,rs=0/engine/state_bytes", "N=65,tail=1,C=64,rs=62/engine/state_bytes",
               "N=73,tail=9,C=64,rs=0/engine/state_bytes")
    assert verdicts == {case: ("not supported" if case in refused else "pass") for case in verdicts}
    assert {r["evidence"][0]["device"] for r in records.values()} == {"qemu-aarch64"}
    token = records["P=30,n=50,C=64/engine/token"]
    assert token["metrics.token"] == int(made.logits[79].argmax())
