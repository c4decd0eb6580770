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
is accepted, before any work is done or anything is written. A mistyped group option, experiment, device
or key names the closest accepted one (difflib, a ratio of at least 0.6; a dotted key's last part is
compared with the names beside it, since the shared prefix says nothing).

Hydra serves here as the composer only (its compose API): testbed runs the jobs and stores each one's
composed config with its records in the results store. So Hydra's own settings, hydra.* and hydra/GROUP
(run and sweep folders, launcher, sweeper, search path), would do nothing; each is refused, saying what
does that job in testbed (HYDRA_INSTEAD). `describe` gives Hydra's --help: the groups the composition
really used (Hydra's runtime choices, so chunk_prefill lists model and gdn does not), their options from
the group folders, and every key's value.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import RangeSweep, ValueType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from testbed import CONFIG_ROOT, PROJECT_ROOT
from testbed.errors import UsageError, closest, did_you_mean

CONFIG_DIR = CONFIG_ROOT / "experiments"
DEVICES_DIR = CONFIG_ROOT / "devices"
# The groups checked by name before composing; any other group is a folder of experiments/ (suite/: nightly's).
GROUPS = {"experiment": CONFIG_DIR / "experiment", "model": CONFIG_DIR / "model", "device": DEVICES_DIR}
LAB_ENV = "TESTBED_LAB"
LAB_FOLDERS = {"experiment": "experiment", "model": "model", "device": "devices", "suite": "suite"}
ENTRY_POINTS = "testbed.experiments"


# `${default_backend:${oc.select:device.capabilities,[]},[refimpl,native]}` in an experiment config:
# the first backend of PREFERENCE that the device's profile lists and the experiment accepts (the
# host: refimpl; an ARM board: native; lavapipe: iree; seed 002's phones: llamacpp). It lives here,
# not in testbed.backends, because composing a configuration must not load the backends.
PREFERENCE = ("refimpl", "native", "iree", "llamacpp")


def _default_backend(capabilities, accepted) -> str:
    """A device's default backend among those an experiment accepts: the first of PREFERENCE the
    device's profile has as a capability (the host: refimpl; an ARM board: native; lavapipe: iree)."""
    caps = set(capabilities or ())
    for name in PREFERENCE:
        if name in caps and name in accepted:
            return name
    return next((n for n in PREFERENCE if n in accepted), accepted[0])



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
    own = GROUPS.get(group, CONFIG_DIR / group)
    lab = lab_dir()
    return [own] + ([lab / LAB_FOLDERS.get(group, group)] if lab else [])


def packaged_experiments() -> dict[str, Path]:
    """Experiments other packages provide (entry point group testbed.experiments): name -> its config.
    A broken entry point is left out (broken_entry_points says why): the other experiments still run."""
    return {name: found for name, found in _entry_points().items() if isinstance(found, Path)}


def broken_entry_points() -> dict[str, str]:
    """Entry points of group testbed.experiments that cannot serve (a stale or half-installed package:
    its module does not import, or has no config beside it): name -> one line saying which and why."""
    return {name: found for name, found in _entry_points().items() if isinstance(found, str)}


def _entry_points() -> dict[str, Path | str]:
    """Each entry point's config, or why there is none."""
    found: dict[str, Path | str] = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINTS):
        said = f"entry point {ENTRY_POINTS} {entry.name} = {entry.value}"
        try:
            spec = importlib.util.find_spec(entry.value)
        except Exception as e:  # noqa: BLE001 -- a package importing its parent can fail in any way
            found[entry.name] = (f"{said} does not import ({type(e).__name__}: {(str(e).splitlines() or [''])[0]}); "
                                 "reinstall or uninstall the package that declares it")
            continue
        config = Path(spec.origin).parent / f"{entry.name}.yaml" if spec and spec.origin else None
        if config is None or not config.is_file():
            found[entry.name] = (f"{said}: no module, or no config {entry.name}.yaml beside it; accepted: a module "
                                 "with its NAME.yaml in the same folder")
            continue
        found[entry.name] = config
    return found


# testbed's own experiment modules (testbed.experiments.NAME), found by file: composing a configuration
# must not import them.
OWN_EXPERIMENTS = Path(__file__).resolve().parent / "experiments"


def choices(group: str) -> list[str]:
    """The names a config group accepts: its YAML files (and, for experiments, other packages'). An
    experiment is a module with its config: a YAML file with no module (a lab's experiment/NAME.yaml
    alone) runs nothing, so it is not one (check_choice says what it lacks)."""
    names = {p.stem for folder in group_dirs(group) for p in folder.glob("*.yaml")}
    if group != "experiment":
        return sorted(names)
    return sorted({n for n in names if (OWN_EXPERIMENTS / f"{n}.py").is_file()} | set(packaged_experiments()))


def check_choice(group: str, name: str) -> None:
    """A UsageError naming the closest accepted name and every accepted one, if `group` has no `name`."""
    accepted = choices(group)
    if name in accepted:
        return
    if group == "experiment":
        _refuse_experiment_without_module(name, accepted)
    raise UsageError(f"unknown {group} {name!r}{did_you_mean(name, accepted)}; accepted: {', '.join(accepted)}")


def _refuse_experiment_without_module(name: str, accepted: list[str]) -> None:
    """What an experiment name that is not accepted lacks, when it has a config: a module that imports."""
    broken = broken_entry_points()
    if name in broken:
        raise UsageError(f"experiment {name!r}: {broken[name]}")
    config = next((folder / f"{name}.yaml" for folder in group_dirs("experiment")
                   if Path(name).name == name and (folder / f"{name}.yaml").is_file()), None)
    if config is not None:
        raise UsageError(f"experiment {name!r} ({config}) has a config but no module: an experiment is a module "
                         f"that runs it (testbed/experiments/{name}.py, or another package's entry point {name} in "
                         f"group {ENTRY_POINTS}, its {name}.yaml beside it); to run one of {', '.join(accepted)} "
                         "with other values, name them on the command line or in a suite")


def group_file(group: str, name: str) -> Path:
    """The YAML file of `name` in `group`; a UsageError naming what is accepted if there is none. A name
    is a name, never a path: `../experiments/config` would read a file outside the group's folders."""
    if Path(name).name != name or name.startswith("."):
        check_choice(group, name)
    for folder in group_dirs(group):
        if (folder / f"{name}.yaml").is_file():
            return folder / f"{name}.yaml"
    check_choice(group, name)
    raise UsageError(f"{group} {name!r} has no config file in {', '.join(map(str, group_dirs(group)))}")


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
    """farm=HEAD:PORT (run on a lab's Ray cluster: testbed.lab.farm) apart from the configuration's overrides."""
    overrides = list(overrides)
    farm = [o.split("=", 1)[1] for o in overrides if o.startswith("farm=")]
    return (farm[-1] if farm else None), [o for o in overrides if not o.startswith("farm=")]


# The most runs one sweep may expand to: every job is composed and checked before the first runs, and
# a typo such as chunk=range(1,100000) would otherwise compose for hours before saying anything.
MAX_SWEEP_RUNS = 500


# Hydra's own settings (hydra.*, hydra/GROUP) configure Hydra's app runner, which testbed does not use: it
# composes with Hydra's compose API and stores every run's composed config and records in the results
# store (testbed.results), one place. So each is refused, saying what does that job here; none is ignored.
HYDRA_INSTEAD = {
    "hydra.run": "records and each run's composed config go to the results store: "
                     "TESTBED_RESULTS=DIR (or results_dir=DIR) places it",
    "hydra.sweep": "a sweep's runs go to the results store, one run id each: "
                   "TESTBED_RESULTS=DIR (or results_dir=DIR) places it",
    "hydra.output_subdir": "each run's composed config is stored with its records: `testbed run EXPERIMENT "
                           "--cfg job` prints it",
    "hydra.job.chdir": "runs never change folder; TESTBED_RESULTS=DIR places the results store",
    "hydra.searchpath": "TESTBED_LAB=DIR adds a lab's own experiment/, model/, devices/ and suite/ folders",
    "hydra/launcher": "jobs run one after another here, or on a lab's hosts with farm=HEAD:PORT",
    "hydra/sweeper": "`testbed sweep` (or `testbed run -m`) runs the cartesian product of key=a,b lists, "
                     "range() and choice()",
}


def _refuse_hydra_setting(o) -> None:
    key = o.key_or_group
    if key != "hydra" and not key.startswith(("hydra.", "hydra/")):
        return
    instead = next((said for k, said in HYDRA_INSTEAD.items() if key == k or key.startswith(k + ".")),
                   "testbed reads no hydra.* setting; accepted: the experiment's own keys "
                   "(`testbed run EXPERIMENT --help` lists them)")
    raise UsageError(f"{o.input_line!r} is not supported (testbed does not run Hydra's app); {instead}")


def parse_overrides(overrides: Iterable[str]) -> list:
    overrides = list(overrides)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise UsageError(f"cannot parse overrides {overrides}: {str(e).splitlines()[0]}") from None
    for o in parsed:
        if not o.key_or_group:
            raise UsageError(f"override {o.input_line!r} names no key; accepted: key=value, e.g. chunk=32")
        _refuse_hydra_setting(o)
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
                check_choice("experiment", name)
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
    groups: dict[str, str] = field(default_factory=dict)  # each config group composed -> its option
    sizes: dict[str, Any] = field(default_factory=dict)  # what the device profile's sizes set (dotted key -> value)

    def origin(self, key: str) -> str | None:
        """Where a key's value came from when the device profile's sizes set it (or a key inside or
        around it): `devices/NAME.yaml: sizes.EXPERIMENT.KEY`, for an error about that value. None: the
        experiment's config or the command line."""
        for sized in self.sizes:
            if sized == key or sized.startswith(key + ".") or key.startswith(sized + "."):
                return f"devices/{self.device}.yaml: sizes.{self.experiment}.{sized}"
        return None

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


# experiments where backend=llamacpp means backend=engine engine=llamacpp (engines/llamacpp.yaml: testbed's
# adapter serving the engine contract with libllama)
LLAMACPP_AS_ENGINE = ("chunk_prefill", "tail", "hybrid")


def load(overrides: Iterable[str] = (), experiment: str | None = None) -> RunConfig:
    """Compose one configuration. `experiment` (if given) is the default when no override names one."""
    overrides = list(overrides)
    parsed = parse_overrides(overrides)
    if any(o.is_sweep_override() for o in parsed):
        sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
        raise UsageError(f"{sweeps[0]!r} is a sweep; use `testbed sweep` (or `testbed run EXPERIMENT -m`) "
                         "for several values")
    for group in GROUPS:
        name = _group_choice(parsed, group, None)
        if name is not None:
            check_choice(group, name)
    if experiment is not None and _group_choice(parsed, "experiment", None) is None:
        check_choice("experiment", experiment)
        overrides = [f"experiment={experiment}", *overrides]

    cfg = _compose(overrides)
    chosen = cfg.hydra.runtime.choices
    name, device = chosen["experiment"], chosen["device"]
    groups = {g: str(option) for g, option in chosen.items() if not g.startswith("hydra/")}
    with _unlocked(cfg):
        del cfg["hydra"]
    if name in LLAMACPP_AS_ENGINE and cfg.get("backend") == "llamacpp":
        with _unlocked(cfg):  # llama.cpp is judged on these techniques as the engine under test it is
            cfg.backend, cfg.engine = "engine", "llamacpp"
    parsed = parse_overrides(overrides)  # again: `experiment=` may have been put in front
    _check_additions(parsed, overrides, cfg, name, device)
    sizes = apply_device_sizes(cfg, parsed, name, device)
    cfg.results_dir = str(results_path(cfg.results_dir))  # what `--cfg job` prints is where records go
    return RunConfig(experiment=name, device=device, cfg=cfg, overrides=overrides, groups=groups, sizes=sizes)


def describe(rc: RunConfig, keys: bool = True) -> str:
    """Hydra's `--help` text for a composed configuration: each config group it was composed from
    (Hydra's own record of them, so a group an experiment adds, such as chunk_prefill's model, is listed
    for that experiment only) with its options and the one chosen; with `keys`, every key with its value
    as an override would give it (the device profile's fields apart: `--cfg job --package device`)."""
    named = {o.split("=", 1)[0].lstrip("+") for o in rc.overrides}
    lines = ["== Configuration groups ==", "Compose your configuration from those groups (group=option)"]
    if "experiment" not in named:
        lines.append(f"(the groups of {rc.experiment}, the default experiment: `testbed run EXPERIMENT --help` "
                     "lists another's, and its keys)")
    lines.append("")
    for group in sorted(rc.groups, key=lambda g: (g != "experiment", g)):
        lines.append(f"{group}: {', '.join(choices(group))} "
                     f"({'chosen' if group in named else 'default'}: {rc.groups[group]})")
    if keys:
        lines += ["", f"== Config of {rc.experiment} ==", "Override anything in the config (key=value)", ""]
        lines += [f"{key}={_as_override(value)}" for key, value in rc.flat().items() if key.split(".")[0] != "device"]
    return "\n".join(lines)


def _as_override(value) -> str:
    """A value as it is written in an override: null, true, [64,512], {past: 800, tokens: 52}."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_as_override(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_as_override(v)}" for k, v in value.items()) + "}"
    return str(value)


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
    and a device profile's fields (runner.check checks the composed profile as a profile file is)."""
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
            continue  # runner.check: the whole composed profile, as a profile file is checked
        if OmegaConf.select(base, key, default=_MISSING) is not _MISSING:
            continue
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        if parent in OPEN_MAPPINGS and isinstance(OmegaConf.select(base, parent, default=None), DictConfig):
            continue
        keys = _leaf_keys(base)
        top = sorted({k.split(".")[0] + (".*" if "." in k else "") for k in keys} | set(GROUPS))
        raise UsageError(f"unknown key {key!r}{_key_hint(key, keys)} ({o.input_line!r} adds a key "
                         f"no part of {experiment} reads); accepted keys: {', '.join(top)}")


_MISSING = object()


def _key_hint(key: str, keys: list[str]) -> str:
    """' (did you mean 'X'?)' for a mistyped key: its last part against the names beside it (bench.rep ->
    bench.reps; sharing `bench.` says nothing), the whole key against every key when its parent is unknown
    too (benh.reps -> bench.reps); a top-level key against the top-level names and the groups."""
    parent, _, leaf = key.rpartition(".")
    if not parent:
        return did_you_mean(key, {k.split(".")[0] for k in keys} | set(GROUPS))
    beside = {k[len(parent) + 1:].split(".")[0] for k in keys if k.startswith(parent + ".")}
    if not beside:
        return did_you_mean(key, keys)
    close = closest(leaf, beside)
    return f" (did you mean {parent + '.' + close!r}?)" if close else ""


# The keys experiments/config.yaml sets for every experiment (where records go, where the fixtures are,
# the seed) and the config groups: never a size. A profile that set them would move the store silently.
def not_sizes() -> set[str]:
    shared = OmegaConf.load(CONFIG_DIR / "config.yaml")
    return {str(k) for k in shared if k != "defaults"} | set(GROUPS)


def apply_device_sizes(cfg: DictConfig, parsed: list, experiment: str, device: str) -> dict[str, Any]:
    """The device profile's `sizes` for this experiment (devices/NAME.yaml: an emulated device's smaller
    matrix, shapes and repetitions) set in `cfg`, below the command line: a key the overrides name, or
    a key inside or around one they name, keeps the command line's value. Returns what was applied
    (dotted key -> value). Only the experiment's own keys are sizes; anything else (another key, a
    shared one such as results_dir, a list where a mapping belongs, an interpolation that does not
    resolve) is refused in one line naming the profile's file and key."""
    where = f"devices/{device}.yaml: sizes"
    try:
        every = OmegaConf.select(cfg, "device.sizes", default=None)
        if every is not None and not isinstance(every, DictConfig):
            raise UsageError(f"{where} is not a mapping; accepted: a mapping of experiment names to mappings "
                             "of their keys")
        sizes = every.get(experiment) if every is not None else None
        if sizes is None:
            return {}
        if not isinstance(sizes, DictConfig):
            raise UsageError(f"{where}.{experiment} is not a mapping; accepted: a mapping of the experiment's "
                             "keys to values")
        values = _leaf_values(OmegaConf.to_container(sizes, resolve=True))
    except OmegaConfBaseException as e:  # an interpolation that does not resolve, and its kin
        key = str(e.full_key or "").removeprefix("device.sizes.")
        raise UsageError(f"{where}.{key}: {str(e.msg).splitlines()[0]}; accepted: a value, or an interpolation "
                         "of a key the configuration has") from None
    given = [o.key_or_group for o in parsed]
    shared = not_sizes()
    applied = {}
    for key, value in values:
        if key.split(".")[0] in shared or OmegaConf.select(cfg, key, default=_MISSING) is _MISSING:
            top = sorted({k.split(".")[0] + (".*" if "." in k else "") for k in _leaf_keys(cfg)
                          if k.split(".")[0] not in shared})
            why = (f"is not a size (set for every experiment, never by a device)" if key.split(".")[0] in shared
                   else f"is not a key of experiment {experiment}")
            raise UsageError(f"{where}.{experiment}.{key} {why}; "
                             f"accepted keys: {', '.join(top)}")
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
        return UsageError(f"unknown key {key!r}{_key_hint(key, keys)}; accepted keys: {', '.join(top)}")
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
            raise UsageError(f"{key}={value!r} is not accepted{did_you_mean(value, self.options)}; accepted: "
                             f"{', '.join(map(str, self.options))}")


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
class ChoiceList:
    """A non-empty list of accepted values without repeats (e.g. weights=[f32,q8_0]), or one value."""

    options: tuple

    def check(self, key: str, value: Any) -> None:
        items = list(value) if OmegaConf.is_list(value) or isinstance(value, (list, tuple)) else [value]
        accepted = ", ".join(map(str, self.options))
        if not items:
            raise UsageError(f"{key} is empty; accepted: a list of {accepted}")
        for item in items:
            if item not in self.options:
                raise UsageError(f"{key}={item!r} is not accepted; accepted: a list of {accepted}")
        if len(set(items)) != len(items):
            raise UsageError(f"{key}={items} names a value twice; accepted: a list of {accepted}, each once")


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


def check_params(cfg: DictConfig, params: dict, origin=lambda key: None) -> None:
    """Check each declared parameter's type and range; raise a UsageError naming the first bad one and,
    when `origin(key)` says where its value came from (a device profile's sizes), that too."""
    for key, rule in params.items():
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
        try:
            rule.check(key, value)
        except UsageError as e:
            if origin(key) is None:
                raise
            raise UsageError(f"{origin(key)}: {e}") from None


RESULTS_ENV = "TESTBED_RESULTS"


def results_path(results_dir: str) -> Path:
    """Where a run's records go: TESTBED_RESULTS when set (it wins over results_dir: a test's or a lab
    worker's own store), else the configuration's results_dir, relative to the project root."""
    return project_path(os.environ.get(RESULTS_ENV) or results_dir)


def project_path(path: str | Path) -> Path:
    """A path from config: absolute as given, relative to the project root otherwise."""
    p = Path(path)
    return p if p.is_absolute() else PROJECT_ROOT / p
