"""A tiny Gemma 3 as llama.cpp's users make it: built by transformers, given a SentencePiece tokenizer,
converted by llama.cpp's own convert_hf_to_gguf.py (the sdist's tree, with its own gguf-py). Three
references then compute it independently:

  transformers   from the Hugging Face folder (eager attention, float32)
  refimpl        from the GGUF, through testbed.models.checkpoints' loader (which must undo what the
                 converter changed: norm weights stored as 1 + w, names, the trimmed vocabulary)
  llama.cpp      from the same GGUF, through libllama (tb_llama_logits, built from the same tree)

refimpl and transformers agree to float32 rounding (NMSE ~1e-13). llama.cpp computes in float32 with
ggml's own kernels (a GELU from a float16 table, its own softmax), so it agrees to about 1e-6; every
planted bug below lands orders of magnitude above either tolerance. The model is also what llama-bench
measures on the emulated aarch64 device.

libllama is a heavier build than the ggml-only programs (about 10 minutes cold on two cores), so the
tests that run llama.cpp itself are opt-in: `pytest -m slow_build`.
"""

from __future__ import annotations

import io
import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is made here: never reach for a hub

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
spm = pytest.importorskip("sentencepiece", reason="the full extra: pip install 'testbed[full]'", exc_type=ImportError)
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

from refimpl import gemma  # noqa: E402
from testbed import config, runner
from testbed.models import checkpoints  # noqa: E402
from testbed.backends.llamacpp import build, models  # noqa: E402
from testbed.devices import connect, load_profile  # noqa: E402
from testbed.devices.transport import sha256_file  # noqa: E402
from testbed.oracles.numerical import nmse  # noqa: E402

REFIMPL_TOLERANCE = 1e-9  # float32 on both sides
LLAMACPP_TOLERANCE = 1e-5  # ggml's float16-table GELU and its own reductions
TOKENS = 24  # more than the window of 8: the local layers drop keys

# query_pre_attn_scalar = head_dim: a GGUF carries no query scale (llama.cpp derives it from the block
# count), and the local RoPE base is not llama.cpp's default 10000, so the converter must write it.
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5_000.0}}
CORPUS = [f"chunk {i} of the prefill fills the cache window with {i * 7 % 23} tokens" for i in range(300)]

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="the llama.cpp tree comes with its build tools")


class Converted:
    """The Hugging Face folder, llama.cpp's GGUF of it, and transformers' logits for one prompt."""

    def __init__(self, folder, gguf, tokens, logits):
        self.folder, self.gguf, self.tokens, self.logits = folder, gguf, tokens, logits


def tokenizer_model() -> bytes:
    """A small SentencePiece model, trained here: the converter reads a Gemma vocabulary from it."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=out, vocab_size=80,
                                   model_type="unigram", hard_vocab_limit=False, pad_id=0, eos_id=1, bos_id=2,
                                   unk_id=3, minloglevel=2)
    return out.getvalue()


@pytest.fixture(scope="session")
def llamacpp_tree():
    return build.sdist_source()


@pytest.fixture(scope="session")
def converted(llamacpp_tree, tmp_path_factory) -> Converted:
    folder = tmp_path_factory.mktemp("hf") / "gemma3"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(sp := tokenizer_model())
    vocab = spm.SentencePieceProcessor(model_proto=sp).get_piece_size()
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=vocab, **SHAPE, rope_parameters=json.loads(json.dumps(ROPE)),
                           attn_implementation="eager")
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)  # a (1 + w) slip must show
    model.save_pretrained(folder)
    tokens = np.random.default_rng(0).integers(0, vocab, TOKENS)
    with torch.no_grad():
        logits = model(torch.tensor(tokens)[None]).logits[0].numpy()
    gguf = models.convert(llamacpp_tree, folder, folder.parent / "gemma3-f32.gguf")
    return Converted(folder, gguf, tokens, logits)


def refimpl_logits(path, tokens) -> np.ndarray:
    cfg, w = checkpoints.load_checkpoint(path)
    return np.stack([gemma.redecode(w, cfg, tokens, p) for p in range(len(tokens))])


# --- llama.cpp's converter, testbed's loader ---------------------------------------------------------


def test_llamacpps_converter_writes_a_gguf_testbeds_loader_reads_as_transformers_model(converted):
    cfg, _ = checkpoints.load_checkpoint(converted.gguf)
    hf_cfg, _ = checkpoints.load_checkpoint(converted.folder)
    assert cfg == hf_cfg  # every field, the local RoPE base and the global layers' scaling among them
    error = nmse(converted.logits, refimpl_logits(converted.gguf, converted.tokens))
    assert error < REFIMPL_TOLERANCE, f"NMSE {error:.3g} against transformers"


def test_a_loader_that_forgets_the_converters_norm_offset_is_caught(converted, monkeypatch):
    monkeypatch.setattr(checkpoints, "GGUF_NORM_SHIFT", 0.0)  # the converter stored 1 + w; read as w
    error = nmse(converted.logits, refimpl_logits(converted.gguf, converted.tokens))
    assert error > 1e3 * REFIMPL_TOLERANCE, f"NMSE {error:.3g}: the planted slip went unseen"


def test_the_native_engine_runs_the_converters_gguf_to_the_references_tokens(converted, results_dir):
    outcome = runner.execute(config.load(["experiment=chunk_prefill", "device=host", "backend=native", "mode=oracle",
                                          f"model.checkpoint={converted.gguf}", "chunk=4", "cases=[{past: 12, tokens: 9}]"]))
    oracles = outcome.frame().query("kind == 'oracle'")
    assert len(oracles) > 0 and (oracles["verdict"] == "pass").all(), oracles[["case", "oracle", "verdict", "detail"]]


# --- llama.cpp itself: the third reference (opt-in: libllama) ---------------------------------------


@pytest.fixture(scope="session")
def logits_program():
    return build.build("host", programs=("tb_llama_logits",))


@pytest.fixture(scope="session")
def host():
    device = connect(load_profile("host"))
    yield device
    device.close()


def run_logits(gguf, *overrides):
    outcome = runner.execute(config.load(["experiment=llamacpp", "device=host", "mode=logits", f"gguf={gguf}",
                                          f"logits.tokens={TOKENS}", *overrides]))
    return outcome.frame().query("kind == 'oracle'")


@pytest.mark.slow_build
def test_llamacpps_logits_agree_with_transformers(converted, logits_program, host):
    theirs, evidence = models.logits(host, logits_program, converted.gguf, converted.tokens)
    assert evidence["sha256"] == sha256_file(logits_program.program("tb_llama_logits"))
    error = nmse(converted.logits, theirs)
    assert error < LLAMACPP_TOLERANCE, f"NMSE {error:.3g} against transformers"


@pytest.mark.slow_build
def test_the_logits_mode_judges_testbeds_reading_of_the_gguf_by_llamacpps(converted, logits_program, results_dir):
    (record,) = run_logits(converted.gguf).to_dict("records")
    assert record["verdict"] == "pass" and record["metrics.argmax_agreement"] == 1.0, record["detail"]
    assert record["evidence"][0]["sha256"] == sha256_file(logits_program.program("tb_llama_logits"))


@pytest.mark.slow_build
def test_the_logits_mode_catches_a_refimpl_norm_slip(converted, logits_program, results_dir, monkeypatch):
    """The bug both Python references could share (written from one reading of Gemma): RMSNorm by w
    instead of (1 + w). llama.cpp, reading the converter's GGUF with its own graph, disagrees."""
    monkeypatch.setattr(gemma, "rms_norm", lambda x, w, eps: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w)
    (record,) = run_logits(converted.gguf).to_dict("records")
    assert record["verdict"] == "fail" and record["metrics.nmse"] > 1e3 * LLAMACPP_TOLERANCE, record


def test_the_logits_mode_needs_a_gguf_on_this_host(results_dir, capsys):
    from testbed.cli import main

    assert main(["run", "llamacpp", "device=host", "mode=logits", "gguf=/nonexistent/m.gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert "gguf='/nonexistent/m.gguf' is not accepted with mode=logits" in err and "\n" not in err
    assert not (results_dir / "records.jsonl").exists()


AARCH64 = pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None or shutil.which("qemu-aarch64") is None,
                             reason="g++-aarch64-linux-gnu and qemu-user (scripts/bootstrap.sh --test)")


@AARCH64
@pytest.mark.slow_build  # libllama and common for aarch64
def test_llama_bench_measures_pp512_of_the_converted_gemma3_on_qemu_aarch64(converted, results_dir):
    bench = build.build("aarch64", programs=("llama-bench",))
    outcome = runner.execute(config.load(["experiment=llamacpp", "device=qemu-aarch64", "mode=bench",
                                          f"gguf={converted.gguf}", "reps=1"]))
    df = outcome.frame()
    pp = df[df["case"] == "pp512/t1"].iloc[0]
    assert pp["kind"] == "measure" and pp["figures.tokens_per_s.median"] > 0
    assert pp["emulated"]  # qemu: a correctness device, its figures kept out of tables and reports
    assert pp["evidence"][0]["sha256"] == sha256_file(bench.program("llama-bench"))
