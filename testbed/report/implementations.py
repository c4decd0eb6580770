"""What a figure or verdict is of: a device, a backend and a model, the three things a table or a plot
must never mix (issue 14, item 10). A chunk-size choice over refimpl's and native's calls together, or
one GDN shape listed once per backend with no backend named, answers no question anyone asked.

The backend is the record's config `backend` (what the run asked for; the record's own `backend`
where the config has none, e.g. an ingested tool run); for backend=engine, engine:NAME. The model is what the config says was run:
a seed's fixture, a checkpoint's file name, a named model, the synthetic preset (with its overrides),
the reference model's size (layers x hidden, window), or the shape of a GDN bench (heads x head size,
KDA gate or not); "any model" where a run names none (a transport test, a tool's op table).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

NO_MODEL = "any model"
OVERRIDES = "model.overrides."  # GemmaConfig fields over the preset, one dotted key each


@dataclass(frozen=True, order=True)
class Implementation:
    device: str
    backend: str
    model: str

    @property
    def label(self) -> str:
        return f"{self.device} / {self.backend} / {self.model}"


def model_of(config: dict) -> str:
    if config.get("mode") == "fixture":  # a seed's measured figures loaded as records: the seed's model
        return f"seed {PurePath(str(config['fixture'])).stem}"
    if config.get("model.checkpoint"):
        return PurePath(str(config["model.checkpoint"])).name
    if config.get("model.name"):
        return str(config["model.name"])
    if config.get("model.preset"):
        overrides = sorted((k.removeprefix(OVERRIDES), v) for k, v in config.items() if k.startswith(OVERRIDES))
        return str(config["model.preset"]) + "".join(f" {k}={v}" for k, v in overrides)
    if config.get("shape.layers") is not None:  # a reference model (tail, hybrid), by its size
        size = f"{config['shape.layers']} layers x {config.get('shape.hidden', '?')}"
        # the tail experiment's model has a sliding window; the hybrid's has none (its attention is global)
        return size + (f", window {config['shape.window']}" if config.get("shape.window") is not None else "")
    if config.get("bench.heads") is not None and config.get("bench.head_size") is not None:
        gate = " KDA" if config.get("bench.kda") else ""
        return f"{config['bench.heads']} heads x {config['bench.head_size']}{gate}"
    return NO_MODEL


def of(record: dict) -> Implementation:
    config = record.get("config") or {}
    backend = str(config.get("backend") or record["backend"])
    if backend == "engine":  # an engine under test is its own implementation: engine:NAME
        backend = f"engine:{config.get('engine')}"
    return Implementation(str(record["device"]), backend, model_of(config))
