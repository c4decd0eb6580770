"""Gemma 3 checkpoints: a Hugging Face folder (config.json + *.safetensors) or a GGUF file.

Both load into the reference model's form: a GemmaConfig and float32 weights keyed by Hugging Face
tensor names (refimpl.gemma.weight_shapes). Every tensor is checked against the config; a missing,
unexpected or misshapen tensor is a UsageError naming it.

Conventions of the formats that matter here:
- safetensors: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
  then raw row-major data. Read directly so BF16 (Gemma's released dtype, unknown to numpy) works:
  a bfloat16 is the top half of a float32.
- GGUF: tensor names and metadata keys from the `gguf` package's own tables (arch "gemma3"); numpy
  shapes are ggml's `ne` reversed, so a projection reads [out, in] as in Hugging Face. llama.cpp's
  converter stores Gemma's RMSNorm weights with the +1 offset folded in (its norm multiplies by w), so
  1 is subtracted on load and added on write. The local RoPE base and the query scale are not stored:
  llama.cpp uses 10,000 and 1/sqrt(head_dim), and so do we.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from refimpl.gemma import GemmaConfig, weight_shapes
from testbed.errors import UsageError

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}
GGUF_ARCH = "gemma3"


def check_weights(weights: dict[str, np.ndarray], cfg: GemmaConfig, source: str) -> dict[str, np.ndarray]:
    """The weights the config needs, as float32; any mismatch names the tensor."""
    shapes = weight_shapes(cfg)
    for name in weights:
        if name not in shapes and not (name == "lm_head.weight" and cfg.tie_embeddings):
            raise UsageError(f"{source}: unexpected tensor {name!r} (not a tensor of this Gemma config)")
    out = {}
    for name, shape in shapes.items():
        if name not in weights:
            raise UsageError(f"{source}: missing tensor {name!r} of shape {shape}")
        got = tuple(weights[name].shape)
        if got != shape:
            raise UsageError(f"{source}: tensor {name!r} has shape {got}, the config needs {shape}")
        out[name] = np.ascontiguousarray(weights[name], dtype=np.float32)
    return out


# --- Hugging Face folder ---------------------------------------------------------------------------


def config_from_hf(hf: dict, source: str) -> GemmaConfig:
    hf = hf.get("text_config", hf)

    def need(key):
        if key not in hf:
            raise UsageError(f"{source}: config.json lacks {key!r}")
        return hf[key]

    for key in ("rope_scaling", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise UsageError(f"{source}: config.json {key}={hf[key]!r} is not supported (accepted: null)")
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise UsageError(f"{source}: hidden_activation={act!r} is not supported; accepted: gelu_pytorch_tanh")
    layers = int(need("num_hidden_layers"))
    if "layer_types" in hf:
        names = {"sliding_attention": "local", "full_attention": "global"}
        bad = [t for t in hf["layer_types"] if t not in names]
        if bad:
            raise UsageError(f"{source}: layer type {bad[0]!r} is not accepted; accepted: {', '.join(names)}")
        types = [names[t] for t in hf["layer_types"]]
    else:
        pattern = int(hf.get("sliding_window_pattern", 6))
        types = ["global" if (i + 1) % pattern == 0 else "local" for i in range(layers)]
    try:
        return GemmaConfig(
            vocab=int(need("vocab_size")), hidden=int(need("hidden_size")), layers=layers,
            heads=int(need("num_attention_heads")), kv_heads=int(need("num_key_value_heads")),
            head_dim=int(need("head_dim")), mlp=int(need("intermediate_size")),
            window=int(hf.get("sliding_window", 512)), layer_types=tuple(types),
            rope_local=float(hf.get("rope_local_base_freq", 10_000.0)),
            rope_global=float(hf.get("rope_theta", 1_000_000.0)),
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or need("head_dim")),
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            final_logit_softcap=hf.get("final_logit_softcapping"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        )
    except ValueError as e:
        raise UsageError(f"{source}: {e}") from None


def config_to_hf(cfg: GemmaConfig) -> dict:
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": cfg.vocab, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.mlp, "sliding_window": cfg.window,
        "layer_types": ["full_attention" if t == "global" else "sliding_attention" for t in cfg.layer_types],
        "rope_local_base_freq": cfg.rope_local, "rope_theta": cfg.rope_global,
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar, "rms_norm_eps": cfg.rms_eps,
        "final_logit_softcapping": cfg.final_logit_softcap, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_activation": "gelu_pytorch_tanh", "rope_scaling": None, "attn_logit_softcapping": None,
    }


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    if len(data) < 8:
        raise UsageError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + n])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"{path}: not a safetensors file (its header is not JSON)") from None
    body = memoryview(data)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise UsageError(f"{path}: tensor {name!r} has dtype {info['dtype']}; accepted: "
                             f"{', '.join(SAFETENSORS_DTYPES)}")
        begin, end = info["data_offsets"]
        a = np.frombuffer(body[begin:end], SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = a
    return out


def load_hf_folder(folder: str | Path) -> tuple[GemmaConfig, dict[str, np.ndarray]]:
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise UsageError(f"checkpoint folder {folder} has no config.json")
    cfg = config_from_hf(json.loads(config_file.read_text()), str(config_file))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UsageError(f"checkpoint folder {folder} has no *.safetensors file")
    weights = {}
    for f in files:
        weights.update(read_safetensors(f))
    return cfg, check_weights(weights, cfg, str(folder))


def save_hf_folder(folder: str | Path, cfg: GemmaConfig, weights: dict[str, np.ndarray]) -> Path:
    """config.json + model.safetensors (float32), written by the safetensors package."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=1) + "\n")
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


# --- GGUF ------------------------------------------------------------------------------------------


def _gguf_names(cfg_layers: int) -> "gguf.TensorNameMap":
    import gguf

    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg_layers)


def _from_float32(x) -> float:
    """GGUF stores float32 metadata: 1e-6 comes back as 9.99999997e-07. Seven significant digits
    (what a float32 holds) give back the decimal the writer meant."""
    return float(f"{float(x):.7g}")


def load_gguf(path: str | Path) -> tuple[GemmaConfig, dict[str, np.ndarray]]:
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise UsageError(f"{path}: not a readable GGUF file ({e})") from None
    fields = {name: f.contents() for name, f in reader.fields.items()}
    arch = fields.get("general.architecture")
    if arch != GGUF_ARCH:
        raise UsageError(f"{path}: architecture {arch!r} is not accepted; accepted: {GGUF_ARCH}")

    def meta(key, default=None):
        full = key.format(arch=arch)
        if full not in fields and default is None:
            raise UsageError(f"{path}: metadata {full!r} is missing")
        return fields.get(full, default)

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise UsageError(f"{path}: missing tensor 'token_embd.weight'")
    K = gguf.Keys
    head_dim = int(meta(K.Attention.KEY_LENGTH))
    try:
        cfg = GemmaConfig(
            vocab=int(tensors["token_embd.weight"].data.shape[0]), hidden=int(meta(K.LLM.EMBEDDING_LENGTH)),
            layers=int(meta(K.LLM.BLOCK_COUNT)), heads=int(meta(K.Attention.HEAD_COUNT)),
            kv_heads=int(meta(K.Attention.HEAD_COUNT_KV)), head_dim=head_dim,
            mlp=int(meta(K.LLM.FEED_FORWARD_LENGTH)), window=int(meta(K.Attention.SLIDING_WINDOW)),
            rope_global=float(meta(K.Rope.FREQ_BASE)),
            rope_local=float(meta("{arch}.rope.freq_base_swa", 10_000.0)),  # written by newer converters only
            query_pre_attn_scalar=float(head_dim), rms_eps=_from_float32(meta(K.Attention.LAYERNORM_RMS_EPS)),
            final_logit_softcap=fields.get(K.LLM.FINAL_LOGIT_SOFTCAPPING.format(arch=arch)),
            tie_embeddings="output.weight" not in tensors,
        )
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None
    names = _gguf_names(cfg.layers)
    weights = {}
    for hf_name in weight_shapes(cfg):
        gguf_name = "output.weight" if hf_name == "lm_head.weight" else names.get_name(hf_name, try_suffixes=(".weight",))
        t = tensors.pop(gguf_name, None)
        if t is None:
            raise UsageError(f"{path}: missing tensor {gguf_name!r} ({hf_name})")
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        weights[hf_name] = a - 1 if hf_name.endswith("norm.weight") else a
    if tensors:
        raise UsageError(f"{path}: unexpected tensor {next(iter(tensors))!r} (not a tensor of this Gemma config)")
    return cfg, check_weights(weights, cfg, str(path))


def save_gguf(path: str | Path, cfg: GemmaConfig, weights: dict[str, np.ndarray]) -> Path:
    """A float32 GGUF in llama.cpp's converter's form (names, metadata, norm weights + 1)."""
    import gguf

    path = Path(path)
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH)
    writer.add_block_count(cfg.layers)
    writer.add_embedding_length(cfg.hidden)
    writer.add_feed_forward_length(cfg.mlp)
    writer.add_head_count(cfg.heads)
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.window)
    writer.add_rope_freq_base(cfg.rope_global)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    if cfg.final_logit_softcap:
        writer.add_final_logit_softcapping(cfg.final_logit_softcap)
    names = _gguf_names(cfg.layers)
    for hf_name, a in weights.items():
        gguf_name = "output.weight" if hf_name == "lm_head.weight" else names.get_name(hf_name, try_suffixes=(".weight",))
        a = np.ascontiguousarray(a, np.float32)
        writer.add_tensor(gguf_name, a + 1 if hf_name.endswith("norm.weight") else a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_checkpoint(path: str | Path) -> tuple[GemmaConfig, dict[str, np.ndarray]]:
    """A Hugging Face folder or a .gguf file."""
    path = Path(path)
    if path.is_dir():
        return load_hf_folder(path)
    if path.suffix == ".gguf" and path.is_file():
        return load_gguf(path)
    raise UsageError(f"checkpoint {str(path)!r} is not accepted; accepted: a folder with config.json and "
                     f"*.safetensors, or an existing .gguf file")
