#!/usr/bin/env python3
"""ExecuTorch's export of a Hugging Face causal LM, as a lab ships it: XNNPACK delegate, static KV cache.

    export.py HF_FOLDER OUT [--max-positions=N]

The model is transformers' own (AutoModelForCausalLM from the folder, float32, SDPA attention), wrapped by
transformers' ExecuTorch recipe (transformers.integrations.executorch: a static cache of N positions per
layer held as mutable buffers; Gemma 3's sliding layers keep all N rows and the sliding-window mask hides
what the window dropped), exported with torch.export (strict) with the token count a dynamic dimension of
1..N-1, and lowered by executorch's own to_edge_transform_and_lower with the XnnpackPartitioner. One method,
`forward(input_ids[1, rows], cache_position[rows]) -> logits[1, rows, vocab]`, serves a chunk of any C rows
with past and a one-token decode alike, as ExecuTorch's LLM runners call it; the cache buffers are emitted
by name so the runtime can read them (Method.get_attribute).

OUT receives model.pte and manifest.json (what was exported, with which versions, how much of the graph
XNNPACK took, how long it took); both are written under temporary names and renamed last, so a failed
export leaves neither. Exit 0 done; 2 bad arguments or a folder that is no causal LM; 3 a module missing
(the `executorch` extra); 4 the export or lowering failed: one line on stderr quoting the first error.
(optimum-executorch 1.1 would do the same wrapping, but it pins transformers==5.0.0rc1; testbed's `hf`
extra has transformers 5.x, so this calls the recipe and executorch's lowering directly.)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys
import time
from importlib import metadata
from pathlib import Path

EXTRA = "executorch"
MODULES = ("torch", "transformers", "executorch")
DEFAULT_MAX_POSITIONS = 1024  # the seed's case (800 past + 52) with room for a padded tail of 128


def fail(code: int, message: str) -> None:
    print(f"export.py: {message}", file=sys.stderr)
    sys.exit(code)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="export.py", description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="Hugging Face folder (config.json, model.safetensors)")
    p.add_argument("out", type=Path, help="folder that receives model.pte and manifest.json")
    p.add_argument("--max-positions", type=int, default=DEFAULT_MAX_POSITIONS,
                   help="rows of the static KV cache: the most positions a request may reach")
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        fail(2, f"{args.model} holds no config.json; accepted: a Hugging Face folder")
    if not 2 <= args.max_positions <= 1 << 16:
        fail(2, f"--max-positions={args.max_positions}; accepted: 2..65536")
    return args


def require_modules() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            fail(3, f"{name} is not installed ({e}); install the extra: pip install 'testbed[{EXTRA}]'")


def delegation(program) -> dict:
    """How much of the lowered graph XNNPACK took: its delegate calls, and the ops left to the portable kernels."""
    delegated, portable = 0, {}
    for node in program.exported_program().graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if "executorch_call_delegate" in name:
            delegated += 1
        elif not name.startswith("getitem"):
            portable[name] = portable.get(name, 0) + 1
    return {"xnnpack_partitions": delegated, "portable_ops": dict(sorted(portable.items()))}


def export(model_dir: Path, out: Path, max_positions: int) -> dict:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower

    torch.set_grad_enabled(False)
    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_positions).model
    rows = torch.export.Dim("rows", min=1, max=max_positions - 1)
    example = {"input_ids": torch.zeros((1, 4), dtype=torch.long), "cache_position": torch.arange(4)}
    exported = torch.export.export(recipe, args=(), kwargs=example,
                                   dynamic_shapes={"input_ids": {1: rows}, "cache_position": {0: rows}}, strict=True)
    exported_s = time.perf_counter() - started
    lowered = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()],
                                          compile_config=EdgeCompileConfig(_check_ir_validity=False))
    program = lowered.to_executorch(ExecutorchBackendConfig(emit_mutable_buffer_names=True))
    blob = program.buffer
    buffers = [s.target for s in program.exported_program().graph_signature.input_specs
               if s.kind.name == "BUFFER" and s.target.startswith(("key_cache_", "value_cache_"))]
    layers = int(config.num_hidden_layers)
    if sorted(buffers) != sorted([f"key_cache_{i}" for i in range(layers)] + [f"value_cache_{i}" for i in range(layers)]):
        raise RuntimeError(f"the recipe's cache buffers are {sorted(buffers)}, not key_cache_L / value_cache_L for "
                           f"{layers} layers")
    manifest = {
        "runtime": "executorch", "artifact": "model.pte", "artifact_sha256": hashlib.sha256(blob).hexdigest(),
        "artifact_bytes": len(blob), "method": "forward", "inputs": ["input_ids[1, rows] int64", "cache_position[rows] int64"],
        "outputs": ["logits[1, rows, vocab] float32"], "rows": [1, max_positions - 1], "max_positions": max_positions,
        "cache": {"dtype": "float32", "buffers": "key_cache_L, value_cache_L [1, kv_heads, max_positions, head_dim]",
                  "keeps_all_rows": True},
        "model": {"model_type": config.model_type, "vocab": int(config.vocab_size), "layers": layers,
                  "kv_heads": int(config.num_key_value_heads),
                  "head_dim": int(getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)),
                  "sliding_window": getattr(config, "sliding_window", None),
                  "layer_types": list(getattr(config, "layer_types", None) or [])},
        "weights": "f32", "delegate": "XnnpackPartitioner", **delegation(program),
        "versions": {name: metadata.version(name) for name in ("executorch", "torch", "transformers")},
        "export_s": {"torch_export": round(exported_s, 3), "total": round(time.perf_counter() - started, 3)},
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, data in (("model.pte", blob), ("manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())):
        tmp = out / f".{name}.tmp{os.getpid()}"
        tmp.write_bytes(data)
        tmp.rename(out / name)
    return manifest


def main(argv: list[str]) -> int:
    args = parse(argv)
    require_modules()
    try:
        manifest = export(args.model, args.out, args.max_positions)
    except Exception as e:  # noqa: BLE001 -- any failure of the exporter is one line, exit 4
        fail(4, f"ExecuTorch export of {args.model} failed: {first_line(e)}")
    print(f"export.py: {args.out / 'model.pte'} ({manifest['artifact_bytes']} bytes, "
          f"{manifest['xnnpack_partitions']} XNNPACK partition(s), {manifest['export_s']['total']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
