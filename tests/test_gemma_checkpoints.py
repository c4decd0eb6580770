"""Checkpoints and prompts: real-format files written by the formats' own packages (safetensors,
gguf) load into the same logits as the weights held in memory; mismatches name the tensor."""

from __future__ import annotations

import json
from dataclasses import replace

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from refimpl import gemma
from testbed.errors import UsageError
from testbed.models import checkpoints, prompts

CFG = gemma.tiny_config(vocab=96, layers=6, window=8)
TOKENS = np.random.default_rng(0).integers(0, 96, 20)


@pytest.fixture(scope="module")
def weights():
    return gemma.init_weights(CFG, 7)


@pytest.fixture(scope="module")
def logits(weights):
    return gemma.redecode(weights, CFG, TOKENS, 19)


def test_hf_folder_gives_the_same_logits(tmp_path, weights, logits):
    folder = checkpoints.save_hf_folder(tmp_path / "hf", CFG, weights)
    assert set(load_file(str(folder / "model.safetensors"))) == set(weights)  # the library reads what we wrote
    cfg, loaded = checkpoints.load_checkpoint(folder)
    assert cfg == CFG
    assert np.array_equal(gemma.redecode(loaded, cfg, TOKENS, 19), logits)


def test_hf_folder_bf16_and_sharded(tmp_path, weights, logits):
    """Gemma is released in bfloat16 across shards: a bf16 value is the top half of a float32."""
    folder = tmp_path / "hf"
    checkpoints.save_hf_folder(folder, CFG, weights)
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    truncated = {k: ((v.view(np.uint32) >> 16) << 16).view(np.float32) for k, v in weights.items()}
    for shard, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        # safetensors' numpy API has no bfloat16, so write F32 and rewrite the header as BF16 halves
        raw = {k: (weights[k].view(np.uint32) >> 16).astype(np.uint16) for k in part}
        path = folder / f"model-0000{shard + 1}.safetensors"
        save_file(raw, str(path))
        data = bytearray(path.read_bytes())
        n = int.from_bytes(data[:8], "little")
        header = data[8:8 + n].replace(b'"U16"', b'"BF16"')
        path.write_bytes(len(header).to_bytes(8, "little") + bytes(header) + bytes(data[8 + n:]))
    cfg, loaded = checkpoints.load_checkpoint(folder)
    assert all(np.array_equal(loaded[k], truncated[k]) for k in weights)
    got = gemma.redecode(loaded, cfg, TOKENS, 19)
    assert np.abs(got - logits).max() < 0.1 and np.abs(got - logits).max() > 0  # bf16 rounding, not a bug


def test_gguf_gives_the_same_logits(tmp_path, weights, logits):
    path = checkpoints.save_gguf(tmp_path / "m.gguf", CFG, weights)
    reader = gguf.GGUFReader(path)
    stored = {t.name: t for t in reader.tensors}
    # llama.cpp's converter convention: Gemma's norm weights stored with the +1 folded in
    np.testing.assert_allclose(stored["blk.0.attn_norm.weight"].data,
                               weights["model.layers.0.input_layernorm.weight"] + 1, rtol=0, atol=1e-7)
    assert stored["blk.2.ffn_gate.weight"].data.shape == (CFG.mlp, CFG.hidden)
    cfg, loaded = checkpoints.load_checkpoint(path)
    assert cfg == CFG
    np.testing.assert_allclose(gemma.redecode(loaded, cfg, TOKENS, 19), logits, atol=1e-5)


def test_misshapen_tensor_is_named(tmp_path, weights):
    bad = dict(weights)
    bad["model.layers.3.mlp.up_proj.weight"] = bad["model.layers.3.mlp.up_proj.weight"][:-1]
    checkpoints.save_hf_folder(tmp_path / "hf", CFG, bad)
    with pytest.raises(UsageError, match=r"'model\.layers\.3\.mlp\.up_proj\.weight' has shape \(127, 64\)"):
        checkpoints.load_checkpoint(tmp_path / "hf")
    checkpoints.save_gguf(tmp_path / "m.gguf", CFG, bad)
    with pytest.raises(UsageError, match=r"up_proj\.weight' has shape"):
        checkpoints.load_checkpoint(tmp_path / "m.gguf")


def test_missing_and_unexpected_tensors_are_named(tmp_path, weights):
    missing = {k: v for k, v in weights.items() if k != "model.layers.5.self_attn.k_norm.weight"}
    checkpoints.save_hf_folder(tmp_path / "a", CFG, missing)
    with pytest.raises(UsageError, match=r"missing tensor 'model\.layers\.5\.self_attn\.k_norm\.weight'"):
        checkpoints.load_checkpoint(tmp_path / "a")
    checkpoints.save_hf_folder(tmp_path / "b", CFG, {**weights, "model.layers.6.input_layernorm.weight": np.ones(64)})
    with pytest.raises(UsageError, match=r"unexpected tensor 'model\.layers\.6\.input_layernorm\.weight'"):
        checkpoints.load_checkpoint(tmp_path / "b")
    checkpoints.save_gguf(tmp_path / "c.gguf", CFG, missing)
    with pytest.raises(UsageError, match=r"missing tensor 'blk\.5\.attn_k_norm\.weight'"):
        checkpoints.load_checkpoint(tmp_path / "c.gguf")


LINEAR_8 = {"rope_type": "linear", "factor": 8.0}


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, r"rope_type='yarn' is not implemented; accepted: default, linear"),
    ({"rope_scaling": {"factor": 8.0}}, r"full_attention: factor=8\.0 is not implemented for rope_type='default'"),
    ({"rope_parameters": {"sliding_attention": LINEAR_8, "full_attention": {}}}, r"sliding_attention: factor=8\.0"),
    ({"rope_parameters": {"full_attention": {**LINEAR_8, "partial_rotary_factor": 0.5}}},
     r"partial_rotary_factor=0\.5 is not implemented"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, r"keyed by layer type"),
    ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50\.0 is not implemented; accepted: None"),
    ({"hidden_activation": "silu"}, r"hidden_activation='silu' is not implemented"),
    ({"attention_bias": True}, r"attention_bias=True"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention=True"),
    ({"model_type": "gemma2"}, r"model_type='gemma2' is not implemented; accepted: 'gemma3_text', 'gemma3'"),
    ({"sliding_window": None}, r"sliding_window=None is not accepted"),
    ({"quantization_config": {"bits": 4}}, r"key 'quantization_config'=\{'bits': 4\} is not implemented"),
    ({"layer_types": ["chunked_attention"] * 6}, r"layer type 'chunked_attention' is not accepted"),
])
def test_config_json_that_would_compute_something_else_is_refused(tmp_path, weights, change, message):
    folder = checkpoints.save_hf_folder(tmp_path / "hf", CFG, weights)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, **change}))
    with pytest.raises(UsageError, match=message) as e:
        checkpoints.load_checkpoint(folder)
    assert "\n" not in str(e.value)


def test_config_json_missing_keys_take_transformers_defaults(tmp_path, weights):
    """An absent key means what it means to transformers (the multimodal releases' text_config states
    only what differs): query_pre_attn_scalar 256, not head_dim."""
    folder = checkpoints.save_hf_folder(tmp_path / "hf", CFG, weights)
    hf = json.loads((folder / "config.json").read_text())
    del hf["query_pre_attn_scalar"], hf["rope_parameters"]
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": hf}))
    cfg, _ = checkpoints.load_checkpoint(folder)
    assert (cfg.query_pre_attn_scalar, cfg.rope_local, cfg.rope_global) == (256.0, 10_000.0, 1_000_000.0)
    del hf["head_dim"]
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UsageError, match=r"q_proj\.weight' has shape \(64, 64\), the config needs \(1024, 64\)"):
        checkpoints.load_checkpoint(folder)
    with pytest.raises(UsageError, match="accepted: a folder"):
        checkpoints.load_checkpoint(tmp_path / "nothing.bin")


def rewrite_gguf(src, dst, set_keys: dict | None = None, drop: tuple = (), add_tensors: dict | None = None):
    """A copy of a GGUF with metadata keys set ({key: (value, GGUFValueType)}) or dropped, and tensors added."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), "gemma3")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for key, (value, vtype) in (set_keys or {}).items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, a in (add_tensors or {}).items():
        writer.add_tensor(name, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


T = gguf.GGUFValueType


@pytest.mark.parametrize("key, value, message", [
    ("gemma3.rope.scaling.type", ("yarn", T.STRING), r"gemma3\.rope\.scaling\.type='yarn' is not implemented"),
    ("gemma3.rope.dimension_count", (8, T.UINT32), r"gemma3\.rope\.dimension_count=8 is not implemented; accepted: 16"),
    ("gemma3.attn_logit_softcapping", (50.0, T.FLOAT32), r"gemma3\.attn_logit_softcapping=50\.0 is not implemented"),
    ("gemma3.attention.causal", (False, T.BOOL), r"gemma3\.attention\.causal=False is not implemented"),
])
def test_gguf_metadata_that_would_compute_something_else_is_refused(tmp_path, weights, key, value, message):
    path = checkpoints.save_gguf(tmp_path / "m.gguf", CFG, weights)
    with pytest.raises(UsageError, match=message):
        checkpoints.load_checkpoint(rewrite_gguf(path, tmp_path / "bad.gguf", {key: value}))


def test_gguf_tensor_the_model_does_not_use_is_refused(tmp_path, weights):
    path = checkpoints.save_gguf(tmp_path / "m.gguf", CFG, weights)
    bias = {"blk.0.attn_q.bias": np.zeros(CFG.heads * CFG.head_dim, np.float32)}
    with pytest.raises(UsageError, match=r"unexpected tensor 'blk\.0\.attn_q\.bias'"):
        checkpoints.load_checkpoint(rewrite_gguf(path, tmp_path / "bias.gguf", add_tensors=bias))


def test_gguf_metadata_is_read_as_llamacpp_reads_it(tmp_path, weights):
    """The converter's keys (linear scaling, the local base) are written and read back; absent ones
    take llama.cpp's defaults: linear scaling type, base 10,000 for both layer types, and no sliding
    window means every layer global."""
    cfg = gemma.tiny_config(vocab=96, window=8, rope_local=100.0, rope_global=5_000.0, rope_scaling_global=8.0)
    path = checkpoints.save_gguf(tmp_path / "m.gguf", cfg, weights)
    fields = {name: f.contents() for name, f in gguf.GGUFReader(path).fields.items()}
    assert (fields["gemma3.rope.scaling.type"], fields["gemma3.rope.scaling.factor"]) == ("linear", 8.0)
    assert (fields["gemma3.rope.freq_base"], fields["gemma3.rope.freq_base_swa"]) == (5_000.0, 100.0)
    assert checkpoints.load_checkpoint(path)[0] == cfg
    alternating = replace(cfg, layer_types=("local", "global") * 3)  # not llama.cpp's default pattern
    assert checkpoints.load_checkpoint(checkpoints.save_gguf(tmp_path / "a.gguf", alternating, weights))[0] == alternating
    bare = rewrite_gguf(path, tmp_path / "bare.gguf", drop=("gemma3.rope.scaling.type", "gemma3.rope.freq_base_swa",
                                                             "gemma3.attention.sliding_window"))
    loaded = checkpoints.load_checkpoint(bare)[0]
    assert (loaded.rope_scaling_global, loaded.rope_local, loaded.types_in_use) == (8.0, 10_000.0, ("global",))
    with pytest.raises(UsageError, match=r"query_pre_attn_scalar=24 cannot be stored in a GGUF; accepted: 16"):
        checkpoints.save_gguf(tmp_path / "q.gguf", gemma.tiny_config(query_pre_attn_scalar=24.0), weights)


def test_prompts_from_json_npy_and_seed(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"tokens": [5, 6, 7, 8]}))
    np.save(tmp_path / "p.npy", np.array([1, 2, 3]))
    assert prompts.load_prompt(str(tmp_path / "p.json"), 3, 10, 0).ids.tolist() == [5, 6, 7]
    assert prompts.load_prompt(str(tmp_path / "p.npy"), 3, 10, 0).ids.tolist() == [1, 2, 3]
    assert np.array_equal(prompts.load_prompt("seed", 5, 10, 1).ids, prompts.load_prompt("seed", 5, 10, 1).ids)
    with pytest.raises(UsageError, match="holds token id 8; accepted: ids from 0 to 7"):
        prompts.load_prompt(str(tmp_path / "p.json"), 4, 8, 0)
    with pytest.raises(UsageError, match="has 3 tokens; the cases need at least 4"):
        prompts.load_prompt(str(tmp_path / "p.npy"), 4, 10, 0)
    (tmp_path / "bad.json").write_text('["a"]')
    with pytest.raises(UsageError, match="integer token ids"):
        prompts.load_prompt(str(tmp_path / "bad.json"), 1, 10, 0)


# The forms of Google's released Gemma 3 configs (transformers 4.50): a text-only one with every key,
# and the multimodal ones whose text_config states only what differs from transformers' defaults.
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
}
GEMMA3_4B_TEXT = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                  "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                  "sliding_window": 1024}
GEMMA3_27B_TEXT = {**GEMMA3_4B_TEXT, "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                   "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                   "query_pre_attn_scalar": 168}


def test_released_config_forms_load_with_their_rope_scaling_and_query_scale():
    one = checkpoints.config_from_hf(GEMMA3_1B, "1b")
    assert (one.rope_scaling_global, one.window, one.layer_types.count("global")) == (1.0, 512, 4)
    multimodal = {"model_type": "gemma3", "mm_tokens_per_image": 256, "vision_config": {"hidden_size": 1152}}
    four = checkpoints.config_from_hf({**multimodal, "text_config": GEMMA3_4B_TEXT}, "4b")
    assert (four.rope_scaling_global, four.rope_global, four.rope_local) == (8.0, 1e6, 1e4)
    assert (four.heads, four.kv_heads, four.head_dim, four.query_pre_attn_scalar, four.vocab) == (8, 4, 256, 256, 262208)
    big = checkpoints.config_from_hf({**multimodal, "text_config": GEMMA3_27B_TEXT}, "27b")
    # transformers' 27B query scale is the one llama.cpp derives from 62 blocks; the 4B's is head_dim
    for cfg in (four, big):
        assert cfg.query_pre_attn_scalar == checkpoints.gguf_query_pre_attn_scalar(cfg.layers, cfg.hidden, cfg.heads,
                                                                                    cfg.head_dim)
    assert big.query_pre_attn_scalar == 168 != big.head_dim
