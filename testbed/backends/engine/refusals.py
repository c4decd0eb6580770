"""A request an engine's own yaml says it does not serve: a technique it does not list, a device whose ABI
it is not built for, a weights or cache dtype it does not take. Such a run is not bad input (the command
is right; the engine declined) and not a device failure: its oracles are recorded "not supported" with
the yaml's words (which key lists what), before anything is built or pushed, so a lab's CI reads a refusal
as a refusal (testbed.verdicts: never a failure, never a pass).

  why_not(spec, device, technique, weights=, cache=)   the reason, or None
  records(experiment, judged, why)                      one "not supported" record per (case, oracle)
"""

from __future__ import annotations

from typing import Iterable, Iterator

from testbed.backends.engine.spec import EngineSpec
from testbed.backends.native.build import target_for_abi
from testbed.devices import Device
from testbed.results import Record
from testbed.verdicts import NOT_SUPPORTED


def why_not(spec: EngineSpec, device: Device, technique: str, weights: str | None = None,
            cache: str | None = None) -> str | None:
    """Why `spec`'s engine does not serve `technique` on `device` (with these dtypes), in its yaml's words."""
    target = target_for_abi(device.profile.abi)
    why = spec.refusal(technique, target, weights, cache)
    if why and target not in spec.abis and technique in spec.techniques:
        why += f"; device {device.name} runs {target} programs"
    return why


def records(experiment: str, judged: Iterable[tuple[str, str]], why: str, params: dict | None = None) \
        -> Iterator[Record]:
    """One "not supported" record per (case, oracle) the run would have judged, each saying why."""
    for case, oracle in judged:
        yield Record(experiment, case, "oracle", oracle, NOT_SUPPORTED, None, {}, params=dict(params or {}),
                     detail=why)
