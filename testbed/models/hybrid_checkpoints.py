"""Qwen3.5 text checkpoints (a Hugging Face folder: config.json + *.safetensors) for refimpl.qwen35.

Strict, like testbed.models.checkpoints for Gemma: a config field that would change the computation and that
the reference does not implement is refused, as is a missing, unexpected or misshapen tensor; each
refusal is one UsageError naming the value and what is accepted. Fields that cannot change the
logits of a text prompt (token ids, dtype, bookkeeping) are accepted and ignored.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from refimpl.qwen35 import HF_LAYER_TYPES, HybridConfig, weight_shapes
from testbed.errors import UsageError
from testbed.models.checkpoints import read_hf_folder

MODEL_TYPES = ("qwen3_5_text", "qwen3_5")  # qwen3_5 nests the text model's fields under text_config
# Read into HybridConfig (the rest of the computation is fixed by the architecture).
READ = {"vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "linear_conv_kernel_dim", "layer_types", "rope_parameters", "rms_norm_eps",
        "tie_word_embeddings", "full_attention_interval"}
# Must hold these values: the reference implements nothing else. attn_output_gate: the full-attention
# layers' sigmoid output gate (q_proj holds a gate row per query row), which Qwen3.5 always has;
# mamba_ssm_dtype: the recurrent state's dtype, float32 in the reference and the engine.
FIXED = {"hidden_act": "silu", "attention_bias": False, "attn_output_gate": True, "mamba_ssm_dtype": "float32"}
# Cannot change a text prompt's logits: ids, storage dtype, limits, training-only settings, bookkeeping;
# the multi-token-prediction head (mtp_*), which only speculative decoding reads (transformers' causal
# LM ignores its tensors too).
IGNORED = {"model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "bos_token_id",
           "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "max_position_embeddings",
           "attention_dropout", "output_hidden_states", "output_attentions", "return_dict", "id2label", "label2id",
           "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "_name_or_path", "tokenizer_class",
           "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"}
# Tensors transformers' Qwen3_5ForCausalLM does not load (_keys_to_ignore_on_load_unexpected): the
# multi-token-prediction head and the vision tower of a multimodal checkpoint.
IGNORED_TENSORS = ("mtp.", "model.visual.")
# A multimodal (qwen3_5) checkpoint holds the text model under model.language_model.
TEXT_PREFIX = ("model.language_model.", "model.")
ROPE_READ = {"rope_theta", "partial_rotary_factor"}
# Multimodal RoPE sections: a text prompt's three position streams are equal, so they rotate alike.
ROPE_IGNORED = {"mrope_section", "mrope_interleaved"}


def config_from_hf(hf: dict, source: str) -> HybridConfig:
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UsageError(f"{source}: model_type {model_type!r} is not accepted; accepted: {', '.join(MODEL_TYPES)}")
    if model_type == "qwen3_5":
        hf = hf.get("text_config") or {}
    # the older form keeps RoPE's fields at the top level (transformers moves them into rope_parameters)
    legacy = {k: hf[k] for k in ROPE_READ if k in hf}
    if legacy:
        hf = {k: v for k, v in hf.items() if k not in legacy}
        clash = sorted(k for k in legacy if k in (hf.get("rope_parameters") or {}))
        if clash:
            raise UsageError(f"{source}: {clash[0]} is given both at the top level and in rope_parameters; "
                             f"accepted: one of them")
        hf["rope_parameters"] = {**(hf.get("rope_parameters") or {}), **legacy}
    unknown = sorted(set(hf) - READ - set(FIXED) - IGNORED)
    if unknown:
        raise UsageError(f"{source}: config field {unknown[0]!r} is not known to the reference model; accepted: "
                         f"{', '.join(sorted(READ | set(FIXED)))} (and bookkeeping fields)")
    for key, value in FIXED.items():
        if hf.get(key, value) != value:
            raise UsageError(f"{source}: {key}={hf[key]!r} is not supported; accepted: {value!r}")
    full_every = hf.get("full_attention_interval", 4)
    if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
        raise UsageError(f"{source}: full_attention_interval={full_every!r} is not accepted; accepted: an integer >= 1")
    rope = dict(hf.get("rope_parameters") or {})
    if rope.pop("rope_type", "default") != "default":
        raise UsageError(f"{source}: rope_parameters.rope_type={hf['rope_parameters']['rope_type']!r} is not "
                         f"supported; accepted: 'default'")
    bad = sorted(set(rope) - ROPE_READ - ROPE_IGNORED)
    if bad:
        raise UsageError(f"{source}: rope_parameters.{bad[0]} is not supported; accepted: "
                         f"{', '.join(sorted(ROPE_READ | ROPE_IGNORED))}")
    if hf.get("linear_key_head_dim", 128) != hf.get("linear_value_head_dim", 128):
        raise UsageError(f"{source}: linear_key_head_dim={hf.get('linear_key_head_dim')} differs from "
                         f"linear_value_head_dim={hf.get('linear_value_head_dim')}; accepted: equal head sizes")

    def need(key):
        if key not in hf:
            raise UsageError(f"{source}: config.json lacks {key!r}")
        return hf[key]

    layers = int(need("num_hidden_layers"))
    if "layer_types" in hf:
        bad = [t for t in hf["layer_types"] if t not in HF_LAYER_TYPES]
        if bad:
            raise UsageError(f"{source}: layer type {bad[0]!r} is not accepted; accepted: {', '.join(HF_LAYER_TYPES)}")
        types = tuple(HF_LAYER_TYPES[t] for t in hf["layer_types"])
    else:
        interval = int(hf.get("full_attention_interval", 4))
        types = tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(layers))
    try:
        return HybridConfig(
            vocab=int(need("vocab_size")), hidden=int(need("hidden_size")), layers=layers,
            mlp=int(need("intermediate_size")), heads=int(need("num_attention_heads")),
            kv_heads=int(need("num_key_value_heads")), head_dim=int(need("head_dim")),
            linear_k_heads=int(hf.get("linear_num_key_heads", 16)),
            linear_v_heads=int(hf.get("linear_num_value_heads", 32)),
            linear_head_dim=int(hf.get("linear_key_head_dim", 128)),
            conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)), layer_types=types,
            rope_theta=float(rope.get("rope_theta", 10_000.0)),
            rotary_fraction=float(rope.get("partial_rotary_factor", 0.25)),
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except ValueError as e:
        raise UsageError(f"{source}: {e}") from None


def text_tensors(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The causal LM's tensors by their text-model names: the multimodal prefix taken off, the tensors
    transformers' Qwen3_5ForCausalLM ignores left out."""
    out = {}
    for name, a in weights.items():
        if name.startswith(IGNORED_TENSORS):
            continue
        if name.startswith(TEXT_PREFIX[0]):
            name = TEXT_PREFIX[1] + name[len(TEXT_PREFIX[0]):]
        out[name] = a
    return out


def check_weights(weights: dict[str, np.ndarray], cfg: HybridConfig, source: str) -> dict[str, np.ndarray]:
    """The tensors the config needs, as float32; any mismatch names the tensor."""
    shapes = weight_shapes(cfg)
    weights = text_tensors(weights)
    for name in weights:
        if name not in shapes and not (name == "lm_head.weight" and cfg.tie_embeddings):
            raise UsageError(f"{source}: unexpected tensor {name!r} (not a tensor of this Qwen3.5 config)")
    out = {}
    for name, shape in shapes.items():
        if name not in weights:
            raise UsageError(f"{source}: missing tensor {name!r} of shape {shape}")
        if tuple(weights[name].shape) != shape:
            raise UsageError(f"{source}: tensor {name!r} has shape {tuple(weights[name].shape)}, "
                             f"the config needs {shape}")
        out[name] = np.ascontiguousarray(weights[name], dtype=np.float32)
    return out


def load_hf_folder(folder: str | Path) -> tuple[HybridConfig, dict[str, np.ndarray]]:
    config, weights, source = read_hf_folder(folder)
    cfg = config_from_hf(config, source)
    return cfg, check_weights(weights, cfg, str(folder))
