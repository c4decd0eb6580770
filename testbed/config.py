"""Configuration: Hydra composition of experiments/, devices/ and models, and parameter checks.

The primary config is experiments/config.yaml. Config groups:
  experiment  experiments/experiment/NAME.yaml  (package _global_: `chunk=32` overrides a top-level key)
  model       experiments/model/NAME.yaml
  device      devices/NAME.yaml                 (registered from devices/ so profiles live in one place)

A lab keeps its own devices, experiments and suites outside the project: TESTBED_LAB=DIR names a
folder with any of devices/, experiment/, model/ and suite/, searched after the project's own (a name
the project has is the project's). Ray workers and subprocesses see it because it is an environment
variable, not a setting of one process. Other packages add experiments through the entry point group
`testbed.experiments`: `NAME = package.module`, the experiment's module, with its config NAME.yaml
beside it.

Every problem a user can cause is raised as a UsageError with one line naming the bad value and what
is accepted, before any work is done or anything is written.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import RangeSweep, ValueType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from testbed import CONFIG_ROOT, PROJECT_ROOT
from testbed.errors import UsageError

CONFIG_DIR = CONFIG_ROOT / "experiments"
DEVICES_DIR = CONFIG_ROOT / "devices"
GROUPS = {"experiment": CONFIG_DIR / "experiment", "model": CONFIG_DIR / "model", "device": DEVICES_DIR}
SUITE_DIR = CONFIG_DIR / "suite"
LAB_ENV = "TESTBED_LAB"
LAB_FOLDERS = {"experiment": "experiment", "model": "model", "device": "devices", "suite": "suite"}
ENTRY_POINTS = "testbed.experiments"


# `${default_backend:${oc.select:device.capabilities,[]},[refimpl,native]}` in an experiment config:
# the first backend of testbed.backends.PREFERENCE that the device's profile lists and the experiment
# accepts (the host: refimpl; an ARM board: native; lavapipe: iree; seed 002's phones: llamacpp).
def _default_backend(capabilities, accepted):
    from testbed.backends import default_for

    return default_for(list(capabilities), list(accepted))


OmegaConf.register_new_resolver("default_backend", _default_backend, replace=True)


def lab_dir() -> Path | None:
    """The lab's own folder (TESTBED_LAB), or None."""
    value = os.environ.get(LAB_ENV)
    if not value:
        return None
    lab = Path(value).expanduser()
    if not lab.is_dir():
        raise UsageError(f"{LAB_ENV}={value!r} is not a folder; accepted: a folder with any of "
                         f"{', '.join(f + '/' for f in LAB_FOLDERS.values())}")
    return lab


def group_dirs(group: str) -> list[Path]:
    """Where a group's YAML files are looked for, first match wins: the project's folder, the lab's."""
    own = SUITE_DIR if group == "suite" else GROUPS[group]
    lab = lab_dir()
    return [own] + ([lab / LAB_FOLDERS[group]] if lab else [])


def packaged_experiments() -> dict[str, Path]:
    """Experiments other packages provide (entry point group testbed.experiments): name -> its config."""
    found = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINTS):
        spec = importlib.util.find_spec(entry.value)
        config = Path(spec.origin).parent / f"{entry.name}.yaml" if spec and spec.origin else None
        if config is None or not config.is_file():
            raise UsageError(f"entry point {ENTRY_POINTS} {entry.name} = {entry.value}: no config {entry.name}.yaml "
                             f"beside the module; accepted: a module with its NAME.yaml in the same folder")
        found[entry.name] = config
    return found


def choices(group: str) -> list[str]:
    """The names a config group accepts: its YAML files (and, for experiments, other packages')."""
    names = {p.stem for folder in group_dirs(group) for p in folder.glob("*.yaml")}
    return sorted(names | set(packaged_experiments()) if group == "experiment" else names)


def group_file(group: str, name: str) -> Path:
    """The YAML file of `name` in `group`; a UsageError naming what is accepted if there is none."""
    for folder in group_dirs(group):
        if (folder / f"{name}.yaml").is_file():
            return folder / f"{name}.yaml"
    raise UsageError(f"unknown {group} {name!r}; accepted: {', '.join(choices(group))}")


def _register() -> None:
    """Give Hydra the configs that are not in its search path: device profiles (kept in devices/ so
    profiles live in one place) and other packages' experiments."""
    store = ConfigStore.instance()
    for name in choices("device"):
        store.store(group="device", name=name, node=OmegaConf.load(group_file("device", name)), package="device")
    for name, path in packaged_experiments().items():
        store.store(group="experiment", name=name, node=OmegaConf.load(path), package="_global_")


def _search_path() -> list[str]:
    """The lab's folder as a Hydra search path override (its experiment/ and model/ groups)."""
    lab = lab_dir()
    return [f"hydra.searchpath=[file://{lab.resolve()}]"] if lab else []


def split_farm(overrides: Iterable[str]) -> tuple[str | None, list[str]]:
    """farm=HEAD:PORT (run on a lab's Ray cluster: testbed.farm) apart from the configuration's overrides."""
    overrides = list(overrides)
    farm = [o.split("=", 1)[1] for o in overrides if o.startswith("farm=")]
    return (farm[-1] if farm else None), [o for o in overrides if not o.startswith("farm=")]


# The most runs one sweep may expand to: every job is composed and checked before the first runs, and
# a typo such as chunk=range(1,100000) would otherwise compose for hours before saying anything.
MAX_SWEEP_RUNS = 500


def parse_overrides(overrides: Iterable[str]) -> list:
    overrides = list(overrides)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise UsageError(f"cannot parse overrides {overrides}: {str(e).splitlines()[0]}") from None
    for o in parsed:
        if not o.key_or_group:
            raise UsageError(f"override {o.input_line!r} names no key; accepted: key=value, e.g. chunk=32")
    return parsed


def sweep_length(override) -> int:
    """How many values a sweep override stands for, counted without listing them."""
    value = override.value()
    if isinstance(value, RangeSweep):
        if not value.step or (value.stop - value.start) / value.step < 0:
            return 0
        return math.ceil((value.stop - value.start) / value.step)
    return len(value.list)


def expand_sweep(overrides: Iterable[str], together: Iterable[str] = ()) -> list[list[str]]:
    """`chunk=32,64 tail=0,2` -> the cartesian product as lists of plain overrides (Hydra's syntax,
    including range() and choice(); the basic sweeper's product, in the order given), at most
    MAX_SWEEP_RUNS of them. A sweep over a key in `together` is not split into jobs: every job gets
    its whole list (`tail=0,2` -> `tail=[0,2]`), which the experiment measures interleaved in one job."""
    together = set(together)
    parsed = parse_overrides(overrides)
    runs = 1
    for o in parsed:
        if o.key_or_group in together:
            continue
        if o.value_type == ValueType.GLOB_CHOICE_SWEEP:
            raise UsageError(f"{o.input_line!r}: glob() sweeps over config groups are not supported; "
                             "accepted: a list (key=a,b), range() or choice()")
        if o.is_sweep_override():
            count = sweep_length(o)
            if count == 0:
                raise UsageError(f"{o.input_line!r} is a sweep of no values; accepted: a non-empty list or range")
            runs *= count
    if runs > MAX_SWEEP_RUNS:
        raise UsageError(f"the sweep {' '.join(o.input_line for o in parsed if o.is_sweep_override())} is "
                         f"{runs} runs; accepted: at most {MAX_SWEEP_RUNS} (split it into several sweeps)")
    axes = []
    for o in parsed:
        key = o.input_line.split("=", 1)[0]
        if o.is_sweep_override() and o.key_or_group in together:
            axes.append([f"{key}=[{','.join(o.sweep_string_iterator())}]"])
            continue
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        axes.append([f"{key}={v}" for v in values])
    return [list(combo) for combo in itertools.product(*axes)]


def swept_experiments(overrides: Iterable[str]) -> list[str]:
    """The experiments a sweep's overrides name (experiment=a,b is itself a sweep), or the default one."""
    for o in parse_overrides(overrides):
        if o.key_or_group == "experiment":
            names = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
            for name in names:
                if name not in choices("experiment"):
                    raise UsageError(f"unknown experiment {name!r}; accepted: {', '.join(choices('experiment'))}")
            return names
    return [load([]).experiment]


def _group_choice(parsed: list, group: str, default: str | None) -> str | None:
    for o in parsed:
        if o.key_or_group == group:
            return o.get_value_element_as_str()
    return default


def _leaf_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for k, v in cfg.items():
        name = f"{prefix}{k}"
        keys.extend(_leaf_keys(v, name + ".") if isinstance(v, DictConfig) else [name])
    return keys


@dataclass
class RunConfig:
    """A composed configuration: which experiment, which device, and every value."""

    experiment: str
    device: str
    cfg: DictConfig
    overrides: list[str]

    def flat(self) -> dict[str, Any]:
        """Every value as dotted keys, for records and tables."""
        container = OmegaConf.to_container(self.cfg, resolve=True)
        out: dict[str, Any] = {}

        def walk(node, prefix):
            for k, v in node.items():
                if isinstance(v, dict):
                    walk(v, f"{prefix}{k}.")
                else:
                    out[f"{prefix}{k}"] = v

        walk(container, "")
        return out


def load(overrides: Iterable[str] = (), experiment: str | None = None) -> RunConfig:
    """Compose one configuration. `experiment` (if given) is the default when no override names one."""
    overrides = list(overrides)
    parsed = parse_overrides(overrides)
    if any(o.is_sweep_override() for o in parsed):
        sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
        raise UsageError(f"{sweeps[0]!r} is a sweep; use `testbed sweep` for several values")
    for group in GROUPS:
        name = _group_choice(parsed, group, None)
        if name is not None and name not in choices(group):
            raise UsageError(f"unknown {group} {name!r}; accepted: {', '.join(choices(group))}")
    if experiment is not None and _group_choice(parsed, "experiment", None) is None:
        if experiment not in choices("experiment"):
            raise UsageError(f"unknown experiment {experiment!r}; accepted: {', '.join(choices('experiment'))}")
        overrides = [f"experiment={experiment}", *overrides]

    cfg = _compose(overrides)
    chosen = cfg.hydra.runtime.choices
    name, device = chosen["experiment"], chosen["device"]
    with _unlocked(cfg):
        del cfg["hydra"]
    _check_additions(parse_overrides(overrides), overrides, cfg, name, device)
    apply_device_sizes(cfg, parse_overrides(overrides), name, device)
    return RunConfig(experiment=name, device=device, cfg=cfg, overrides=overrides)


def _compose(overrides: list[str]) -> DictConfig:
    GlobalHydra.instance().clear()
    _register()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        try:
            return compose("config", overrides=[*overrides, *_search_path()], return_hydra_config=True)
        except (HydraException, ValueError) as e:  # Hydra raises ValueError for some malformed overrides
            raise _explain(e, overrides) from None


# Mappings whose entries are free-form: whoever reads the mapping checks each entry (chunk_prefill's
# model.overrides: GemmaConfig fields). `+key=value` may add an entry under them, nowhere else.
OPEN_MAPPINGS = ("model.overrides",)


def _check_additions(parsed: list, overrides: list[str], cfg: DictConfig, experiment: str, device: str) -> None:
    """Hydra's `+key=value` (and `++key=value`) adds a key the configuration does not have, skipping the
    unknown-key check a plain `key=value` gets: refuse every such key that nothing reads. Accepted: an
    entry of an OPEN_MAPPINGS mapping the experiment has, a key the configuration already has (`++`),
    and a device profile's fields (the composed profile is checked as a profile file is)."""
    added = [o for o in parsed if o.is_add() or o.is_force_add()]
    if not added:
        return
    plain = [o.input_line for o in parsed if not (o.is_add() or o.is_force_add())]
    base = _compose(plain)
    with _unlocked(base):
        del base["hydra"]
    for o in added:
        key = o.key_or_group
        if key == "device" or key.startswith("device."):
            continue  # below: the whole profile, as a profile file is checked
        if OmegaConf.select(base, key, default=_MISSING) is not _MISSING:
            continue
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        if parent in OPEN_MAPPINGS and isinstance(OmegaConf.select(base, parent, default=None), DictConfig):
            continue
        top = sorted({k.split(".")[0] + (".*" if "." in k else "") for k in _leaf_keys(base)} | set(GROUPS))
        raise UsageError(f"unknown key {key!r} ({o.input_line!r} adds a key no part of {experiment} reads); "
                         f"accepted keys: {', '.join(top)}")
    if any(o.key_or_group == "device" or o.key_or_group.startswith("device.") for o in added):
        from testbed.devices.profile import Profile

        Profile.from_config(cfg.device, f"device={device} with {' '.join(o.input_line for o in added)}")


_MISSING = object()


def apply_device_sizes(cfg: DictConfig, parsed: list, experiment: str, device: str) -> dict[str, Any]:
    """The device profile's `sizes` for this experiment (devices/NAME.yaml: an emulated device's smaller
    matrix, shapes and repetitions) set in `cfg`, below the command line: a key the overrides name, or
    a key inside or around one they name, keeps the command line's value. Returns what was applied. A
    key the experiment does not have is refused, naming the profile."""
    sizes = OmegaConf.select(cfg, f"device.sizes.{experiment}", default=None)
    if not sizes:
        return {}
    given = [o.key_or_group for o in parsed]
    applied = {}
    for key, value in _leaf_values(OmegaConf.to_container(sizes, resolve=True)):
        if key.split(".")[0] == "device" or OmegaConf.select(cfg, key, default=_MISSING) is _MISSING:
            top = sorted({k.split(".")[0] + (".*" if "." in k else "") for k in _leaf_keys(cfg)} - {"device.*"})
            raise UsageError(f"devices/{device}.yaml: sizes.{experiment}.{key} is not a key of experiment "
                             f"{experiment}; accepted keys: {', '.join(top)}")
        if any(g == key or key.startswith(g + ".") or g.startswith(key + ".") for g in given):
            continue
        OmegaConf.update(cfg, key, value, merge=False)
        applied[key] = value
    return applied


def _leaf_values(node: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """A nested mapping's leaves as (dotted key, value); lists are values."""
    out = []
    for k, v in node.items():
        out.extend(_leaf_values(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [(f"{prefix}{k}", v)])
    return out


class _unlocked:
    def __init__(self, cfg):
        self.cfg = cfg

    def __enter__(self):
        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc):
        OmegaConf.set_struct(self.cfg, True)


def _explain(error: HydraException, overrides: list[str]) -> UsageError:
    text = str(error)
    if "Could not override" in text or "not in struct" in text:
        key = text.split("'")[1] if "'" in text else "?"
        base = [o for o in overrides if o.split("=", 1)[0] in GROUPS]
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            keys = _leaf_keys(compose("config", overrides=[*base, *_search_path()]))
        top = sorted({k.split(".")[0] + (".*" if "." in k else "") for k in keys} | set(GROUPS))
        return UsageError(f"unknown key {key!r}; accepted keys: {', '.join(top)}")
    return UsageError(text.splitlines()[0])


# --- parameter checks -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Int:
    """An integer parameter within [lo, hi]."""

    lo: int | None = None
    hi: int | None = None

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{key}={value!r} is not an integer; accepted: {self.describe()}")
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise UsageError(f"{key}={value} is out of range; accepted: {self.describe()}")

    def describe(self) -> str:
        if self.hi is None:
            return f"integers >= {self.lo}"
        return f"integers from {self.lo} to {self.hi}"


@dataclass(frozen=True)
class Float:
    lo: float | None = None
    hi: float | None = None

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UsageError(f"{key}={value!r} is not a finite number; accepted: {self.describe()}")
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise UsageError(f"{key}={value} is out of range; accepted: {self.describe()}")

    def describe(self) -> str:
        return f"numbers from {self.lo} to {self.hi}" if self.hi is not None else f"numbers >= {self.lo}"


@dataclass(frozen=True)
class Choice:
    options: tuple

    def check(self, key: str, value: Any) -> None:
        if value not in self.options:
            raise UsageError(f"{key}={value!r} is not accepted; accepted: {', '.join(map(str, self.options))}")


@dataclass(frozen=True)
class IntList:
    """A list of integers within [lo, hi] (e.g. bench_tokens=[64,512])."""

    lo: int = 1
    hi: int | None = None

    def check(self, key: str, value: Any) -> None:
        items = list(value) if OmegaConf.is_list(value) or isinstance(value, (list, tuple)) else [value]
        if not items:
            raise UsageError(f"{key} is empty; accepted: a list of {Int(self.lo, self.hi).describe()}")
        for item in items:
            Int(self.lo, self.hi).check(key, item)


@dataclass(frozen=True)
class BoolList:
    """A list of booleans (e.g. ratios.gdn.kda=[false,true]), or one boolean."""

    def check(self, key: str, value: Any) -> None:
        items = list(value) if OmegaConf.is_list(value) or isinstance(value, (list, tuple)) else [value]
        if not items or not all(isinstance(item, bool) for item in items):
            raise UsageError(f"{key}={value!r} is not accepted; accepted: true, false or a list of them")


def as_bools(value) -> list[bool]:
    """A BoolList parameter given as a list or as one value."""
    return [bool(v) for v in value] if OmegaConf.is_list(value) or isinstance(value, (list, tuple)) else [bool(value)]


def as_list(value) -> list[int]:
    """An IntList parameter given as a list or, from a sweep, as one value."""
    return [int(v) for v in value] if OmegaConf.is_list(value) or isinstance(value, (list, tuple)) else [int(value)]


def check_params(cfg: DictConfig, params: dict) -> None:
    """Check each declared parameter's type and range; raise a UsageError naming the first bad one."""
    for key, rule in params.items():
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
        rule.check(key, value)


def project_path(path: str | Path) -> Path:
    """A path from config: absolute as given, relative to the project root otherwise."""
    p = Path(path)
    return p if p.is_absolute() else PROJECT_ROOT / p
