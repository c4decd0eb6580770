"""llama.cpp's own view of a model: its converter writes the GGUF, libllama computes the logits.

Two references agree with each other more easily than three: transformers defines a checkpoint,
refimpl computes it from testbed's loaders, and llama.cpp reads the GGUF its own converter wrote,
with its own loader and graph. `convert` runs the source tree's convert_hf_to_gguf.py (with the tree's
own gguf-py, as llama.cpp's users run it), so a layout the converter changes (Gemma's norm weights
stored as 1 + w, tensor names, a vocabulary trimmed to the tokenizer's size) reaches testbed's loader
as it reaches a phone. `logits` runs tb_llama_logits (built by testbed.backends.llamacpp.build) on a
device and returns llama.cpp's logits for every position.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from testbed import children
from testbed.backends.llamacpp.build import Built, BuildError
from testbed.backends.native.device import NativeJob, run_native, stage_program
from testbed.devices import Device
from testbed.errors import UsageError

OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def convert(tree: Path, hf_folder: Path, out: Path, outtype: str = "f32") -> Path:
    """`hf_folder` (config.json, safetensors, tokenizer) converted to a GGUF at `out` by the llama.cpp
    tree's convert_hf_to_gguf.py. The file appears whole or not at all."""
    if outtype not in OUTTYPES:
        raise UsageError(f"outtype={outtype!r} is not accepted; accepted: {', '.join(OUTTYPES)}")
    script = tree / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise UsageError(f"{tree} has no convert_hf_to_gguf.py; accepted: a llama.cpp tree")
    if not (hf_folder / "config.json").is_file():
        raise UsageError(f"{hf_folder} has no config.json; accepted: a Hugging Face model folder")
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the tree's gguf-py, not the installed one
    env["HF_HUB_OFFLINE"] = "1"
    p = children.run([sys.executable, str(script), str(hf_folder), "--outfile", str(tmp), "--outtype", outtype],
                     capture_output=True, text=True, env=env)
    if p.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:])
        raise BuildError(f"llama.cpp's converter failed on {hf_folder} (exit {p.returncode}): {tail}")
    tmp.rename(out)
    return out


def logits(device: Device, built: Built, gguf: Path, tokens: np.ndarray, threads: int = 1) -> tuple[np.ndarray, dict]:
    """llama.cpp's logits [T, vocab] for `tokens` on `device`, and the run's evidence."""
    model = stage_program(device, gguf)  # pushed once per content, like a program
    result = run_native(device, NativeJob(built.program("tb_llama_logits"), {"tokens": np.asarray(tokens, np.int32)},
                                          ["logits"], ["{inputs}", ".", f"model=../../{model}", f"threads={threads}"],
                                          measured=False))
    return result.outputs["logits"], result.evidence.as_dict()
