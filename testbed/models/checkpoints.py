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
  1 is subtracted on load and added on write. The query scale is not stored: llama.cpp derives it from
  the block count (gguf_query_pre_attn_scalar), and so do we.

Nothing is ignored silently: a config.json key or GGUF metadata key that may change the computation
and that the reference model does not implement (a RoPE type, soft-capping of attention logits, an
activation, bidirectional attention, an unknown key) is a UsageError naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np

from refimpl.gemma import GemmaConfig, weight_shapes
from testbed.config import project_path
from testbed.errors import UsageError
from testbed.inputs import parse_json, read_bounded, shown
from testbed.models import gguf_reader

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}
GGUF_ARCH = "gemma3"
# llama.cpp's limit on a model's blocks (src/llama-hparams.h: per-layer settings are arrays of this size);
# no released model comes near it. testbed takes no more, from a GGUF or a config.json.
LLAMA_MAX_LAYERS = 512


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

# What transformers computes with when a key is absent (Gemma3TextConfig, transformers 4.50 to 5.x): the
# multimodal releases' text_config states only what differs from these.
HF_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "sliding_window_pattern": 6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False,
    "use_bidirectional_attention": False, "layer_types": None, "rope_parameters": None, "rope_scaling": None,
    "model_type": "gemma3_text",
}
# Keys that do not change what the model computes from token ids: bookkeeping, token ids of the
# tokenizer, generation and training settings (dropout is off at inference), and the context length
# (read only by RoPE types this loader refuses). transformers 5 saves _sliding_window_pattern but never
# reads it back. Any key neither here nor in HF_DEFAULTS is refused: it may change the computation.
HF_INERT_KEYS = frozenset({
    "architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "bos_token_id",
    "eos_token_id", "pad_token_id", "use_cache", "cache_implementation", "initializer_range",
    "attention_dropout", "max_position_embeddings", "_sliding_window_pattern", "output_hidden_states",
    "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
    "label2id", "problem_type", "tokenizer_class",
})
HF_MODEL_TYPES = ("gemma3_text", "gemma3")
HF_LAYER_TYPES = {"sliding_attention": "local", "full_attention": "global"}
HF_ROPE_TYPES = ("default", "linear")


# The largest config value testbed takes for a count: llama.cpp and transformers hold them in int32.
HF_MAX_COUNT = 2**31 - 1


def hf_count(hf: dict, key: str, source: str, low: int = 1, high: int = HF_MAX_COUNT) -> int:
    """An integer field of a config.json in low..high (a bool, a float or a string is refused)."""
    value = hf.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"{source}: {key}={shown(value)} is not accepted; accepted: an integer in "
                         f"{low}..{high}")
    return value


def hf_number(value, key: str, source: str, positive: bool = True) -> float:
    """A finite number of a config.json (positive unless told)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) \
            or (positive and not value > 0):
        raise UsageError(f"{source}: {key}={shown(value)} is not accepted; accepted: a finite"
                         f"{' positive' if positive else ''} number")
    return float(value)


def hf_kind(value, kind: type, key: str, source: str, accepted: str):
    """`value` if it is a `kind` (dict, list, ...), else refused naming the key."""
    if not isinstance(value, kind):
        raise UsageError(f"{source}: {key}={shown(value)} is not accepted; accepted: {accepted}")
    return value


def hf_rope(hf: dict, source: str) -> dict:
    """The RoPE settings as transformers 5 resolves them: `rope_parameters` per layer type; a config
    saved by transformers 4 has rope_theta (global), rope_local_base_freq and rope_scaling instead,
    and rope_scaling applies to the global layers only. Returns GemmaConfig's rope fields."""
    given = hf["rope_parameters"] or {}
    if not isinstance(given, dict) or not set(given) <= set(HF_LAYER_TYPES):
        raise UsageError(f"{source}: rope_parameters={shown(given)} is not accepted; accepted: a dict keyed by "
                         f"layer type ({', '.join(HF_LAYER_TYPES)})")
    params = {t: dict(hf_kind(given.get(t) or {}, dict, f"rope_parameters.{t}", source, "a dict"))
              for t in HF_LAYER_TYPES}
    if hf["rope_scaling"] is not None:
        params["full_attention"].update(hf_kind(hf["rope_scaling"], dict, "rope_scaling", source, "null or a dict"))
    params["full_attention"].setdefault("rope_theta", hf["rope_theta"])
    params["sliding_attention"].setdefault("rope_theta", hf["rope_local_base_freq"])
    theta, factor = {}, {}
    for layer_type, p in params.items():
        kind = p.get("rope_type", p.get("type", "default"))
        where = f"{source}: RoPE of {layer_type}"
        if not isinstance(kind, str) or kind not in HF_ROPE_TYPES:
            raise UsageError(f"{where}: rope_type={shown(kind)} is not implemented; accepted: "
                             f"{', '.join(HF_ROPE_TYPES)}")
        known = {"rope_type", "type", "rope_theta"} | ({"factor"} if kind == "linear" else set())
        unknown = sorted(set(p) - known)
        if unknown:
            raise UsageError(f"{where}: {unknown[0]}={shown(p[unknown[0]])} is not implemented for "
                             f"rope_type={kind!r}; accepted keys: {', '.join(sorted(known))}")
        if kind == "linear" and "factor" not in p:
            raise UsageError(f"{where}: rope_type='linear' needs a factor")
        theta[layer_type] = hf_number(p["rope_theta"], f"{layer_type} rope_theta", source)
        factor[layer_type] = hf_number(p.get("factor", 1.0), f"{layer_type} factor", source)
    if factor["sliding_attention"] != 1.0:
        raise UsageError(f"{source}: RoPE of sliding_attention: factor={factor['sliding_attention']} is not "
                         f"implemented; accepted: linear scaling of the full_attention layers only")
    return {"rope_local": theta["sliding_attention"], "rope_global": theta["full_attention"],
            "rope_scaling_global": factor["full_attention"]}


def config_from_hf(config: dict, source: str) -> GemmaConfig:
    """A Gemma 3 config.json (text-only, or the text_config of a multimodal one) as transformers reads
    it. Whatever would make transformers compute something this model does not is refused."""
    given = hf_kind(config.get("text_config", config), dict, "text_config", source, "an object")
    unknown = sorted(set(given) - set(HF_DEFAULTS) - HF_INERT_KEYS)
    if unknown:
        raise UsageError(f"{source}: key {unknown[0]!r}={shown(given[unknown[0]])} is not implemented by this "
                         f"loader (it may change the computation); accepted keys: "
                         f"testbed.models.checkpoints.HF_DEFAULTS and HF_INERT_KEYS")
    hf = {**HF_DEFAULTS, **given}
    refused = {"model_type": HF_MODEL_TYPES, "hidden_activation": ("gelu_pytorch_tanh",),
               "attn_logit_softcapping": (None,), "attention_bias": (False,),
               "use_bidirectional_attention": (False,)}
    for key, accepted in refused.items():
        if hf[key] not in accepted:
            raise UsageError(f"{source}: {key}={shown(hf[key])} is not implemented; accepted: "
                             f"{', '.join(map(repr, accepted))}")
    hf_number(hf["query_pre_attn_scalar"], "query_pre_attn_scalar", source)
    window = hf_count(hf, "sliding_window", source)
    layers = hf_count(hf, "num_hidden_layers", source, high=LLAMA_MAX_LAYERS)
    if hf["layer_types"] is not None:
        given_types = hf_kind(hf["layer_types"], list, "layer_types", source, f"a list of {layers} layer types")
        bad = [t for t in given_types if not isinstance(t, str) or t not in HF_LAYER_TYPES]
        if bad:
            raise UsageError(f"{source}: layer type {shown(bad[0])} is not accepted; accepted: "
                             f"{', '.join(HF_LAYER_TYPES)}")
        types = [HF_LAYER_TYPES[t] for t in given_types]
    else:
        pattern = hf_count(hf, "sliding_window_pattern", source)
        types = ["global" if (i + 1) % pattern == 0 else "local" for i in range(layers)]
    softcap = hf["final_logit_softcapping"]
    try:
        return GemmaConfig(
            vocab=hf_count(hf, "vocab_size", source), hidden=hf_count(hf, "hidden_size", source), layers=layers,
            heads=hf_count(hf, "num_attention_heads", source), kv_heads=hf_count(hf, "num_key_value_heads", source),
            head_dim=hf_count(hf, "head_dim", source), mlp=hf_count(hf, "intermediate_size", source),
            window=window, layer_types=tuple(types), **hf_rope(hf, source),
            query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
            rms_eps=hf_number(hf["rms_norm_eps"], "rms_norm_eps", source),
            final_logit_softcap=None if softcap is None else hf_number(softcap, "final_logit_softcapping", source),
            tie_embeddings=hf_kind(hf["tie_word_embeddings"], bool, "tie_word_embeddings", source, "true or false"),
        )
    except ValueError as e:
        raise UsageError(f"{source}: {e}") from None


def config_to_hf(cfg: GemmaConfig) -> dict:
    """config.json as transformers 5 saves it (RoPE under rope_parameters, per layer type)."""
    global_rope = {"rope_type": "default", "rope_theta": cfg.rope_global}
    if cfg.rope_scaling_global != 1.0:
        global_rope = {"rope_type": "linear", "factor": cfg.rope_scaling_global, "rope_theta": cfg.rope_global}
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": cfg.vocab, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.mlp, "sliding_window": cfg.window,
        "layer_types": ["full_attention" if t == "global" else "sliding_attention" for t in cfg.layer_types],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local},
                            "full_attention": global_rope},
        # transformers 5 validates this field as an int
        "query_pre_attn_scalar": int(q) if (q := cfg.query_pre_attn_scalar) == int(q) else q, "rms_norm_eps": cfg.rms_eps,
        "final_logit_softcapping": cfg.final_logit_softcap, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None,
    }


# safetensors' own bound on a header (safetensors/src/tensor.rs, MAX_HEADER_SIZE)
SAFETENSORS_MAX_HEADER = 100_000_000
# A config.json is a few kB; a file past this is not one.
CONFIG_MAX_BYTES = 16 << 20


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file, as read-only views into the file (BF16 widened to float32).
    The header is checked before any tensor is made: its length against the file's, each entry's dtype,
    shape and offsets against the bytes the file holds, as the safetensors package checks them."""
    size = path.stat().st_size
    if size < 8:
        raise UsageError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    data = np.memmap(path, np.uint8, mode="r")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > min(size - 8, SAFETENSORS_MAX_HEADER):
        raise UsageError(f"{path}: not a safetensors file (its header claims {n} bytes; the file holds {size - 8} "
                         f"after the length, safetensors reads at most {SAFETENSORS_MAX_HEADER})")
    header = parse_json(bytes(data[8:8 + n]), f"{path}: the safetensors header", kind=dict)
    body = data[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise UsageError(f"{where}: {shown(info)} is not an entry {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
            raise UsageError(f"{where} has dtype {shown(dtype)}; accepted: {', '.join(SAFETENSORS_DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise UsageError(f"{where} has shape {shown(shape)}; accepted: a list of sizes >= 0")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(
                isinstance(o, int) and not isinstance(o, bool) for o in offsets) or not 0 <= offsets[0] <= offsets[1]:
            raise UsageError(f"{where} has data_offsets {shown(offsets)}; accepted: [begin, end], "
                             f"0 <= begin <= end")
        begin, end = offsets
        itemsize = np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize
        needs = int(np.prod(shape, dtype=object)) * itemsize
        if end > body.size:
            raise UsageError(f"{where}: data_offsets {offsets} run past the end of the file ({body.size} bytes after "
                             f"its header: a truncated file?)")
        if end - begin != needs:
            raise UsageError(f"{where}: data_offsets {offsets} hold {end - begin} bytes; {dtype} {shape} needs {needs}")
        a = body[begin:end].view(SAFETENSORS_DTYPES[dtype]).reshape(shape)
        if dtype == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = a
    return out


def read_config(config_file: Path) -> dict:
    """A checkpoint's config.json: a JSON object of at most CONFIG_MAX_BYTES."""
    return parse_json(read_bounded(config_file, CONFIG_MAX_BYTES, str(config_file), "a config.json is a few kB"),
                      str(config_file), kind=dict)


def read_hf_folder(folder: str | Path) -> tuple[dict, dict[str, np.ndarray], str]:
    """A Hugging Face folder's config.json (parsed) and every tensor of its *.safetensors files, and
    the config file's name for messages; the model's own loader checks both."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise UsageError(f"checkpoint folder {folder} has no config.json")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UsageError(f"checkpoint folder {folder} has no *.safetensors file")
    config = read_config(config_file)
    weights = {}
    for f in files:
        weights.update(read_safetensors(f))
    return config, weights, str(config_file)


def load_hf_folder(folder: str | Path) -> tuple[GemmaConfig, dict[str, np.ndarray]]:
    config, weights, source = read_hf_folder(folder)
    cfg = config_from_hf(config, source)
    return cfg, check_weights(weights, cfg, str(folder))


def save_hf_folder(folder: str | Path, cfg: GemmaConfig, weights: dict[str, np.ndarray],
                   config_json: dict | None = None) -> Path:
    """config.json (`config_json`, else Gemma 3's config_to_hf) + model.safetensors (float32), written by the
    safetensors package."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_json or config_to_hf(cfg), indent=1) + "\n")
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


def hf_folder_of(cfg, weights: dict[str, np.ndarray], cache: Path | None = None,
                 config_json: dict | None = None) -> Path:
    """The Hugging Face folder of a model given as config and weights (a seeded preset), written once per
    content under .cache/hf/: what an engine that takes a Hugging Face folder (model_formats: [hf]) is handed.
    `cfg` is a GemmaConfig (config.json by config_to_hf) or another model's config with its `config_json`
    (the Qwen3.5 hybrid's: testbed.models.hybrid_checkpoints.hf_folder_of)."""
    h = hashlib.sha256(repr(cfg).encode() + json.dumps(config_json, sort_keys=True).encode())
    for name in sorted(weights):
        h.update(name.encode() + b"\0" + np.ascontiguousarray(weights[name], np.float32).tobytes())
    out = (cache or project_path(".cache/hf")) / h.hexdigest()[:16]
    if not (out / "config.json").is_file():
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf_folder(tmp, cfg, weights, config_json)
        try:
            tmp.rename(out)
        except OSError:  # another process wrote the same folder first
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# --- GGUF ------------------------------------------------------------------------------------------


def _gguf_names(cfg_layers: int) -> "gguf.TensorNameMap":
    import gguf

    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg_layers)


def _from_float32(x) -> float:
    """GGUF stores float32 metadata: 1e-6 comes back as 9.99999997e-07. Seven significant digits
    (what a float32 holds) give back the decimal the writer meant."""
    return float(f"{float(x):.7g}")


# What the writer states as the training context when the folder's config does not (transformers'
# Gemma3TextConfig default).
DEFAULT_CONTEXT = 131_072
# llama.cpp's converter adds 1 to every Gemma 3 norm weight (its RMSNorm multiplies by w, Gemma's by 1 + w).
GGUF_NORM_SHIFT = 1.0
# Metadata that does not change what llama.cpp computes for gemma3: descriptions, the tokenizer, the
# quantizer's notes, the GGUF header's own counts, the context length, and two RoPE keys read only by
# YaRN (refused below). Any other key is refused: llama.cpp may compute with it.
GGUF_INERT_PREFIXES = ("general.", "tokenizer.", "quantize.", "GGUF.")
GGUF_INERT_KEYS = ("{arch}.context_length", "{arch}.rope.scaling.finetuned", "{arch}.rope.scaling.original_context_length")


def gguf_query_pre_attn_scalar(layers: int, hidden: int, heads: int, head_dim: int) -> float:
    """GGUF stores no query scale; llama.cpp derives it from the block count: Gemma 3 27B (62 layers)
    scales queries by 1/sqrt(hidden / heads), every other size by 1/sqrt(head_dim)."""
    return float(hidden // heads) if layers == 62 else float(head_dim)


def gguf_layer_types(layers: int, window: int, pattern) -> tuple[str, ...]:
    """As llama.cpp reads gemma3: no sliding window (absent or 0) means every layer is global; else
    `sliding_window_pattern` is one bool per layer (true = local), or n (default 6): layer i is local
    iff i % n < n - 1 (n = 0: every layer local)."""
    if not window:
        return ("global",) * layers
    if not isinstance(pattern, int):  # one bool per layer (GGUFFile.array checked its length)
        return tuple("local" if p else "global" for p in pattern)
    n = int(pattern)
    return tuple("local" if n == 0 or i % n < n - 1 else "global" for i in range(layers))


class GGUFFile:
    """A GGUF opened as llama.cpp's loader reads it (testbed.models.gguf_reader: bounded by the file).

    `meta` reads a metadata key as it is (a missing one without a default is refused); `count`,
    `number`, `text` and `array` read it as a value of that kind and refuse any other, and
    every count is bounded by the model's limits (LLAMA_MAX_LAYERS blocks) and by the file: no extent
    of the model can exceed the largest dimension of a tensor the file holds, so nothing computed from
    the metadata outgrows the file. `refuse_unread` refuses the first key neither read nor inert, so no
    setting of the file goes unseen; `tensors` by name; `vocab` is token_embd's rows (the file's
    vocab_size, if written, must agree: testbed writes tokenizer.ggml.model = none)."""

    def __init__(self, path: str | Path, arch: str, inert_keys):
        import gguf

        self.file = gguf_reader.read(path)
        self.path = self.file.path
        self.fields = {name: f.value for name, f in self.file.fields.items()}
        self.arch = self.fields.get("general.architecture")
        if self.arch != arch:
            raise UsageError(f"{self.path}: architecture {shown(self.arch)} is not accepted; accepted: {arch}")
        self.read: set[str] = {k.format(arch=arch) for k in inert_keys}
        self.tensors = dict(self.file.tensors)
        embedding = self.tensors.get("token_embd.weight")
        if embedding is None:
            raise UsageError(f"{self.path}: missing tensor 'token_embd.weight'")
        if len(embedding.shape) != 2:
            raise UsageError(f"{self.path}: tensor 'token_embd.weight' has shape {embedding.shape}; accepted: "
                             f"[vocab, hidden]")
        self.vocab = embedding.shape[0]
        key = gguf.Keys.LLM.VOCAB_SIZE
        if self.count(key, self.vocab) != self.vocab:
            self.refuse(key, self.meta(key), f"{self.vocab} (token_embd's rows)")

    def meta(self, key: str, default=None):
        """A metadata value; without a default, a missing key is refused."""
        full = key.format(arch=self.arch)
        self.read.add(full)
        if full not in self.fields and default is None:
            raise UsageError(f"{self.path}: metadata {full!r} is missing")
        return self.fields.get(full, default)

    def _typed(self, key: str, default, kinds: frozenset, accepted: str):
        value = self.meta(key, default)
        field = self.file.fields.get(key.format(arch=self.arch))
        if field is not None and field.kind not in kinds:
            self.refuse(key, value, f"{accepted} (it is stored as {field.type_name})", "is not accepted")
        return value

    def count(self, key: str, default=None, low: int = 1, high: int | None = None) -> int:
        """An integer key in low..high; `high` defaults to the largest dimension of any tensor in the file
        (no extent of the model is larger)."""
        bound = "" if high is not None else " (no tensor of the file is larger)"
        high = self.file.largest_dimension if high is None else high
        value = self._typed(key, default, gguf_reader.INTEGER_TYPES, "an integer")
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            self.refuse(key, value, f"an integer in {low}..{high}{bound}", "is not accepted")
        return value

    def number(self, key: str, default=None, positive: bool = False) -> float:
        """A finite float (llama.cpp reads these keys as float32 only), positive when asked."""
        value = self._typed(key, default, gguf_reader.FLOAT_TYPES, "a float")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) \
                or (positive and not value > 0):
            self.refuse(key, value, f"a finite{' positive' if positive else ''} number", "is not accepted")
        return float(value)

    def text(self, key: str, default=None) -> str:
        value = self._typed(key, default, frozenset({gguf_reader.STRING}), "a string")
        if not isinstance(value, str):
            self.refuse(key, value, "a string", "is not accepted")
        return value

    def array(self, key: str, item_kinds: frozenset, lengths: range, accepted: str) -> np.ndarray:
        """An array key whose entries are of `item_kinds` and whose length is in `lengths`."""
        value = self.meta(key)
        field = self.file.fields[key.format(arch=self.arch)]
        if field.kind != gguf_reader.ARRAY or field.item not in item_kinds or len(value) not in lengths:
            length = f"{lengths.start}" if len(lengths) == 1 else f"{lengths.start}..{lengths.stop - 1}"
            self.refuse(key, value, f"an array of {length} {accepted} (it is stored as {field.type_name}"
                                    f"{f', {len(value)} entries' if field.kind == gguf_reader.ARRAY else ''})",
                        "is not accepted")
        return value

    def refuse(self, key: str, value, accepted: str, why: str = "is not implemented"):
        raise UsageError(f"{self.path}: metadata {key.format(arch=self.arch)}={shown(value)} {why}; "
                         f"accepted: {accepted}")

    def refuse_unread(self, inert_prefixes: tuple[str, ...], accepted: str) -> None:
        unknown = sorted(k for k in self.fields if k not in self.read and not k.startswith(inert_prefixes))
        if unknown:
            self.refuse(unknown[0], self.fields[unknown[0]], accepted)

    def layer_count(self, key: str) -> int:
        """The block count: at most LLAMA_MAX_LAYERS (llama.cpp refuses more), and at most the file's
        tensors (every block has some)."""
        return self.count(key, high=min(LLAMA_MAX_LAYERS, len(self.tensors)))

    def weight(self, gguf_name: str, hf_name: str, shape: tuple[int, ...], read: bool = True) -> np.ndarray | None:
        """A tensor taken out of `tensors`, checked to have `shape` and a type testbed dequantizes, then
        dequantized to float32 (read=False: checked only, None)."""
        t = self.tensors.pop(gguf_name, None)
        if t is None:
            raise UsageError(f"{self.path}: missing tensor {gguf_name!r} ({hf_name})")
        if t.shape != tuple(shape):
            raise UsageError(f"{self.path}: tensor {gguf_name!r} holding {hf_name!r} has shape {t.shape}, the config "
                             f"needs {tuple(shape)}")
        if not read:
            t.float32(self.path, rows=0)  # its type's dequantization exists
            return None
        return t.float32(self.path)


def load_gguf(path: str | Path, weights: bool = True) -> tuple[GemmaConfig, dict[str, np.ndarray]]:
    """A gemma3 GGUF read as llama.cpp reads it (src/models/gemma3.cpp, llama_model::load_hparams).
    weights=False: its metadata and its tensors' names, shapes and types checked, no weight read ({})."""
    import gguf

    g = GGUFFile(path, GGUF_ARCH, GGUF_INERT_KEYS)
    path, tensors, refuse, vocab, K = g.path, g.tensors, g.refuse, g.vocab, gguf.Keys
    layers = g.layer_count(K.LLM.BLOCK_COUNT)
    hidden, heads = g.count(K.LLM.EMBEDDING_LENGTH), g.count(K.Attention.HEAD_COUNT)
    head_dim = g.count(K.Attention.KEY_LENGTH, max(hidden // heads, 1))
    for key in (K.Attention.VALUE_LENGTH, K.Rope.DIMENSION_COUNT):
        if g.count(key, head_dim) != head_dim:
            refuse(key, g.meta(key), f"{head_dim} (the key length)")
    scaling_type = g.text(K.Rope.SCALING_TYPE, "linear")  # llama.cpp's default type
    # 0: not scaled; rope.scale_linear is the key's old name, still read by llama.cpp
    factor = g.number(K.Rope.SCALING_FACTOR, g.number("{arch}.rope.scale_linear", 0.0))
    if scaling_type not in ("linear", "none") or (scaling_type == "none" and factor not in (0.0, 1.0)):
        refuse(K.Rope.SCALING_TYPE, scaling_type, "linear, or none without a factor")
    if factor < 0:
        refuse(K.Rope.SCALING_FACTOR, factor, "0 (not scaled) or a positive factor", "is not accepted")
    window = g.count(K.Attention.SLIDING_WINDOW, 0, low=0, high=2**32 - 1)
    pattern = g.meta(K.Attention.SLIDING_WINDOW_PATTERN, 6)
    if not isinstance(pattern, int) or isinstance(pattern, bool):  # per layer: as many bools as blocks
        pattern = g.array(K.Attention.SLIDING_WINDOW_PATTERN, frozenset({gguf_reader.BOOL_TYPE}),
                          range(layers, layers + 1), "bools (one per block)")
    else:
        pattern = g.count(K.Attention.SLIDING_WINDOW_PATTERN, 6, low=0, high=2**32 - 1)
    softcap = g.number(K.LLM.FINAL_LOGIT_SOFTCAPPING, 0.0)
    settings = dict(
        vocab=vocab, hidden=hidden, layers=layers, heads=heads,
        kv_heads=g.count(K.Attention.HEAD_COUNT_KV), head_dim=head_dim, mlp=g.count(K.LLM.FEED_FORWARD_LENGTH),
        window=window or GemmaConfig.window, layer_types=gguf_layer_types(layers, window, pattern),
        rope_global=g.number(K.Rope.FREQ_BASE, 10_000.0, positive=True),
        rope_local=g.number(K.Rope.FREQ_BASE_SWA, 10_000.0, positive=True), rope_scaling_global=factor or 1.0,
        query_pre_attn_scalar=gguf_query_pre_attn_scalar(layers, hidden, heads, head_dim),
        rms_eps=_from_float32(g.number(K.Attention.LAYERNORM_RMS_EPS, positive=True)),
        final_logit_softcap=softcap or None, tie_embeddings="output.weight" not in tensors,
    )
    g.refuse_unread(GGUF_INERT_PREFIXES, "the gemma3 keys testbed.models.checkpoints.load_gguf reads")
    try:
        cfg = GemmaConfig(**settings)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None
    names = _gguf_names(cfg.layers)
    read = {}
    for hf_name, shape in weight_shapes(cfg).items():
        gguf_name = "output.weight" if hf_name == "lm_head.weight" else names.get_name(hf_name, try_suffixes=(".weight",))
        a = g.weight(gguf_name, hf_name, shape, read=weights)
        if weights:
            read[hf_name] = a - GGUF_NORM_SHIFT if hf_name.endswith("norm.weight") else a
    if tensors:
        raise UsageError(f"{path}: unexpected tensor {next(iter(tensors))!r} (not a tensor of this Gemma config)")
    return cfg, check_weights(read, cfg, str(path)) if weights else {}


def gguf_writer(path: Path, arch: str, cfg, context_length: int) -> "gguf.GGUFWriter":
    """A GGUF writer holding the decoder's shape every architecture states the same way: blocks, widths,
    heads, key and value lengths, and the context length (llama.cpp requires it, and only warns past it).
    `cfg` is a GemmaConfig or a HybridConfig (the same field names)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(context_length)
    writer.add_block_count(cfg.layers)
    writer.add_embedding_length(cfg.hidden)
    writer.add_feed_forward_length(cfg.mlp)
    writer.add_head_count(cfg.heads)
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    return writer


# The tensor types testbed writes a Gemma 3 GGUF in (save_gguf's tensor_type): every weight matrix in that
# type, as llama.cpp's converter writes `--outtype f32|f16|q8_0`; the norms stay float32 in all three.
TENSOR_TYPES = ("f32", "f16", "q8_0")


def save_gguf(path: str | Path, cfg: GemmaConfig, weights: dict[str, np.ndarray],
              context_length: int = DEFAULT_CONTEXT, tensor_type: str = "f32") -> Path:
    """A GGUF in llama.cpp's converter's form (names, metadata, norm weights + 1), without a tokenizer
    (tokenizer.ggml.model = none and the vocabulary's size: llama.cpp then takes token ids as given).
    `tensor_type` (TENSOR_TYPES): the weight matrices in float32, float16 (numpy's round to nearest even,
    as the converter) or q8_0 (ggml's reference quantiser, gguf.quants: blocks of 32 values along a row,
    each one float16 scale d = max|x| / 127 and 32 int8 q = round(x / d)); the norms in float32. A config the
    format cannot carry (a query scale llama.cpp would not derive) is refused, not written wrong."""
    import gguf

    if tensor_type not in TENSOR_TYPES:
        raise UsageError(f"GGUF tensor type {tensor_type!r} is not accepted; accepted: {', '.join(TENSOR_TYPES)}")

    derived = gguf_query_pre_attn_scalar(cfg.layers, cfg.hidden, cfg.heads, cfg.head_dim)
    if cfg.query_pre_attn_scalar != derived:
        raise UsageError(f"query_pre_attn_scalar={cfg.query_pre_attn_scalar:g} cannot be stored in a GGUF; "
                         f"accepted: {derived:g} (what llama.cpp derives for {cfg.layers} layers)")
    path = Path(path)
    writer = gguf_writer(path, GGUF_ARCH, cfg, context_length)
    if "local" in cfg.layer_types:
        writer.add_sliding_window(cfg.window)
        if cfg.layer_types != gguf_layer_types(cfg.layers, cfg.window, 6):
            writer.add_sliding_window_pattern([t == "local" for t in cfg.layer_types])
    writer.add_rope_freq_base(cfg.rope_global)
    writer.add_rope_freq_base_swa(cfg.rope_local)
    if cfg.rope_scaling_global != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_scaling_global)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    if cfg.final_logit_softcap:
        writer.add_final_logit_softcapping(cfg.final_logit_softcap)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[tensor_type])
    writer.add_tokenizer_model("none")
    writer.add_vocab_size(cfg.vocab)
    names = _gguf_names(cfg.layers)
    for hf_name, a in weights.items():
        gguf_name = "output.weight" if hf_name == "lm_head.weight" else names.get_name(hf_name, try_suffixes=(".weight",))
        a = np.ascontiguousarray(a, np.float32)
        if hf_name.endswith("norm.weight"):
            writer.add_tensor(gguf_name, a + GGUF_NORM_SHIFT)
        elif tensor_type == "f16":
            writer.add_tensor(gguf_name, a.astype(np.float16))
        elif tensor_type == "q8_0":
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, a)
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
