"""The Hugging Face folders testbed writes of its own seeded models (testbed.models.checkpoints.hf_folder_of for
Gemma 3, testbed.models.hybrid_checkpoints.hf_folder_of for the Qwen3.5 hybrid): what an engine that reads a
Hugging Face folder (model_formats: [hf], an exporter's input) is handed when the run names no checkpoint.
transformers loads each as its own model class and computes the logits testbed's reference computes, and
testbed's loader reads the folder back to the same config: so every experiment's model has a folder an
exporter can take."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'testbed[hf]'",
                                   exc_type=ImportError)

from refimpl import gemma, qwen35  # noqa: E402
from testbed.models import checkpoints, hybrid_checkpoints  # noqa: E402

TOLERANCE = 1e-4  # float32 transformers against the float32 references, max |logit diff| over 40 positions


def transformers_logits(folder, tokens, expected_class: str) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    assert type(model).__name__ == expected_class
    with torch.no_grad():
        return model(torch.tensor(tokens)[None]).logits[0].numpy()


@pytest.mark.parametrize("overrides", [{}, {"window": 16}])
def test_gemma3_folder(tmp_path, overrides):
    cfg = gemma.tiny_config(**overrides)
    w = gemma.init_weights(cfg, 0)
    folder = checkpoints.hf_folder_of(cfg, w, cache=tmp_path)
    assert checkpoints.load_hf_folder(folder)[0] == cfg
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, 40)
    want = np.stack([gemma.redecode(w, cfg, tokens, p) for p in (17, 39)])
    got = transformers_logits(folder, tokens, "Gemma3ForCausalLM")[[17, 39]]
    assert np.abs(got - want).max() < TOLERANCE


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True, "rotary_fraction": 0.5, "conv_kernel": 3}])
def test_qwen35_hybrid_folder(tmp_path, overrides):
    cfg = qwen35.tiny_config(**overrides)
    w = qwen35.init_weights(cfg, 0)
    folder = hybrid_checkpoints.hf_folder_of(cfg, w, cache=tmp_path)
    assert hybrid_checkpoints.load_hf_folder(folder)[0] == cfg
    assert hybrid_checkpoints.hf_folder_of(cfg, w, cache=tmp_path) == folder  # once per content
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, 40)
    got = transformers_logits(folder, tokens, "Qwen3_5ForCausalLM")
    want, _ = qwen35.redecode(w, cfg, tokens)
    assert np.abs(got - want).max() < TOLERANCE
