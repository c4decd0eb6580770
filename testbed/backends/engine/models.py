"""The model an engine under test is handed, in a format its yaml accepts (supports.model_formats):

  safetensors  testbed's engine file: Gemma (testbed.backends.native.engine.export_weights) at the run's
               weights dtype (f32, f16 or int8 rows), or the hybrid (testbed.backends.native.hybrid.export_weights,
               float32, Hugging Face's names); the shape in request.json's model.config
  gguf         a GGUF as llama.cpp's converter writes it: the one the run gives (model.gguf, or
               model.checkpoint=FILE.gguf), else testbed's of the model (testbed.models.gguf_files), judged
               to read back as the model before it is handed over
  hf           a Hugging Face folder (config.json, model.safetensors, and the tokenizer where the run's
               checkpoint has one): the run's own folder, or testbed's of a seeded Gemma
               (testbed.models.checkpoints.hf_folder_of), the input of an exporter (ExecuTorch, ONNX
               Runtime, LiteRT)

Which one: a file the run gives, as it is, in the first format of the engine's own list it was given in
(the engine judged on what the user gave it); otherwise testbed writes the first of safetensors, gguf, hf
the engine reads. Each engine is handed its own, so two engines of different formats serve the same model
(`testbed ab engine:A engine:B`). What the engine is handed never makes the reference: that is the run's
model as testbed read it from the folder (or the seed), so a file that loses a field fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from testbed.backends.engine.spec import EngineSpec
from testbed.errors import UsageError

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
class Model:
    """A model as a run holds it: its config and float32 weights, the checkpoint it came from (a Hugging Face
    folder or a .gguf file; None for a seeded model) and a GGUF given for the engines that read GGUF."""

    cfg: object
    w: dict
    checkpoint: str | None = None
    gguf: str | None = None

    def given(self) -> dict[str, Path]:
        """The files the run gives, by format."""
        files = {}
        if (fmt := checkpoint_format(self.checkpoint)) is not None:
            files[fmt] = Path(self.checkpoint).resolve()
        if self.gguf:
            files["gguf"] = Path(self.gguf).resolve()
        return files

    def file_for(self, spec: EngineSpec) -> tuple[Path, str]:
        """(path, format) of this model as `spec`'s engine reads it."""
        given = self.given()
        fmt = next((f for f in spec.model_formats if f in given), None)
        if fmt is not None:
            return given[fmt], fmt
        fmt = next((f for f in PREFERENCE if f in spec.model_formats), None)
        if fmt is None:
            raise UsageError(f"engine={spec.name} reads {', '.join(spec.model_formats)} ({spec.path}: "
                             f"supports.model_formats); accepted: {', '.join(PREFERENCE)}")
        return self.write(fmt, spec), fmt

    def folder(self) -> Path | None:
        return Path(self.checkpoint) if checkpoint_format(self.checkpoint) == "hf" else None

    def write(self, fmt: str, spec: EngineSpec) -> Path:
        raise NotImplementedError


@dataclass(frozen=True)
class GemmaModel(Model):
    """A Gemma-like model; `weights` is the dtype the safetensors engine file stores (f32, f16, int8 rows)."""

    weights: str = "f32"
    group: int = 32

    def write(self, fmt: str, spec: EngineSpec) -> Path:
        from testbed.backends.native.engine import export_weights
        from testbed.models.checkpoints import hf_folder_of
        from testbed.models.gguf_files import gguf_of

        if fmt == "safetensors":
            return export_weights(self.cfg, self.w, self.weights, self.group)
        if self.weights != "f32":  # GGUF and HF folders are written in float32 here
            raise UsageError(f"native.weights={self.weights}: engine={spec.name} reads {', '.join(spec.model_formats)}, "
                             f"which testbed writes in f32 only; accepted: native.weights=f32")
        return gguf_of(self.cfg, self.w) if fmt == "gguf" else hf_folder_of(self.cfg, self.w)


@dataclass(frozen=True)
class HybridModel(Model):
    """The Qwen3.5-style hybrid (refimpl.qwen35), float32."""

    def write(self, fmt: str, spec: EngineSpec) -> Path:
        from testbed.backends.native.hybrid import export_weights
        from testbed.models.gguf_files import gguf_for, gguf_of
        from testbed.models.hybrid_checkpoints import hf_folder_of

        if fmt == "safetensors":
            return export_weights(self.cfg, self.w)
        if fmt == "gguf":
            return gguf_for(self.folder()) if self.folder() else gguf_of(self.cfg, self.w)
        return hf_folder_of(self.cfg, self.w)  # a seeded hybrid as transformers' Qwen3_5ForCausalLM loads it
