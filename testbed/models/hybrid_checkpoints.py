"""Qwen3.5 text checkpoints (a Hugging Face folder: config.json + *.safetensors; or a GGUF of arch qwen35,
read and written as llama.cpp's converter writes it) for refimpl.qwen35.

Strict, like testbed.models.checkpoints for Gemma: a config field that would change the computation and that
the reference does not implement is refused, as is a missing, unexpected or misshapen tensor; each
refusal is one UsageError naming the value and what is accepted. Fields that cannot change the
logits of a text prompt (token ids, dtype, bookkeeping) are accepted and ignored.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np

from refimpl.qwen35 import HF_LAYER_TYPES, HybridConfig, weight_shapes
from testbed.errors import UsageError
from testbed.inputs import shown
from testbed.models import checkpoints
from testbed.models.checkpoints import LLAMA_MAX_LAYERS, gguf_writer, hf_count, hf_kind, hf_number, read_hf_folder

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
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise UsageError(f"{source}: model_type {shown(model_type)} is not accepted; accepted: "
                         f"{', '.join(MODEL_TYPES)}")
    if model_type == "qwen3_5":
        hf = hf_kind(hf.get("text_config") or {}, dict, "text_config", source, "an object")
    # the older form keeps RoPE's fields at the top level (transformers moves them into rope_parameters)
    legacy = {k: hf[k] for k in ROPE_READ if k in hf}
    hf_kind(hf.get("rope_parameters") or {}, dict, "rope_parameters", source, "an object")
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
            raise UsageError(f"{source}: {key}={shown(hf[key])} is not supported; accepted: {value!r}")
    interval = hf_count({"full_attention_interval": 4, **hf}, "full_attention_interval", source)
    rope = dict(hf.get("rope_parameters") or {})
    if rope.pop("rope_type", "default") != "default":
        raise UsageError(f"{source}: rope_parameters.rope_type={shown(hf['rope_parameters']['rope_type'])} is not "
                         f"supported; accepted: 'default'")
    bad = sorted(set(rope) - ROPE_READ - ROPE_IGNORED)
    if bad:
        raise UsageError(f"{source}: rope_parameters.{bad[0]} is not supported; accepted: "
                         f"{', '.join(sorted(ROPE_READ | ROPE_IGNORED))}")
    if hf.get("linear_key_head_dim", 128) != hf.get("linear_value_head_dim", 128):
        raise UsageError(f"{source}: linear_key_head_dim={hf.get('linear_key_head_dim')} differs from "
                         f"linear_value_head_dim={hf.get('linear_value_head_dim')}; accepted: equal head sizes")

    def need(key, **bounds):
        if key not in hf:
            raise UsageError(f"{source}: config.json lacks {key!r}")
        return hf_count(hf, key, source, **bounds)

    def count(key, default):  # an optional count, its default transformers'
        return hf_count({key: default, **hf}, key, source)

    layers = need("num_hidden_layers", high=LLAMA_MAX_LAYERS)
    if "layer_types" in hf:
        given = hf_kind(hf["layer_types"], list, "layer_types", source, f"a list of {layers} layer types")
        bad = [t for t in given if not isinstance(t, str) or t not in HF_LAYER_TYPES]
        if bad:
            raise UsageError(f"{source}: layer type {shown(bad[0])} is not accepted; accepted: "
                             f"{', '.join(HF_LAYER_TYPES)}")
        types = tuple(HF_LAYER_TYPES[t] for t in given)
    else:
        types = tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(layers))
    try:
        return HybridConfig(
            vocab=need("vocab_size"), hidden=need("hidden_size"), layers=layers,
            mlp=need("intermediate_size"), heads=need("num_attention_heads"),
            kv_heads=need("num_key_value_heads"), head_dim=need("head_dim"),
            linear_k_heads=count("linear_num_key_heads", 16), linear_v_heads=count("linear_num_value_heads", 32),
            linear_head_dim=count("linear_key_head_dim", 128), conv_kernel=count("linear_conv_kernel_dim", 4),
            layer_types=types, rope_theta=hf_number(rope.get("rope_theta", 10_000.0), "rope_theta", source),
            rotary_fraction=hf_number(rope.get("partial_rotary_factor", 0.25), "partial_rotary_factor", source),
            rms_eps=hf_number(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
            tie_embeddings=hf_kind(hf.get("tie_word_embeddings", False), bool, "tie_word_embeddings", source,
                                   "true or false"),
        )
    except ValueError as e:
        raise UsageError(f"{source}: {e}") from None


def config_to_hf(cfg: HybridConfig) -> dict:
    """config.json of a Qwen3_5ForCausalLM as transformers 5 saves it (Qwen3_5TextConfig's fields; RoPE under
    rope_parameters), which config_from_hf reads back to `cfg`."""
    names = {short: name for name, short in HF_LAYER_TYPES.items()}
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": cfg.vocab,
        "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers, "intermediate_size": cfg.mlp,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "linear_num_key_heads": cfg.linear_k_heads, "linear_num_value_heads": cfg.linear_v_heads,
        "linear_key_head_dim": cfg.linear_head_dim, "linear_value_head_dim": cfg.linear_head_dim,
        "linear_conv_kernel_dim": cfg.conv_kernel, "layer_types": [names[t] for t in cfg.layer_types],
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.rotary_fraction},
        "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False,
    }


def hf_folder_of(cfg: HybridConfig, weights: dict[str, np.ndarray], cache: Path | None = None) -> Path:
    """The Hugging Face folder (config.json + model.safetensors) of a hybrid given as config and weights
    (testbed's seeded model), once per content under .cache/hf/: what an engine that reads a Hugging
    Face folder, an exporter's input, is handed."""
    return checkpoints.hf_folder_of(cfg, check_weights(weights, cfg, "weights"), cache, config_to_hf(cfg))


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


def load_checkpoint(path: str | Path) -> tuple[HybridConfig, dict[str, np.ndarray]]:
    """A Hugging Face folder or a qwen35 .gguf file."""
    path = Path(path)
    if path.suffix != ".gguf" or path.is_dir():
        return load_hf_folder(path)  # says what a folder lacks
    if not path.is_file():
        raise UsageError(f"checkpoint {str(path)!r} is not accepted; accepted: a Qwen3.5 folder with config.json and "
                         f"*.safetensors, or an existing .gguf file")
    return load_gguf(path)


# --- GGUF ------------------------------------------------------------------------------------------
#
# The form llama.cpp's converter writes for Qwen3_5ForCausalLM (arch "qwen35", read by llama.cpp's
# src/models/qwen35.cpp), and so the form libllama computes with:
# - names from the `gguf` package's tables; numpy shapes are ggml's `ne` reversed ([out, in]);
# - the (1 + w) norms (layer norms, final norm, q/k norms) stored as 1 + w; the GDN output norm, a
#   plain weight, as is;
# - A_log stored as A = -exp(A_log) (ggml multiplies softplus(...) by it), dt_bias as ssm_dt.bias, the
#   conv weight [channels, 1, K] without its middle axis;
# - the value heads of the GDN layers reordered from grouped by key head (Hugging Face: value head
#   h reads key head h // r, r = H_v / H_k) to tiled (head j * H_k + g reads key head g), which
#   ggml's broadcasting repeats: the V rows of in_proj_qkv and of the conv, in_proj_z, in_proj_a,
#   in_proj_b, A_log, dt_bias, and the columns of out_proj;
# - RoPE as interleaved multimodal RoPE (LLAMA_ROPE_TYPE_IMROPE) over rope.dimension_count dims: a
#   text prompt feeds the same position to the first three sections and 0 to the fourth, so the
#   sections must give every rotated pair to one of the first three (gguf_rope_sections).

GGUF_ARCH = "qwen35"
GGUF_NORM_SHIFT = 1.0
# What the writer states as the training context when the folder's config does not (transformers'
# Qwen3_5TextConfig default); llama.cpp requires the key and only warns past it.
DEFAULT_CONTEXT = 32_768
GGUF_INERT_PREFIXES = ("general.", "tokenizer.", "quantize.", "GGUF.")
GGUF_INERT_KEYS = ("{arch}.context_length",)
RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"  # the gguf package 0.19 has no constant for it
NEXTN_KEY = "{arch}.nextn_predict_layers"


def shifted_norm(hf_name: str) -> bool:
    """A norm computed as (1 + w), stored as 1 + w."""
    return hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight")


def gguf_rope_sections(cfg: HybridConfig) -> list[int]:
    """The fewest sections that give each of the rotary_dim / 2 pairs to the first three position
    streams (ggml's interleaved M-RoPE takes pair s from stream s % 3 while s < 3 * sections[s % 3],
    else from the fourth, which is 0 for text). For Qwen3.5's 64 rotary dims these are the
    converter's default [11, 11, 10, 0]."""
    pairs = cfg.rotary_dim // 2
    return [-(-(pairs - k) // 3) for k in range(3)] + [0]


def rope_sections_problem(sections: list[int], pairs: int, head_dim: int) -> str | None:
    """Why llama.cpp would not rotate a text prompt as transformers does with these sections, or None."""
    if len(sections) != 4 or sum(sections) > head_dim or not any(sections[:3]):
        return f"four sections, the first three not all 0, summing to at most head_dim={head_dim}"
    total = sum(sections)
    for s in range(pairs):
        sector = s % total
        if not sector < 3 * sections[sector % 3]:
            return f"sections that give each of the {pairs} rotary pairs to the first three streams"
    return None


def _v_head_order(a: np.ndarray, axis: int, cfg: HybridConfig, size: int, to_tiled: bool) -> np.ndarray:
    """Value heads of `size` entries along `axis` from grouped to tiled order, or back."""
    k, r = cfg.linear_k_heads, cfg.linear_v_heads // cfg.linear_k_heads
    a = np.moveaxis(a, axis, 0)
    grouped = a.reshape(*((k, r, size) if to_tiled else (r, k, size)), *a.shape[1:])
    return np.moveaxis(grouped.swapaxes(0, 1).reshape(a.shape), 0, axis)


def _reorder_v_heads(hf_name: str, a: np.ndarray, cfg: HybridConfig, to_tiled: bool) -> np.ndarray:
    if cfg.linear_k_heads == cfg.linear_v_heads or ".linear_attn." not in hf_name:
        return a
    d, part = cfg.linear_head_dim, hf_name.rpartition(".linear_attn.")[2]
    order = partial(_v_head_order, cfg=cfg, to_tiled=to_tiled)
    if part in ("in_proj_qkv.weight", "conv1d.weight"):  # q and k channels first, then v
        return np.concatenate([a[:2 * cfg.key_dim], order(a[2 * cfg.key_dim:], 0, size=d)])
    if part == "in_proj_z.weight":
        return order(a, 0, size=d)
    if part in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        return order(a, 0, size=1)
    if part == "out_proj.weight":
        return order(a, 1, size=d)
    return a


def gguf_tensor_names(cfg: HybridConfig, layers_in_file: int) -> dict[str, str]:
    """GGUF name of every Hugging Face tensor of the config."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, layers_in_file)
    out = {}
    for hf_name in weight_shapes(cfg):
        lookup = hf_name.replace(".linear_attn.dt_bias", ".linear_attn.dt_proj.bias")
        out[hf_name] = names.get_name(lookup, try_suffixes=(".weight", ".bias"))
    return out


def to_gguf_form(hf_name: str, a: np.ndarray, cfg: HybridConfig) -> np.ndarray:
    """A Hugging Face tensor as the GGUF stores it (float32)."""
    a = np.asarray(a, np.float32)
    if shifted_norm(hf_name):
        a = a + np.float32(GGUF_NORM_SHIFT)
    elif hf_name.endswith(".A_log"):
        a = -np.exp(a)
    elif hf_name.endswith("conv1d.weight"):
        a = a[:, 0, :]
    return np.ascontiguousarray(_reorder_v_heads(hf_name, a, cfg, to_tiled=True))


def from_gguf_form(hf_name: str, a: np.ndarray, cfg: HybridConfig) -> np.ndarray:
    """The inverse of to_gguf_form."""
    a = _reorder_v_heads(hf_name, np.asarray(a, np.float32), cfg, to_tiled=False)
    if shifted_norm(hf_name):
        return a - np.float32(GGUF_NORM_SHIFT)
    if hf_name.endswith(".A_log"):
        if not (a < 0).all():
            raise ValueError("ssm_a must be negative (it is -exp(A_log))")
        return np.log(-a)
    if hf_name.endswith("conv1d.weight"):
        return a[:, None, :]
    return a


def save_gguf(path: str | Path, cfg: HybridConfig, weights: dict[str, np.ndarray],
              context_length: int = DEFAULT_CONTEXT) -> Path:
    """A float32 qwen35 GGUF in llama.cpp's converter's form (see above), without a tokenizer
    (tokenizer.ggml.model = none and the vocabulary's size: llama.cpp then takes token ids as given).
    testbed.models.gguf_files.write_gguf judges it by reading it back."""
    import gguf

    weights = check_weights(weights, cfg, "weights")
    writer = gguf_writer(path, GGUF_ARCH, cfg, context_length)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_rope_dimension_count(cfg.rotary_dim)
    writer.add_rope_dimension_sections(gguf_rope_sections(cfg))
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_ssm_conv_kernel(cfg.conv_kernel)
    writer.add_ssm_state_size(cfg.linear_head_dim)
    writer.add_ssm_group_count(cfg.linear_k_heads)
    writer.add_ssm_time_step_rank(cfg.linear_v_heads)
    writer.add_ssm_inner_size(cfg.value_dim)
    writer.add_array(RECURRENT_LAYERS_KEY.format(arch=GGUF_ARCH), [t == "linear" for t in cfg.layer_types])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("none")
    writer.add_vocab_size(cfg.vocab)
    for hf_name, gguf_name in gguf_tensor_names(cfg, cfg.layers).items():
        writer.add_tensor(gguf_name, to_gguf_form(hf_name, weights[hf_name], cfg))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def gguf_form_shape(hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a Hugging Face tensor has in the GGUF (to_gguf_form's): the conv weight without its middle axis."""
    return (shape[0], shape[2]) if hf_name.endswith("conv1d.weight") else tuple(shape)


def load_gguf(path: str | Path, weights: bool = True) -> tuple[HybridConfig, dict[str, np.ndarray]]:
    """A qwen35 GGUF read as llama.cpp reads it (llama_model::load_hparams, src/models/qwen35.cpp):
    every metadata key read, or inert, or refused naming it. Multi-token-prediction blocks
    (nextn_predict_layers, stored after the decoder's) are left out, as llama.cpp's main pass does.
    weights=False: its metadata and its tensors' names, shapes and types checked, no weight read ({})."""
    import gguf

    from testbed.models import gguf_reader
    from testbed.models.checkpoints import GGUFFile, _from_float32

    g = GGUFFile(path, GGUF_ARCH, GGUF_INERT_KEYS)
    path, tensors, refuse, vocab, K = g.path, g.tensors, g.refuse, g.vocab, gguf.Keys
    blocks = g.layer_count(K.LLM.BLOCK_COUNT)
    layers = blocks - g.count(NEXTN_KEY, 0, low=0, high=blocks - 1)
    hidden, heads = g.count(K.LLM.EMBEDDING_LENGTH), g.count(K.Attention.HEAD_COUNT)
    head_dim = g.count(K.Attention.KEY_LENGTH, max(hidden // heads, 1))
    if g.count(K.Attention.VALUE_LENGTH, head_dim) != head_dim:
        refuse(K.Attention.VALUE_LENGTH, g.meta(K.Attention.VALUE_LENGTH), f"{head_dim} (the key length)")
    rotary = g.count(K.Rope.DIMENSION_COUNT, head_dim, high=head_dim)
    sections = [int(s) for s in g.array(K.Rope.DIMENSION_SECTIONS, gguf_reader.INTEGER_TYPES, range(4, 5),
                                        "integers")]
    problem = rope_sections_problem(sections, rotary // 2, head_dim)
    if problem:
        refuse(K.Rope.DIMENSION_SECTIONS, sections, problem)
    state = g.count(K.SSM.STATE_SIZE)
    k_heads, v_heads = g.count(K.SSM.GROUP_COUNT), g.count(K.SSM.TIME_STEP_RANK)
    if g.count(K.SSM.INNER_SIZE) != v_heads * state:
        refuse(K.SSM.INNER_SIZE, g.meta(K.SSM.INNER_SIZE), f"{v_heads * state} (value heads x state size)")
    if RECURRENT_LAYERS_KEY.format(arch=GGUF_ARCH) in g.fields:  # one bool per layer (the MTP blocks' optional)
        recurrent = g.array(RECURRENT_LAYERS_KEY, frozenset({gguf_reader.BOOL_TYPE}), range(layers, blocks + 1),
                            "bools (one per layer)")
        types = tuple("linear" if r else "full" for r in recurrent[:layers])
    else:
        interval = g.count(K.LLM.FULL_ATTENTION_INTERVAL, 4)
        types = tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(layers))
    g.meta(K.LLM.FULL_ATTENTION_INTERVAL, 4)  # read: the layer types above decide
    settings = dict(
        vocab=vocab, hidden=hidden, layers=layers, mlp=g.count(K.LLM.FEED_FORWARD_LENGTH), heads=heads,
        kv_heads=g.count(K.Attention.HEAD_COUNT_KV, heads), head_dim=head_dim, linear_k_heads=k_heads,
        linear_v_heads=v_heads, linear_head_dim=state, conv_kernel=g.count(K.SSM.CONV_KERNEL), layer_types=types,
        rope_theta=g.number(K.Rope.FREQ_BASE, 10_000.0, positive=True), rotary_fraction=rotary / head_dim,
        rms_eps=_from_float32(g.number(K.Attention.LAYERNORM_RMS_EPS, positive=True)),
        tie_embeddings="output.weight" not in tensors,
    )
    g.refuse_unread(GGUF_INERT_PREFIXES, "the qwen35 keys testbed.models.hybrid_checkpoints.load_gguf reads")
    try:
        cfg = HybridConfig(**settings)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None
    shapes = weight_shapes(cfg)
    read = {}
    for hf_name, gguf_name in gguf_tensor_names(cfg, blocks).items():
        a = g.weight(gguf_name, hf_name, gguf_form_shape(hf_name, shapes[hf_name]), read=weights)
        try:
            if weights:
                read[hf_name] = from_gguf_form(hf_name, a, cfg)
        except ValueError as e:
            raise UsageError(f"{path}: tensor {gguf_name!r}: {e}") from None
    mtp = tuple(f"blk.{i}." for i in range(layers, blocks))
    left = [name for name in tensors if not name.startswith(mtp)]
    if left:
        raise UsageError(f"{path}: unexpected tensor {left[0]!r} (not a tensor of this Qwen3.5 config)")
    return cfg, check_weights(read, cfg, str(path)) if weights else {}
