"""The model an engine under test is handed, in a format its yaml accepts (supports.model_formats):

  safetensors  testbed's engine file (testbed.backends.native.engine.export_weights): the weights at the run's
               dtype (f32, f16 or int8 rows), the shape in request.json's model.config
  gguf         the run's own .gguf, or testbed's GGUF of the model (testbed.models.gguf_files.gguf_of), as
               llama.cpp's converter writes it
  hf           a Hugging Face folder (config.json, model.safetensors, and the tokenizer where the run's
               checkpoint has one): the run's own folder, or testbed's of the model
               (testbed.models.checkpoints.hf_folder_of), the input of an exporter (ExecuTorch, ONNX
               Runtime, LiteRT)

Which one: the run's own checkpoint as it is where the engine reads that format (the engine judged on what
the user gave it); otherwise the first of safetensors, gguf, hf the engine reads. Each engine is handed its
own, so two engines of different formats serve the same model (`testbed ab engine:A engine:B`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from refimpl import gemma
from testbed.backends.engine.spec import EngineSpec
from testbed.backends.native.engine import export_weights
from testbed.errors import UsageError
from testbed.models.checkpoints import hf_folder_of
from testbed.models.gguf_files import gguf_of

PREFERENCE = ("safetensors", "gguf", "hf")


def checkpoint_format(checkpoint: str | None) -> str | None:
    """The format of a run's checkpoint: gguf for a .gguf file, hf for a folder holding config.json."""
    if not checkpoint:
        return None
    path = Path(checkpoint)
    if path.suffix == ".gguf" and path.is_file():
        return "gguf"
    return "hf" if (path / "config.json").is_file() else None


@dataclass(frozen=True)
class GemmaModel:
    """A Gemma-like model as a run holds it: its config and float32 weights, the weights dtype the engine file
    stores, and the checkpoint it came from (None for a seeded preset)."""

    cfg: gemma.GemmaConfig
    w: dict
    weights: str = "f32"
    group: int = 32
    checkpoint: str | None = None

    def file_for(self, spec: EngineSpec) -> tuple[Path, str]:
        """(path, format) of this model as `spec`'s engine reads it."""
        given = checkpoint_format(self.checkpoint)
        if given in spec.model_formats:
            return Path(self.checkpoint).resolve(), given
        fmt = next((f for f in PREFERENCE if f in spec.model_formats), None)
        if fmt == "safetensors":
            return export_weights(self.cfg, self.w, self.weights, self.group), fmt
        if self.weights != "f32":  # GGUF and HF folders are written in float32 here
            raise UsageError(f"native.weights={self.weights}: engine={spec.name} reads {', '.join(spec.model_formats)}, "
                             f"which testbed writes in f32 only; accepted: native.weights=f32")
        if fmt == "gguf":
            return gguf_of(self.cfg, self.w), fmt
        if fmt == "hf":
            return hf_folder_of(self.cfg, self.w), fmt
        raise UsageError(f"engine={spec.name} reads {', '.join(spec.model_formats)} ({spec.path}: "
                         f"supports.model_formats); accepted: {', '.join(PREFERENCE)}")
