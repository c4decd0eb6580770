"""refimpl.qwen35 against transformers' own Qwen3_5ForCausalLM, on a tiny random checkpoint.

The checkpoint is built here from transformers' config class (no download), with every parameter
drawn at random (tests/hybrid_support.py: norm weights, A_log and dt_bias included, so that no term
hides behind an identity initialisation; gates that carry the state), saved with save_pretrained and
loaded back through testbed.models.hybrid_checkpoints. Then
at every position the logits, and after the prompt every carried state (conv states, recurrent
states, the full-attention layers' K/V), must match by NMSE. Planted bugs must fail the same check.
"""

import json

import numpy as np
import pytest

from refimpl import qwen35
from testbed.errors import UsageError
from testbed.models.hybrid_checkpoints import config_from_hf, load_hf_folder
from testbed.oracles.numerical import check_nmse
from tests.hybrid_support import TINY, VARIANTS, make_tiny_qwen35

torch = pytest.importorskip("torch", exc_type=ImportError)
transformers = pytest.importorskip("transformers", exc_type=ImportError)

PROMPT_TOKENS = 150  # across transformers' own GDN chunk of 64, twice


@pytest.fixture(scope="session", params=VARIANTS)
def hf_run(request, tmp_path_factory):
    """(folder, prompt, logits [T, vocab], {array name: value} in refimpl's layouts) from transformers."""
    made = make_tiny_qwen35(tmp_path_factory.mktemp("qwen35") / "tiny", VARIANTS[request.param], PROMPT_TOKENS)
    return made.folder, made.prompt, made.logits, made.states


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
    ({"attn_output_gate": False}, "attn_output_gate=False is not supported; accepted: True"),
    ({"mamba_ssm_dtype": "bfloat16"}, "mamba_ssm_dtype='bfloat16' is not supported; accepted: 'float32'"),
    ({"full_attention_interval": 0}, "full_attention_interval=0 is not accepted"),
    ({"rope_theta": 5.0}, "rope_theta is given both at the top level and in rope_parameters"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim=0 is not accepted"),
    ({"num_key_value_heads": 3}, "must be a multiple of kv_heads"),
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


def test_fields_of_released_configs_are_honoured():
    """Released Qwen3.5 configs say attn_output_gate (the gate the reference has), the state dtype, the
    MTP head (which the causal LM never runs) and, in the older form, RoPE at the top level."""
    legacy = hf_config(attn_output_gate=True, mamba_ssm_dtype="float32", mtp_num_hidden_layers=1,
                       mtp_use_dedicated_embeddings=False, rope_theta=1e6, partial_rotary_factor=0.5)
    del legacy["rope_parameters"]
    cfg = config_from_hf(legacy, "config.json")
    assert (cfg.rope_theta, cfg.rotary_dim) == (1e6, 16)


def test_a_multimodal_checkpoints_text_model_loads_as_transformers_causal_lm_does(hf_run, checkpoint, tmp_path):
    """model_type qwen3_5: the text config nested, the text model's tensors under model.language_model.,
    the vision tower and the MTP head beside them (transformers' Qwen3_5ForCausalLM ignores both)."""
    from safetensors.numpy import load_file, save_file

    folder = hf_run[0]
    text = json.loads((folder / "config.json").read_text())
    tensors = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in load_file(str(folder / "model.safetensors")).items()}
    tensors |= {"model.visual.blocks.0.attn.qkv.weight": np.zeros((3, 3), np.float32),
                "mtp.layers.0.mlp.up_proj.weight": np.zeros((3, 3), np.float32)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text,
                                                      "vision_config": {"depth": 1}}))
    cfg, w = load_hf_folder(tmp_path)
    want_cfg, want = checkpoint
    assert cfg == want_cfg and set(w) == set(want) and all(np.array_equal(w[k], want[k]) for k in w)


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


# --- `testbed run hybrid model.checkpoint=DIR`: the checkpoint, not the seeded model -------------------


@pytest.mark.parametrize("backend", ["refimpl", "native"])
def test_run_loads_the_checkpoint_and_pins_transformers_token(hf_run, backend, results_dir, tmp_path, capsys):
    """The oracles run on the checkpoint (its digest and folder in every record) and the prompt given as
    ids; the token transformers predicts at the last position the cases reach, pinned with
    model.expected_token, passes; its runner-up pinned instead fails the run, naming both."""
    from testbed import cli
    from testbed.oracles.numerical import digest
    from testbed.results import ResultsStore

    folder, prompt, hf_logits, _ = hf_run
    np.save(tmp_path / "prompt.npy", prompt)
    best, runner_up = (int(t) for t in np.argsort(hf_logits[-1])[::-1][:2])
    assert hf_logits[-1][best] - hf_logits[-1][runner_up] > 1e-3  # no tie: the pin means one token
    args = ["run", "hybrid", f"backend={backend}", "mode=oracle", f"model.checkpoint={folder}",
            f"model.prompt={tmp_path / 'prompt.npy'}", "oracle.past=[86]", "oracle.tokens=[64]", "oracle.tails=[22]"]
    assert cli.main([*args, f"model.expected_token={best}"]) == 0, capsys.readouterr().out
    rows = ResultsStore(results_dir).records("hybrid")
    _, w = load_hf_folder(folder)
    assert {r["artifacts"]["checkpoint"] for r in rows} == {str(folder)}
    assert {r["artifacts"]["weights_sha256"] for r in rows} == {digest(*(w[k] for k in sorted(w)))}
    token = [r for r in rows if r["oracle"] == "token"]
    assert {r["metrics"]["expected"] for r in token} == {best} and {r["params"]["position"] for r in token} == {149}
    capsys.readouterr()
    assert cli.main([*args, f"model.expected_token={runner_up}"]) == 1
    assert f"redecode {best}, the config pins {runner_up}" in capsys.readouterr().out.replace("reference", "redecode")
