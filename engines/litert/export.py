#!/usr/bin/env python3
"""LiteRT's generative export of a Hugging Face causal LM, as Google AI Edge ships it: litert-torch's export_hf.

    export.py HF_FOLDER OUT --chunk=C[,C...] [--cache-length=N]

litert-torch 0.10's `litert_torch.generative.export_hf.export` (what `python -m litert_torch.generative.export_hf`
runs) converts transformers' own model into one model.tflite with a `prefill_C` signature per chunk size C
(tokens[1, C], input_pos[C], a host-built causal mask[1, 1, C, N], every layer's K [1, kv_heads, N, head_dim] and
V [1, kv_heads, head_dim, N] in and out; the sliding window's band is built inside the graph from input_pos) and
a `decode` signature (the same for one token, with the logits). Float32 throughout (quantization_recipe none: the
export's default is dynamic int8 weights), not bundled as .litertlm (the runtime here is ai-edge-litert's
interpreter, which reads the .tflite).

Two workarounds, both for litert-torch 0.10 against the `hf` extra's transformers 5.x (checked on 5.25):
  - export_hf imports tensorflow (model_ext/bonsai_flux2: `from tensorflow.lite.python import
    schema_py_generated`), which litert-torch does not declare; that module is loaded here with the same
    flatbuffer schema module from ai_edge_litert (a dependency), and nothing else changes.
  - litert-torch patches transformers.integrations.use_kernel_forward_from_hub to return the function
    undecorated, after which transformers' Gemma 3 module fails to import whenever the `kernels` package (a
    transformers dependency) is installed ("apply_rotary_pos_emb is not decorated with
    @use_kernel_forward_from_hub"); so hub kernels are switched off for the export (USE_HUB_KERNELS=0, and the
    package hidden from transformers), which on CPU changes nothing transformers computes.

OUT receives model.tflite and manifest.json (written last, under a temporary name: an OUT without it is no
export). Exit 0 done; 2 bad
arguments; 3 a module missing (the `litert` extra); 4 the export failed: one line on stderr quoting the first
error.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path

EXTRA = "litert"
MODULES = ("torch", "transformers", "litert_torch", "ai_edge_litert")
DEFAULT_CACHE_LENGTH = 1024  # the seed's case (800 past + 52) with room for a padded chunk of 128
DECODE_ONLY_PREFILL = 16
TENSORFLOW_IMPORT = "from tensorflow.lite.python import schema_py_generated as schema_fb"
FLUX_MODULE = "litert_torch.generative.export_hf.model_ext.bonsai_flux2.bonsai_flux2"


def fail(code: int, message: str) -> None:
    print(f"export.py: {message}", file=sys.stderr)
    sys.exit(code)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def chunks(text: str) -> list[int]:
    try:
        sizes = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        sizes = []
    if not sizes or any(not 1 <= c <= 4096 for c in sizes):
        raise argparse.ArgumentTypeError(f"--chunk={text}; accepted: sizes 1..4096, comma-separated")
    return sizes


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="export.py", description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="Hugging Face folder (config.json, model.safetensors)")
    p.add_argument("out", type=Path, help="folder that receives model.tflite and manifest.json")
    p.add_argument("--chunk", type=chunks, required=True, help="prefill signature sizes, e.g. 64 or 16,32,64,128")
    p.add_argument("--cache-length", type=int, default=DEFAULT_CACHE_LENGTH,
                   help="rows of every layer's KV cache: the most positions a request may reach")
    args = p.parse_args(argv)  # a bad argument: argparse's one line, exit 2
    if not (args.model / "config.json").is_file():
        fail(2, f"{args.model} holds no config.json; accepted: a Hugging Face folder")
    if not max(args.chunk) < args.cache_length <= 1 << 16:
        fail(2, f"--cache-length={args.cache_length}; accepted: above the largest chunk ({max(args.chunk)}), "
                "at most 65536")
    return args


def require_modules() -> None:
    for name in MODULES:  # found, not imported: litert_torch may be imported only after the workarounds
        if importlib.util.find_spec(name) is None:
            fail(3, f"{name} is not installed; install the extra: pip install 'testbed[{EXTRA}]'")


def load_flux_module_without_tensorflow() -> None:
    """export_hf's one tensorflow import, served by ai_edge_litert's copy of the same schema module."""
    if importlib.util.find_spec("tensorflow") is not None:
        return
    spec = importlib.util.find_spec(FLUX_MODULE)
    source = Path(spec.origin).read_text()
    if source.count(TENSORFLOW_IMPORT) != 1:
        raise RuntimeError(f"{spec.origin} no longer imports tensorflow as litert-torch 0.10 did: check the workaround")
    module = importlib.util.module_from_spec(spec)
    sys.modules[FLUX_MODULE] = module
    code = compile(source.replace(TENSORFLOW_IMPORT, "from ai_edge_litert import schema_py_generated as schema_fb"),
                   spec.origin, "exec")
    exec(code, module.__dict__)  # noqa: S102 -- the installed module's own source, one import changed


def prefill_sizes(chunks: list[int]) -> list[int]:
    """The prefill signatures for the chunk sizes asked: C = 1 is the decode signature, which every export has;
    litert-torch always exports at least one prefill signature, so --chunk=1 alone gets one of DECODE_ONLY_PREFILL."""
    return [c for c in chunks if c > 1] or [DECODE_ONLY_PREFILL]


def export(model_dir: Path, out: Path, sizes: list[int], cache_length: int) -> dict:
    os.environ["USE_HUB_KERNELS"] = "0"
    sys.modules["kernels"] = None  # transformers then sees no hub kernels (see the module docstring)
    load_flux_module_without_tensorflow()
    from litert_torch.generative.export_hf import export as export_hf
    from ai_edge_litert.interpreter import Interpreter

    started = time.perf_counter()
    work = out.with_name(f".{out.name}.work{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    try:
        export_hf.export(model=str(model_dir), output_dir=str(work), prefill_lengths=sizes, cache_length=cache_length,
                         quantization_recipe="none", bundle_litert_lm=False, keep_temporary_files=True)
        tflite = work / "model.tflite"
        if not tflite.is_file():
            raise RuntimeError(f"litert-torch wrote no model.tflite (it wrote: {sorted(p.name for p in work.iterdir())})")
        signatures = Interpreter(model_path=str(tflite)).get_signature_list()
        want = {f"prefill_{c}" for c in sizes} | {"decode"}
        if not want <= set(signatures):
            raise RuntimeError(f"model.tflite's signatures are {sorted(signatures)}; expected {sorted(want)}")
        blob = tflite.read_bytes()
        config = json.loads((model_dir / "config.json").read_text())
        config = config.get("text_config", config)
        manifest = {
            "runtime": "litert", "artifact": "model.tflite", "artifact_sha256": hashlib.sha256(blob).hexdigest(),
            "artifact_bytes": len(blob), "prefill": {str(c): f"prefill_{c}" for c in sizes}, "decode": "decode",
            "signatures": {name: {"inputs": sorted(s["inputs"]), "outputs": sorted(s["outputs"])}
                           for name, s in sorted(signatures.items())},
            "cache_length": cache_length,
            "cache": {"dtype": "float32", "k": "kv_cache_k_L [1, kv_heads, cache_length, head_dim]",
                      "v": "kv_cache_v_L [1, kv_heads, head_dim, cache_length]"},
            "model": {"model_type": config.get("model_type"), "vocab": int(config["vocab_size"]),
                      "layers": int(config["num_hidden_layers"]), "kv_heads": int(config["num_key_value_heads"]),
                      "head_dim": int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]),
                      "sliding_window": config.get("sliding_window")},
            "weights": "f32", "quantization_recipe": "none",
            "versions": {name: metadata.version(name) for name in ("litert-torch", "ai-edge-litert", "torch",
                                                                     "transformers")},
            "workarounds": ["tensorflow import served by ai_edge_litert.schema_py_generated",
                            "hub kernels off (USE_HUB_KERNELS=0)"],
            "export_s": round(time.perf_counter() - started, 3),
        }
        out.mkdir(parents=True, exist_ok=True)
        tflite.rename(out / "model.tflite")
        (out / ".manifest.json.tmp").write_text(json.dumps(manifest, indent=1) + "\n")
        (out / ".manifest.json.tmp").rename(out / "manifest.json")  # last: the export is whole once it is there
        return manifest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str]) -> int:
    args = parse(argv)
    require_modules()
    try:
        manifest = export(args.model, args.out, prefill_sizes(args.chunk), args.cache_length)
    except Exception as e:  # noqa: BLE001 -- any failure of the exporter is one line, exit 4
        fail(4, f"LiteRT export of {args.model} failed: {first_line(e)}")
    print(f"export.py: {args.out / 'model.tflite'} ({manifest['artifact_bytes']} bytes, signatures "
          f"{', '.join(sorted(manifest['signatures']))}, {manifest['export_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
