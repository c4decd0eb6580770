"""Experiments: each module here is one experiment, named like its config experiments/experiment/NAME.yaml.
Other packages add theirs through the entry point group testbed.experiments (see testbed.config).

An experiment module provides:
  PARAMS                  {dotted key: rule} checked before anything runs (testbed.config rules)
  run(cfg, ctx)           yields Records (testbed.results.Record)
  view(frame) -> frame    the table people read, from stored records only
  sweep_row(frame) -> {}  one summary row per sweep job (optional; defaults to view's first row); its
                          `samples` entry (repetitions, for the footer's decisions) is never printed
  sweep_footer(rows, jobs) -> str  what a sweep prints below its table: the decisions over its jobs,
                          each with its confidence (testbed.measure.decisions) (optional)
  summary(frame) -> [frames]  what `testbed run` prints (optional; defaults to [view(frame)])
  breakevens(frame) -> [{}]   the breakevens over stored rows, each with its interval: lines under the
                          table, a `breakevens` list in its JSON (optional)
  table_choices(frame) -> [{}]  the choices over stored rows (a best chunk size, chunked against token
                          by token: decisions.as_choice), a `choices` list in `testbed table`'s JSON
                          (optional)
  more_tables(frame) -> {name: frame}  tables drawn over a set of runs beside view's: printed under a sweep,
                          by `testbed table` (an object of their own in JSON) and in the report (optional;
                          chunk_prefill's engines table)
  validate(cfg)           cross-parameter checks (optional), raising UsageError
  SWEEP_TOGETHER          keys a sweep measures interleaved in one job, not one job per value (optional)
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from testbed.devices import Device
from testbed.errors import UsageError


def load(name: str) -> ModuleType:
    """The experiment's module: testbed's own, or another package's (entry point group testbed.experiments)."""
    from testbed.config import ENTRY_POINTS

    packaged = {e.name: e.value for e in importlib.metadata.entry_points(group=ENTRY_POINTS)}
    module = packaged.get(name, f"testbed.experiments.{name}")
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 -- another package's module may fail to import in any way
        if name not in packaged:
            raise  # testbed's own module: a bug, with its traceback
        # a stale or half-installed package: one line naming its entry point, the other experiments still run
        raise UsageError(f"experiment {name!r}: entry point {ENTRY_POINTS} {name} = {module} does not import "
                         f"({type(e).__name__}: {e}); reinstall or uninstall the package that declares it") from None


@dataclass
class Context:
    """What a running experiment may use besides its config."""

    device: Device
    progress: Callable[[str], None] = field(default=lambda msg: None)
    extra: dict[str, Any] = field(default_factory=dict)


def sweep_together(names: list[str]) -> list[str]:
    """The keys these experiments measure interleaved in one job rather than one job per value
    (a module's SWEEP_TOGETHER, e.g. tail's tail lengths): testbed.config.expand_sweep's `together`."""
    return [key for name in names for key in getattr(load(name), "SWEEP_TOGETHER", ())]
