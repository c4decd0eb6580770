#!/usr/bin/env python3
"""MNN behind engine contract v1: a recorded finding, not an engine yet (engines/README.md, "MNN").

    adapter.py REQUEST_DIR RESPONSE_DIR

MNN's runtime can serve chunk prefill with past (mnn 3.6.1's MNN.llm.Llm.forward keeps its KV cache across
calls of any row count and returns the last row's logits), but the model it runs comes from MNN's exporter,
llmexport 0.0.5, and what that exporter writes for Gemma 3 does not compute Gemma 3: its logits are the same
whatever RoPE the checkpoint's config states (local base 100 and global 5000 with linear scaling x4, or
Gemma 3's defaults 10000 and 1e6; transformers 5's rope_parameters or transformers 4's rope_theta /
rope_local_base_freq / rope_scaling), and differ from transformers' (NMSE 0.0147 with the default bases,
0.65 with the tests', another argmax). Its weights are also never float32 (1, 2, 4, 8 bits or float16: float32
fails `assert(quant_bit in (1, 2, 4, 8))` in llmexport/utils/mnn_converter.py). An adapter over it would be
judged on what the exporter lost, so every request is refused with that reason: "not supported", never a
pass. tests/test_mnn_finding.py keeps the finding true (opt-in: it runs the exporter).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CONTRACT = 1
REASON = ("MNN's exporter (llmexport 0.0.5 for mnn 3.6.1) writes a Gemma 3 whose logits ignore the config's RoPE "
          "bases and scaling (NMSE 0.0147 against transformers with Gemma 3's default bases), and no float32 weights "
          "(1, 2, 4, 8 bits or float16): nothing it exports can be judged; see engines/README.md, MNN")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("mnn adapter: usage: adapter.py REQUEST_DIR RESPONSE_DIR (engine contract v1)", file=sys.stderr)
        return 2
    try:
        request = json.loads((Path(argv[0]) / "request.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"mnn adapter: {argv[0]}/request.json is not readable JSON: {e}", file=sys.stderr)
        return 2
    if not isinstance(request, dict) or request.get("contract") != CONTRACT:
        print(f"mnn adapter: request.json is not contract {CONTRACT}", file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "timings.json").write_text(json.dumps({"contract": CONTRACT, "calls": [], "engine": {"name": "mnn"}}) + "\n")
    (out / "status.json").write_text(json.dumps({"contract": CONTRACT, "status": "refused", "reason": REASON}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
