"""An engine in Python through engine contract v1: tests/data/hf_engine.py, Hugging Face transformers reading
the Hugging Face folder testbed hands it (model_formats: [hf]) and serving chunk_prefill with transformers' own
KV cache, judged by `testbed run chunk_prefill backend=engine` against testbed's reading of the same folder
(testbed.models.checkpoints.load_hf_folder, refimpl.gemma, and the float64 model). The checkpoint is made by
transformers here (tests/test_transformers_crosscheck.py's: a query scale and RoPE bases no default gives, a
sliding window shorter than the prompt). The same engine with its cache not carried from call to call fails."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

pytest.importorskip("torch", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
pytest.importorskip("transformers", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)

from testbed import config, runner  # noqa: E402
from tests.test_transformers_crosscheck import ROPE, SHAPE, make  # noqa: E402

ENGINE = Path(__file__).parent / "data" / "hf_engine.py"
CASE = ["mode=oracle", "chunk=4", "cases=[{past: 9, tokens: 7}]"]  # a partial past call; past the window of 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "gemma3"
    make(folder, SHAPE, ROPE, 0)
    return folder


def lab_with(tmp_path: Path, source: str) -> Path:
    """A lab whose engines/hf-transformers.yaml runs `source` (the example's text, or a planted copy)."""
    lab = tmp_path / "lab"
    (lab / "engines").mkdir(parents=True)
    (lab / "hf_engine.py").write_text(source)
    (lab / "engines" / "hf-transformers.yaml").write_text(textwrap.dedent(f"""\
        name: hf-transformers
        contract: 1
        build: {{prebuilt: {{host: ../hf_engine.py}}}}
        program: hf_engine.py
        abis: [host]
        supports: {{techniques: [chunk_prefill], model_formats: [hf]}}
        invoke: [{sys.executable}, "{{program}}", "{{request}}", "{{response}}"]
        timeout_s: 600
        counts: process
        """))
    return lab


def verdicts(lab: Path, checkpoint: Path, monkeypatch) -> dict[str, dict]:
    monkeypatch.setenv("TESTBED_LAB", str(lab))
    outcome = runner.execute(config.load(["experiment=chunk_prefill", "device=host", "backend=engine",
                                          "engine=hf-transformers", f"model.checkpoint={checkpoint}", *CASE]))
    return {r["oracle"]: r for r in outcome.rows if r["kind"] == "oracle"}


def test_a_transformers_engine_gets_a_verdict_through_the_contract(checkpoint, tmp_path, results_dir, monkeypatch):
    records = verdicts(lab_with(tmp_path, ENGINE.read_text()), checkpoint, monkeypatch)
    said = {oracle: r["verdict"] for oracle, r in records.items()}
    assert said == {"token": "pass", "logits": "pass", "naive": "pass", "cache": "not supported"}, records
    assert records["logits"]["artifacts"]["model_format"] == "hf"
    assert records["logits"]["artifacts"]["model_file"] == str(checkpoint)  # the folder itself, as given
    assert records["token"]["backend"] == "engine:hf-transformers"
    assert records["token"]["evidence"][0]["detail"]["engine_reported"]["version"].startswith("transformers ")


def test_the_same_engine_without_its_past_fails(checkpoint, tmp_path, results_dir, monkeypatch):
    """Planted: each call starts from an empty cache (the past is computed, then forgotten)."""
    source = ENGINE.read_text()
    carried = "past_key_values=cache,"
    assert source.count(carried) == 1
    planted = source.replace(carried, "past_key_values=type(cache)(config=model.config),")
    records = verdicts(lab_with(tmp_path, planted), checkpoint, monkeypatch)
    assert records["logits"]["verdict"] == "fail" and records["naive"]["verdict"] == "fail", records
