"""A model the engine misreads is not judged against itself.

llama.cpp's own converter (convert_hf_to_gguf.py of the sdist's tree) writes a Gemma 3 GGUF without the
query scale (query_pre_attn_scalar: llama.cpp derives one from the block count) and without a layer
pattern other than its default (one global layer in six). llama.cpp then computes another model than the
Hugging Face folder's, and testbed's GGUF reader, which reads as llama.cpp reads, computes the same other
model: a reference taken from the GGUF agrees with llama.cpp and passes (NMSE 0.27-1.28 from
transformers, measured on main cc21dac). So when a folder is given, the reference reads the folder:

  model.checkpoint=DIR model.gguf=FILE   llama.cpp reads FILE, the reference reads DIR: a lossy FILE fails
  model.checkpoint=DIR                   llama.cpp reads testbed's GGUF of DIR, judged to read back as DIR
                                         before it is handed over (a field a GGUF cannot carry is refused)
  model.checkpoint=FILE.gguf             the file is all there is: judged against testbed's reading of it,
                                         and every record says so

libllama is the default run's build (tests/test_llamacpp_engine.py); the converter runs in seconds.
"""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

torch = pytest.importorskip("torch", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
spm = pytest.importorskip("sentencepiece", reason="the full extra: pip install 'testbed[full]'", exc_type=ImportError)
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

from testbed import config, runner  # noqa: E402
from testbed.backends.llamacpp import build, models  # noqa: E402
from testbed.errors import UsageError  # noqa: E402
from testbed.models import checkpoints  # noqa: E402
from tests.test_llamacpp_models import ROPE, SHAPE, tokenizer_model  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="the llama.cpp tree comes with its build tools")

# What the converter loses, as a folder that has it: a layer pattern that is not one global in six, a
# query scale that is not head_dim (SHAPE's head_dim is 16)
LOST = {"layer pattern": {"layer_types": ["sliding_attention", "full_attention"] * 3},
        "query scale": {"query_pre_attn_scalar": 32}}
CASE = ["chunk=16", "cases=[{past: 20, tokens: 12}]"]


@pytest.fixture(scope="module", params=list(LOST))
def converted(request, tmp_path_factory):
    """(folder, llama.cpp's converter's GGUF of it) for a folder with the field the converter loses."""
    folder = tmp_path_factory.mktemp("lossy") / "gemma3"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(sp := tokenizer_model())
    torch.manual_seed(2)
    cfg = Gemma3TextConfig(vocab_size=spm.SentencePieceProcessor(model_proto=sp).get_piece_size(),
                           **{**SHAPE, **LOST[request.param]}, rope_parameters=json.loads(json.dumps(ROPE)),
                           attn_implementation="eager")
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    gguf = models.convert(build.sdist_source(), folder, folder.parent / "converted.gguf")
    assert checkpoints.load_checkpoint(gguf)[0] != checkpoints.load_checkpoint(folder)[0]  # the field is lost
    return request.param, folder, gguf


def verdicts(*overrides) -> dict[str, dict]:
    """The run's oracle records by oracle."""
    outcome = runner.execute(config.load(["experiment=chunk_prefill", "device=host", "backend=llamacpp", "mode=oracle",
                                          *CASE, *overrides]))
    return {r["oracle"]: r for r in outcome.rows if r["kind"] == "oracle"}


def test_a_gguf_that_lost_a_field_fails_against_its_folder(converted, results_dir):
    lost, folder, gguf = converted
    records = verdicts(f"model.checkpoint={folder}", f"model.gguf={gguf}")
    assert records["logits"]["verdict"] == "fail" and records["naive"]["verdict"] == "fail", records
    artifacts = records["logits"]["artifacts"]
    assert artifacts["model_file"] == str(gguf) and str(folder) in artifacts["reference"]


def test_the_folder_alone_is_handed_to_llamacpp_as_testbeds_faithful_gguf_or_refused(converted, results_dir):
    lost, folder, _ = converted
    if lost == "query scale":  # no GGUF carries it: testbed refuses to write one rather than write it wrong
        with pytest.raises(UsageError, match="query_pre_attn_scalar=32 cannot be stored in a GGUF"):
            verdicts(f"model.checkpoint={folder}")
        return
    records = verdicts(f"model.checkpoint={folder}")
    said = {oracle: r["verdict"] for oracle, r in records.items()}
    assert said == {"token": "pass", "logits": "pass", "naive": "pass", "cache": "not supported"}, records
    assert records["logits"]["artifacts"]["model_format"] == "gguf"


def test_a_gguf_alone_is_judged_against_itself_and_the_records_say_so(converted, results_dir):
    _, _, gguf = converted
    records = verdicts(f"model.checkpoint={gguf}")
    assert records["logits"]["verdict"] == "pass"  # llama.cpp and testbed read the file alike, both wrong
    assert "a field the file lost is lost on both sides" in records["logits"]["artifacts"]["reference"]


def test_a_gguf_beside_no_folder_is_refused_in_one_line(converted, results_dir):
    _, _, gguf = converted
    with pytest.raises(UsageError, match="model.gguf=.* needs model.checkpoint=DIR"):
        verdicts(f"model.gguf={gguf}")


@pytest.mark.slow_build  # tb_llama_logits: libllama linked into one more program
def test_the_logits_mode_reads_the_folder_too(converted, results_dir):
    """`testbed run llamacpp mode=logits gguf=FILE checkpoint=DIR`: llama.cpp's logits at every position against
    refimpl on the folder; without checkpoint=, against testbed's reading of the file, which the record says."""
    _, folder, gguf = converted

    def logits(*overrides):
        outcome = runner.execute(config.load(["experiment=llamacpp", "device=host", "mode=logits", f"gguf={gguf}",
                                              "logits.tokens=24", *overrides]))
        (record,) = [r for r in outcome.rows if r["kind"] == "oracle"]
        return record

    against_folder = logits(f"checkpoint={folder}")
    assert against_folder["verdict"] == "fail" and "load_hf_folder" in against_folder["params"]["reference"]
    alone = logits()
    assert alone["verdict"] == "pass" and "judged against itself" in alone["params"]["reference"]
