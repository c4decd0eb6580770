"""Experiments: each module here is one experiment, named like its config experiments/experiment/NAME.yaml.

An experiment module provides:
  PARAMS                  {dotted key: rule} checked before anything runs (testbed.config rules)
  run(cfg, ctx)           yields Records (testbed.results.Record)
  view(frame) -> frame    the table people read, from stored records only
  sweep_row(frame) -> {}  one summary row per sweep job (optional; defaults to view's first row)
  summary(frame) -> [frames]  what `testbed run` prints (optional; defaults to [view(frame)])
  validate(cfg)           cross-parameter checks (optional), raising UsageError
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from testbed.devices import Device
from testbed.errors import UsageError


def load(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"testbed.experiments.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"testbed.experiments.{name}":
            raise UsageError(f"experiment {name!r} has a config but no module testbed/experiments/{name}.py") from None
        raise


@dataclass
class Context:
    """What a running experiment may use besides its config."""

    device: Device
    progress: Callable[[str], None] = field(default=lambda msg: None)
    extra: dict[str, Any] = field(default_factory=dict)
