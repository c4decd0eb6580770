#!/usr/bin/env python3
"""ONNX export of a Hugging Face causal LM with past key/values, for engines/onnxruntime (adapter.py).

    python3 export.py MODEL_FOLDER OUT_FOLDER

Run on the host by testbed (testbed.backends.engine.export), once per content. The graph:

  inputs   input_ids [1, C] int64, position_ids [1, C] int64, logits_rows [R] int64 (the rows of the call
           whose logits are wanted, as seed 000's select vector picks one), and per layer L
           past.L.key / past.L.value [1, kv_heads, P, head_dim] float32
  outputs  logits [1, R, vocab], present.L.key / present.L.value [1, kv_heads, P + C, head_dim]

C, P and R are dynamic (one graph serves every chunk size, the one-row decode step and P = 0). The
model's own masks are in the graph: causal within the call, the sliding window of its local layers over
the past and the call; the past is every earlier row (the adapter keeps them and may drop rows, e.g. a
padded call's pad rows, by slicing present).

How: torch.onnx.export (torch 2.13's dynamo exporter, onnxscript) of transformers' own model, wrapped so
the cache is plain tensors: DynamicCache(ddp_cache_data=...) without a config holds every layer's rows
(no eviction), and cache_position follows P. Why not optimum-onnx: 0.1.0 pins transformers < 4.58 (this
project runs transformers 5); onnxruntime-genai's model builder writes its own graph (GroupQueryAttention)
from the weights, not transformers' model, and needs ORT GenAI's runtime for its KV-cache handling. The
export is checked before it is kept: the ONNX graph on onnxruntime against the same torch module on one
call with past (max |logit diff| in export.json), so a graph that exported wrong never reaches a device.

Writes OUT/model.onnx (+ model.onnx.data, the weights) and OUT/export.json (names, shape, layer types,
window, versions, the check). A model it cannot export (another architecture) is written as
OUT/refused.json {"reason": ...}: the adapter then refuses in those words ("not supported").
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from pathlib import Path

SUPPORTED = {"gemma3_text": "Gemma3ForCausalLM"}


def refuse(out: Path, reason: str) -> int:
    (out / "refused.json").write_text(json.dumps({"reason": reason}) + "\n")
    print(f"export.py: not exported: {reason}", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: export.py MODEL_FOLDER OUT_FOLDER", file=sys.stderr)
        return 2
    folder, out = Path(argv[1]), Path(argv[2])
    config = json.loads((folder / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        return refuse(out, f"model_type {model_type!r} is not exported by engines/onnxruntime/export.py; "
                           f"accepted: {', '.join(SUPPORTED)} (text-only; the Qwen3.5 hybrid's recurrent state "
                           "is not an input of this graph)")
    import numpy as np
    import onnxruntime
    import torch
    import transformers
    from transformers import DynamicCache

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    text = model.config.get_text_config()
    layers, kv_heads, head_dim = text.num_hidden_layers, text.num_key_value_heads, text.head_dim

    class WithPast(torch.nn.Module):
        """transformers' model with its cache as plain tensors in and out."""

        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, position_ids, logits_rows, past):
            cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(layers)])
            cache_position = torch.arange(input_ids.shape[1]) + past[0].shape[2]
            o = self.lm(input_ids=input_ids, position_ids=position_ids, **{cache_arg: cache},
                        cache_position=cache_position, use_cache=True, logits_to_keep=logits_rows)
            present = []
            for layer in o.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (o.logits, *present)

    # transformers 5.x renamed past_key_values to cache (the old name warns, and goes in 5.40)
    cache_arg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    module = WithPast(model)
    names = [f"past.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    outputs = ["logits"] + [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    P, C = 5, 3  # the example call: sizes that are not 0 or 1, so the exporter keeps them dynamic
    example = (torch.randint(0, text.vocab_size, (1, C)), torch.arange(P, P + C)[None], torch.tensor([0, C - 1]),
               [torch.randn(1, kv_heads, P, head_dim) for _ in names])
    past, chunk, rows = (torch.export.Dim("past", min=0, max=1 << 17), torch.export.Dim("chunk", min=1, max=1 << 14),
                         torch.export.Dim("rows", min=1, max=1 << 14))
    began = time.monotonic()
    torch.onnx.export(module, example, str(out / "model.onnx"), dynamo=True, external_data=True,
                      input_names=["input_ids", "position_ids", "logits_rows", *names], output_names=outputs,
                      dynamic_shapes={"input_ids": {1: chunk}, "position_ids": {1: chunk}, "logits_rows": {0: rows},
                                      "past": [{2: past}] * len(names)})
    seconds = time.monotonic() - began
    # the graph on onnxruntime against the module it came from, on a call unlike the example (another P, C, R)
    P, C = 7, 4
    check = (torch.randint(0, text.vocab_size, (1, C)), torch.arange(P, P + C)[None], torch.tensor([C - 1]),
             [torch.randn(1, kv_heads, P, head_dim) for _ in names])
    with torch.no_grad():
        want = [t.numpy() for t in module(*check)]
    session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input_ids": check[0].numpy(), "position_ids": check[1].numpy(),
                             "logits_rows": check[2].numpy(), **{n: t.numpy() for n, t in zip(names, check[3])}})
    diff = max(float(np.abs(a - b).max()) for a, b in zip(got, want))
    if not diff < 1e-3:
        print(f"export.py: error: the ONNX graph differs from the torch module by {diff:.3g} on onnxruntime",
              file=sys.stderr)
        return 1
    window = getattr(text, "sliding_window", None)
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * layers)
    (out / "export.json").write_text(json.dumps({
        "format": "onnx", "graph": "causal_lm_with_past", "model_type": model_type, "file": "model.onnx",
        "inputs": ["input_ids", "position_ids", "logits_rows", *names], "outputs": outputs,
        "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "vocab": text.vocab_size,
        "layer_types": types, "sliding_window": window, "dtype": "float32",
        "exporter": "torch.onnx.export (dynamo)", "export_seconds": round(seconds, 2),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "onnxruntime": onnxruntime.__version__},
        "check": {"past": P, "chunk": C, "max_abs_diff": diff},
    }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
