"""GGUF files written by testbed from a Hugging Face folder, for engines that read GGUF (llama.cpp).

testbed writes the GGUF itself (with the `gguf` package, in the form llama.cpp's converter gives
it) rather than running the converter: the converter needs torch and the tree's own gguf-py, and a
file testbed writes is a file testbed can judge. Two families: Gemma 3 (testbed.models.checkpoints,
arch gemma3) and the Qwen3.5 hybrid (testbed.models.hybrid_checkpoints, arch qwen35), chosen by the
folder's config.json model_type.

A written file is judged before it is kept: testbed's own reader (the family's load_gguf, which
reads as llama.cpp reads) must give back the folder's config and weights as the model computes
with them: every config field (floats as the float32 a GGUF stores), every tensor bit for bit in
the form the model uses (a norm stored as 1 + w compared as 1 + w), Qwen3.5's decay -exp(A_log)
within 2 float32 ulps (stored as A, read back through a log). What does not come back is refused
with one line naming it, and nothing is left behind: a file appears whole and judged, or not at all.

  gguf_for(checkpoint)   the GGUF of a folder, written once per content under .cache/gguf/ (a .gguf
                         file is checked by testbed's reader, then returned as it is)
  gguf_of(cfg, weights[, tensor_type])  the same for a model given as config and weights (a seeded
                         shape); a Gemma 3 model in f32, f16 or q8_0 (checkpoints.TENSOR_TYPES)
  held_in(weights, tensor_type)  the weights as a GGUF of that tensor type holds them (float32 values):
                         what a reference computes with for a file written in f16 or q8_0
  write_gguf(folder, out)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import numpy as np

from testbed.config import project_path
from testbed.errors import UsageError
from testbed.inputs import shown
from testbed.models import checkpoints as gemma_checkpoints, hybrid_checkpoints
from testbed.models.checkpoints import read_config

CACHE = project_path(".cache/gguf")
FAMILIES = {"gemma3": gemma_checkpoints, "gemma3_text": gemma_checkpoints,
            "qwen3_5": hybrid_checkpoints, "qwen3_5_text": hybrid_checkpoints}
# Tensors whose computed form passes through a transcendental on one side only (ulps allowed).
ULPS = {".A_log": 2}


def architecture(path: str | Path) -> str:
    """A GGUF file's general.architecture (gemma3, qwen35, ...)."""
    from testbed.models import gguf_reader

    value = gguf_reader.read(path).fields.get("general.architecture")
    return value.value if value is not None and isinstance(value.value, str) else ""


def load_gguf(path: str | Path, weights: bool = True):
    """(config, weights) of a gemma3 or qwen35 GGUF, by its architecture; any other is refused.
    weights=False: the file checked as far as reading no weight goes (metadata; tensors' names, shapes
    and types), the config and {}: what is checked before a run, in the file's header's time."""
    arch = architecture(path)
    modules = {m.GGUF_ARCH: m for m in FAMILIES.values()}
    if arch not in modules:
        raise UsageError(f"{path}: architecture {arch!r} is not accepted; accepted: {', '.join(sorted(modules))}")
    return modules[arch].load_gguf(path, weights)


def family(folder: Path):
    """The checkpoint module for the folder's model_type, and the parsed config.json."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise UsageError(f"checkpoint folder {folder} has no config.json; accepted: a Hugging Face folder")
    config = read_config(config_file)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise UsageError(f"{config_file}: model_type {shown(model_type)} cannot be written to a GGUF by testbed; "
                         f"accepted: {', '.join(FAMILIES)}")
    return FAMILIES[model_type], config


def computed(module, name: str, a: np.ndarray) -> np.ndarray:
    """A tensor as the model computes with it."""
    a = np.asarray(a, np.float32)
    if name.endswith("norm.weight") and (module is gemma_checkpoints or hybrid_checkpoints.shifted_norm(name)):
        return a + np.float32(1.0)
    if name.endswith(".A_log"):
        return -np.exp(a)
    return a


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """The largest distance in float32 units in the last place (same-sign values)."""
    ia, ib = a.astype(np.float32).view(np.int32).astype(np.int64), b.astype(np.float32).view(np.int32).astype(np.int64)
    return int(np.abs(ia - ib).max()) if a.size else 0


def config_problem(cfg, back) -> str | None:
    """The first config field that does not come back, as `field=value (reads back as ...)`."""
    for f in dataclasses.fields(cfg):
        want, got = getattr(cfg, f.name), getattr(back, f.name)
        if f.name == "window" and "local" not in cfg.layer_types:  # Gemma: no layer reads it
            continue
        if f.name == "rotary_fraction":  # stored as a count of dims: the count must come back
            want, got = cfg.rotary_dim, back.rotary_dim
        same = np.float32(want) == np.float32(got) if isinstance(want, float) and want is not None and \
            isinstance(got, float) else want == got
        if not same:
            return f"{f.name}={getattr(cfg, f.name)!r} (reads back as {getattr(back, f.name)!r})"
    return None


def judge(module, cfg, weights: dict, path: Path, source: str) -> None:
    """UsageError naming the first config field or tensor the written file does not give back."""
    back_cfg, back = module.load_gguf(path)
    problem = config_problem(cfg, back_cfg)
    if problem:
        raise UsageError(f"{source}: {problem} cannot be written to a GGUF as llama.cpp reads it; accepted: values "
                         f"a GGUF of arch {module.GGUF_ARCH} carries exactly")
    for name, a in weights.items():
        if name not in back:
            raise UsageError(f"{source}: tensor {name!r} is not in the written GGUF")
        want, got = computed(module, name, a), computed(module, name, back[name])
        allowed = next((n for suffix, n in ULPS.items() if name.endswith(suffix)), 0)
        if want.shape != got.shape or (not np.array_equal(want, got) and ulps(want, got) > allowed):
            raise UsageError(f"{source}: tensor {name!r} does not come back from the GGUF as the model computes it "
                             f"(shape {got.shape}, largest difference {float(np.max(np.abs(want - got))):.3g}); "
                             f"accepted: equal{f' within {allowed} ulps' if allowed else ''}")


def write_gguf(folder: str | Path, out: str | Path) -> Path:
    """The GGUF of a Hugging Face folder at `out`, judged by testbed's reader before it appears."""
    folder = Path(folder)
    out = Path(out)
    if out.is_dir():
        raise UsageError(f"--out {out} is a folder; accepted: the path of the .gguf file to write")
    module, config = family(folder)
    cfg, weights = module.load_hf_folder(folder)  # refuses what the reference does not compute
    text = config.get("text_config", config)
    context = text.get("max_position_embeddings", module.DEFAULT_CONTEXT)
    if isinstance(context, bool) or not isinstance(context, int) or not 0 < context < 2**32:
        raise UsageError(f"{folder / 'config.json'}: max_position_embeddings={shown(context)} is not accepted; "
                         f"accepted: an integer in 1..{2**32 - 1} (a GGUF's uint32 context_length)")
    return write_judged(module, cfg, weights, out, str(folder), context)


def write_judged(module, cfg, weights: dict, out: Path, source: str, context: int, **options) -> Path:
    """`out` written whole and judged, or not at all (a folder or file that cannot be written is refused);
    `options` go to the family's save_gguf (tensor_type)."""
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            module.save_gguf(tmp, cfg, weights, context_length=context, **options)
        except UsageError as e:  # what the format cannot carry, said of the model it was asked of
            raise UsageError(f"{source}: {e}") from None
        judge(module, cfg, weights, tmp, source)
        tmp.rename(out)
    except OSError as e:
        raise UsageError(f"{out}: cannot be written: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


def held_in(weights: dict, tensor_type: str) -> dict:
    """The weights as a Gemma 3 GGUF of `tensor_type` holds them, as float32: f32 as given; f16 each matrix
    rounded to float16 and back; q8_0 each matrix quantised by ggml's reference quantiser (gguf.quants, bit
    for bit ggml's quantize_row_q8_0_ref) and dequantised, q * d. Vectors (the norms) are stored in float32
    in every type. A matrix whose rows are not whole blocks of 32 cannot be q8_0 (refused)."""
    import gguf

    if tensor_type not in gemma_checkpoints.TENSOR_TYPES:
        raise UsageError(f"GGUF tensor type {tensor_type!r} is not accepted; accepted: "
                         f"{', '.join(gemma_checkpoints.TENSOR_TYPES)}")
    out = {}
    for name, a in weights.items():
        a = np.ascontiguousarray(a, np.float32)
        if a.ndim == 2 and tensor_type == "f16":
            a = a.astype(np.float16).astype(np.float32)
        elif a.ndim == 2 and tensor_type == "q8_0":
            if a.shape[1] % 32:
                raise UsageError(f"tensor {name!r} has rows of {a.shape[1]} values; q8_0 takes rows of whole "
                                 "blocks of 32")
            qtype = gguf.GGMLQuantizationType.Q8_0
            a = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype).astype(np.float32)
        out[name] = a
    return out


def gguf_of(cfg, weights: dict, cache: Path | None = None, tensor_type: str = "f32") -> Path:
    """The GGUF of a model given as config and weights (a seeded `shape`), written once per content. A
    Gemma 3 model may be written in f16 or q8_0 (tensor_type): the file is judged to hold exactly
    held_in(weights, tensor_type); the Qwen3.5 hybrid in f32 only."""
    module = hybrid_checkpoints if isinstance(cfg, hybrid_checkpoints.HybridConfig) else gemma_checkpoints
    if tensor_type != "f32" and module is not gemma_checkpoints:
        raise UsageError(f"GGUF tensor type {tensor_type!r}: testbed writes the {module.GGUF_ARCH} model in f32 only; "
                         "accepted: f32")
    h = hashlib.sha256(repr(cfg).encode() + (f" {tensor_type}".encode() if tensor_type != "f32" else b""))
    for name in sorted(weights):
        h.update(name.encode() + b"\0" + np.ascontiguousarray(weights[name], np.float32).tobytes())
    out = (cache or CACHE) / f"{h.hexdigest()[:16]}.gguf"
    if out.is_file():
        return out
    if tensor_type == "f32":
        return write_judged(module, cfg, weights, out, f"model {module.GGUF_ARCH}", module.DEFAULT_CONTEXT)
    return write_judged(module, cfg, held_in(weights, tensor_type), out, f"model {module.GGUF_ARCH} ({tensor_type})",
                        module.DEFAULT_CONTEXT, tensor_type=tensor_type)


def folder_digest(folder: Path) -> str:
    """sha256 over config.json and the *.safetensors files (names and bytes): what the GGUF is written from."""
    h = hashlib.sha256()
    for path in [folder / "config.json", *sorted(folder.glob("*.safetensors"))]:
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def gguf_for(checkpoint: str | Path, cache: Path | None = None) -> Path:
    """A .gguf file as given, once testbed's reader accepts it (every metadata key read or inert, every
    tensor of the model's shape and of a type it dequantizes: load_gguf without reading the weights); a
    Hugging Face folder's GGUF, written once per content under `cache` (and judged as it was written)."""
    path = Path(checkpoint)
    if path.suffix == ".gguf" and path.is_file():
        load_gguf(path, weights=False)
        return path
    if not path.is_dir():
        raise UsageError(f"checkpoint {str(path)!r} is not accepted; accepted: a Hugging Face folder (config.json and "
                         f"*.safetensors) or an existing .gguf file")
    family(path)  # refuses a model_type testbed cannot write, before hashing the weights
    out = (cache or CACHE) / f"{folder_digest(path)[:16]}.gguf"
    return out if out.is_file() else write_gguf(path, out)
