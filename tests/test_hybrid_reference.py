"""refimpl.qwen35 against transformers' own Qwen3_5ForCausalLM, on a tiny random checkpoint.

The checkpoint is built here from transformers' config class (no download), with every parameter
drawn at random (norm weights, A_log and dt_bias included, so that no term hides behind an identity
initialisation), saved with save_pretrained and loaded back through testbed.hybrid_checkpoints. Then
at every position the logits, and after the prompt every carried state (conv states, recurrent
states, the full-attention layers' K/V), must match by NMSE. Planted bugs must fail the same check.
"""

import json

import numpy as np
import pytest

from refimpl import qwen35
from testbed.errors import UsageError
from testbed.hybrid_checkpoints import config_from_hf, load_hf_folder
from testbed.oracles import check_nmse

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT_TOKENS = 150  # across transformers' own GDN chunk of 64, twice
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
VARIANTS = {
    "lllf": TINY,  # Qwen3.5's pattern: three GDN layers, then one full
    # every other layer full, tied embeddings, a kernel of 3, RoPE over half the head
    "lflf-tied": {**TINY, "full_attention_interval": 2, "tie_word_embeddings": True, "linear_conv_kernel_dim": 3,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
}


@pytest.fixture(scope="session", params=VARIANTS)
def hf_run(request, tmp_path_factory):
    """(folder, prompt, logits [T, vocab], {array name: value} in refimpl's layouts) from transformers."""
    settings = VARIANTS[request.param]
    config = transformers.Qwen3_5TextConfig(**settings)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1, 16)))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    folder = tmp_path_factory.mktemp("qwen35") / "tiny"
    model.save_pretrained(folder)
    prompt = np.random.default_rng(1).integers(0, TINY["vocab_size"], PROMPT_TOKENS)
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        logits = model(torch.tensor(prompt)[None], cache=cache, use_cache=True).logits[0].numpy()
    states = {}
    kernel = settings["linear_conv_kernel_dim"]
    for i, t in enumerate(config.layer_types):
        if t == "linear_attention":
            # transformers keeps the last K conv inputs channels-first; the next call reads K - 1
            states[f"{i}.conv"] = cache.get_conv_state(i)[0].numpy()[:, -(kernel - 1):].T
            # [H_v, d_k, d_v] -> refimpl.gdn's transposed [H_v, d_v, d_k]
            states[f"{i}.recurrent"] = np.swapaxes(cache.get_recurrent_state(i)[0].numpy(), -1, -2)
        else:
            states[f"{i}.k"] = cache.layers[i].keys[0].numpy()
            states[f"{i}.v"] = cache.layers[i].values[0].numpy()
    return folder, prompt, logits, states


@pytest.fixture(scope="session")
def checkpoint(hf_run):
    return load_hf_folder(hf_run[0])


def test_loader_reads_the_architecture(checkpoint):
    cfg, w = checkpoint
    if cfg.tie_embeddings:
        assert cfg.layer_types == ("linear", "full") * 2 and (cfg.conv_kernel, cfg.rotary_dim) == (3, 16)
        assert "lm_head.weight" not in w
    else:
        assert cfg.layer_types == ("linear", "linear", "linear", "full") and (cfg.conv_kernel, cfg.rotary_dim) == (4, 8)
    assert (cfg.linear_k_heads, cfg.linear_v_heads) == (2, 4)


def test_logits_and_states_match_transformers(hf_run, checkpoint):
    _, prompt, hf_logits, hf_states = hf_run
    cfg, w = checkpoint
    logits, state = qwen35.redecode(w, cfg, prompt)
    v = check_nmse({"logits": hf_logits, **hf_states}, {"logits": logits, **state.arrays()})
    assert v.passed, v.detail
    assert set(hf_states) == set(state.arrays())


def test_chunked_prefill_states_match_transformers(hf_run, checkpoint):
    """The same states reached through chunk calls with past and a padded tail (150 = 2 * 64 + 22)."""
    _, prompt, hf_logits, hf_states = hf_run
    cfg, w = checkpoint
    logits, state = qwen35.prefill(w, cfg, prompt, 64, qwen35.gdn_form("chunkwise", 16), tail="padded")
    v = check_nmse({"last": hf_logits[-1], **hf_states}, {"last": logits, **state.arrays()})
    assert v.passed, v.detail


def test_planted_head_map_fails(hf_run, checkpoint, monkeypatch):
    """llama.cpp's tiled map (value head h reads key head h % H_k) where transformers interleaves."""
    _, prompt, hf_logits, _ = hf_run
    cfg, w = checkpoint
    monkeypatch.setattr(qwen35, "HEAD_MAP", "tiled")
    logits, _ = qwen35.redecode(w, cfg, prompt)
    assert not check_nmse({"logits": hf_logits}, {"logits": logits}).passed


def test_planted_conv_state_one_row_early_fails(hf_run, checkpoint, monkeypatch):
    _, prompt, _, hf_states = hf_run
    cfg, w = checkpoint
    real = qwen35.conv_state_after
    monkeypatch.setattr(qwen35, "conv_state_after", lambda rows, n, kernel: real(rows, n - 1, kernel))
    _, state = qwen35.redecode(w, cfg, prompt)
    v = check_nmse({"0.conv": hf_states["0.conv"]}, {"0.conv": state.arrays()["0.conv"]})
    assert not v.passed


def test_planted_sigmoid_gates_forced_open_fail(hf_run, checkpoint, monkeypatch):
    """Every sigmoid read as 1: attention's output gate and the GDN's beta (plain attention, full writes)."""
    _, prompt, hf_logits, _ = hf_run
    cfg, w = checkpoint
    monkeypatch.setattr(qwen35, "sigmoid", lambda x: np.ones_like(x))
    logits, _ = qwen35.redecode(w, cfg, prompt)
    assert not check_nmse({"logits": hf_logits}, {"logits": logits}).passed


# --- the loader refuses what the reference does not implement ------------------------------------------


def hf_config(**changes) -> dict:
    cfg = {**TINY, "model_type": "qwen3_5_text", "layer_types": ["linear_attention"] * 3 + ["full_attention"],
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "qwen3_next"}, "model_type 'qwen3_next' is not accepted"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported; accepted: 'silu'"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"num_experts": 8}, "config field 'num_experts' is not known"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' is not supported"),
    ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "layer type 'sliding_attention'"),
    ({"linear_value_head_dim": 32}, "linear_key_head_dim=16 differs from linear_value_head_dim=32"),
])
def test_config_refusals_name_the_value(changes, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("[", r"\[")):
        config_from_hf(hf_config(**changes), "config.json")


def test_nested_text_config_and_interval_pattern_are_read():
    text = hf_config()
    del text["layer_types"]
    text["full_attention_interval"] = 2
    cfg = config_from_hf({"model_type": "qwen3_5", "text_config": text}, "config.json")
    assert cfg.layer_types == ("linear", "full", "linear", "full")


def test_unexpected_and_missing_tensors_are_refused(hf_run, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = hf_run[0]
    tensors = load_file(str(folder / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file({**tensors, "model.layers.0.linear_attn.conv1d.bias": np.zeros(128, np.float32)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(UsageError, match="unexpected tensor 'model.layers.0.linear_attn.conv1d.bias'"):
        load_hf_folder(tmp_path)
    del tensors["model.layers.3.self_attn.q_norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(UsageError, match="missing tensor 'model.layers.3.self_attn.q_norm.weight'"):
        load_hf_folder(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_text"
