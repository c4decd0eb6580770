"""engines/NAME.yaml: an engine under test as engine contract v1 describes it
(engines/contract-v1.schema.json). A file that breaks the schema is one line naming the file and the
key, exit 2.

An engine with an `export:` section is exporter-based (ExecuTorch, ONNX Runtime, LiteRT, MNN): its
exporter runs on the host, once per content, from the Hugging Face folder testbed hands it, and its
program reads the exporter's output as request/model/ (testbed.backends.engine.export)."""

from __future__ import annotations

import hashlib
import json
import math
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from testbed.config import lab_dir
from testbed.errors import UsageError, did_you_mean
from testbed.inputs import read_bounded, shown

CONTRACT_VERSION = 1
PROJECT_ENGINES = Path(__file__).resolve().parents[3] / "engines"
SCHEMA_FILE = PROJECT_ENGINES / f"contract-v{CONTRACT_VERSION}.schema.json"
TARGETS = ("host", "arm32", "aarch64", "hexagon")
TECHNIQUES = ("chunk_prefill", "tail", "hybrid")
YAML_MAX_BYTES = 1 << 20
YAML_MAX_DEPTH = 16


@dataclass(frozen=True)
class ExportSpec:
    """The yaml's `export:`: how the runtime's files are made from a Hugging Face folder, on the host."""

    command: tuple[str, ...]       # argv; {python} {source} {model} {out} and one placeholder per key
    extra: str                     # the pyproject extra that installs it
    modules: tuple[str, ...]       # Python modules it imports (missing: exit 3 naming the extra)
    keys: tuple[str, ...]          # request values the export depends on (request.json's dotted keys)
    timeout_s: float


@dataclass(frozen=True)
class EngineSpec:
    name: str
    path: Path                     # the yaml
    yaml_sha256: str               # of its bytes: what the records name
    description: str
    source: Path | None            # hashed for the build cache and the evidence
    command: tuple[str, ...] | None
    prebuilt: dict[str, Path] | None
    program: str
    abis: tuple[str, ...]
    techniques: tuple[str, ...]
    model_formats: tuple[str, ...]
    weights: tuple[str, ...]
    cache: tuple[str, ...]
    invoke: tuple[str, ...]
    timeout_s: float
    counts: str                    # "marked": per call (tb_engine.h's marks) | "process": the whole run
    state_in: bool = False         # restores a request's state_in and continues from it (supports.state_in)
    state_layout: str = "bytes"    # state.bin compared as: bytes (exactly) | float32 | float16 (as float32 values)
    state_tolerance: float = 0.0   # max |a - b| between two states of a float layout (0: equal values)
    tolerance: tuple[tuple[str, float], ...] = ()  # the engine's logits precision per cache dtype (yaml `tolerance`)
    tolerance_measured: str = ""   # where that precision was measured (yaml tolerance.measured)
    export: ExportSpec | None = None  # exporter-based: the program reads the exporter's output

    def logits_tolerance(self, cache_dtype: str) -> float | None:
        """The engine's declared max |logit - reference| for a cache dtype, or None when it declares none."""
        return dict(self.tolerance).get(cache_dtype)

    def identity(self) -> dict:
        return {"engine": self.name, "engine_yaml": str(self.path), "engine_yaml_sha256": self.yaml_sha256}

    def refusal(self, technique: str, target: str | None = None, weights: str | None = None,
                cache: str | None = None) -> str | None:
        """Why this engine, by its own yaml, does not serve a request: the technique, the build target of the
        device (an ABI it is not built for), the weights dtype or the cache dtype, said in the yaml's words
        (which key lists what); None when the yaml allows it. A run records it "not supported", never a
        usage error: the engine said so itself."""
        said = f"engine={self.name}"
        if technique not in self.techniques:
            return f"{said} does not support {technique} ({self.path}: supports.techniques={list(self.techniques)})"
        if target is not None and target not in self.abis:
            return f"{said} is not built for {target} ({self.path}: abis={list(self.abis)})"
        if weights is not None and weights not in self.weights:
            return f"{said} does not take {weights} weights ({self.path}: supports.weights={list(self.weights)})"
        if cache is not None and cache not in self.cache:
            return f"{said} keeps no {cache} cache ({self.path}: supports.cache={list(self.cache)})"
        return None


def engine_dirs() -> list[Path]:
    """Where engines/NAME.yaml are looked for, the project's first."""
    lab = lab_dir()
    return [PROJECT_ENGINES] + ([lab / "engines"] if lab else [])


def names() -> list[str]:
    return sorted({p.stem for d in engine_dirs() if d.is_dir() for p in d.glob("*.yaml")})


def load(name: str) -> EngineSpec:
    """The engine called `name`; a name no folder holds is refused with the closest one."""
    if not name:
        raise UsageError(f"backend=engine needs engine=NAME; accepted: {', '.join(names()) or 'none'}")
    for folder in engine_dirs():
        path = folder / f"{name}.yaml"
        if path.is_file():
            return parse(path)
    known = names()
    raise UsageError(f"engine={name!r} is not an engine{did_you_mean(name, known)}; accepted: "
                     f"{', '.join(known) or 'none'} (engines/NAME.yaml in the project or in TESTBED_LAB/engines/)")


def schema() -> dict:
    return json.loads(SCHEMA_FILE.read_text())


def _same(node: Any, value: Any) -> bool:
    """`node` is `value` and of its type: YAML's `true` is not the contract version 1, nor is `1.0`."""
    return type(node) is type(value) and node == value


def _problem(node: Any, rule: dict, key: str) -> str | None:
    """What is wrong with `node` under the schema `rule` (the subset contract-v1.schema.json uses), or None.
    `key` is the dotted key being checked, for nested problems."""
    if "const" in rule and not _same(node, rule["const"]):
        return f"{key}={shown(node)}; accepted: {rule['const']!r}"
    if "enum" in rule and not any(_same(node, e) for e in rule["enum"]):
        return f"{key}={shown(node)}{did_you_mean(node, rule['enum'])}; accepted: {', '.join(map(str, rule['enum']))}"
    kind = rule.get("type")
    if kind == "string" and not isinstance(node, str):
        return f"{key}={shown(node)} is not a string"
    if kind == "number":
        bounds = [f"{sign} {rule[name]}" for name, sign in (("exclusiveMinimum", ">"), ("minimum", ">="),
                                                           ("maximum", "<=")) if name in rule]
        if isinstance(node, bool) or not isinstance(node, (int, float)) or not math.isfinite(node) \
                or not node > rule.get("exclusiveMinimum", -math.inf) or not node >= rule.get("minimum", -math.inf) \
                or not node <= rule.get("maximum", math.inf):
            return f"{key}={shown(node)}; accepted: a finite number{' ' + ' and '.join(bounds) if bounds else ''}"
    if kind == "boolean" and not isinstance(node, bool):
        return f"{key}={shown(node)}; accepted: true, false"
    if kind == "string" and "pattern" in rule:
        import re

        if not re.search(rule["pattern"], node):
            return f"{key}={shown(node)} does not match {rule['pattern']}"
    if kind == "array":
        if not isinstance(node, list):
            return f"{key}={shown(node)} is not a list"
        if len(node) < rule.get("minItems", 0):
            return f"{key} is empty; accepted: at least {rule['minItems']} item(s)"
        if rule.get("uniqueItems") and len(set(map(str, node))) != len(node):
            return f"{key}={shown(node)} repeats an item"
        for i, item in enumerate(node):
            if (why := _problem(item, rule.get("items", {}), f"{key}[{i}]")):
                return why
    if kind == "object":
        if not isinstance(node, dict):
            return f"{key or 'the file'} is not a mapping"
        props = rule.get("properties", {})
        here = f"{key}." if key else ""
        for name in node:
            if rule.get("additionalProperties") is False and name not in props:
                return f"{here}{name} is not a key{did_you_mean(name, props)}; accepted: {', '.join(props)}"
        for name, value in node.items():  # a wrong value first: `contract: 2` says so, whatever else is missing
            if (why := _problem(value, props.get(name, {}), f"{here}{name}")):
                return why
        for name in rule.get("required", []):
            if name not in node:
                return f"{here}{name} is missing (required: {', '.join(rule['required'])})"
        if not rule.get("minProperties", 0) <= len(node) <= rule.get("maxProperties", len(node)):
            return f"{key} must hold exactly one of: {', '.join(props)}"
    return None


# What each argv's placeholders may name (str.format fields, filled by build.program_for and runner.call).
INVOKE_PLACEHOLDERS = ("program", "request", "response")
COMMAND_PLACEHOLDERS = ("abi", "out", "source", "jobs", "python")
# What a shell would read as more than a program's name: an argv's first word holds none of these (it is
# started as it is, never through a shell).
SHELL_CHARACTERS = frozenset(" \t\n\r;&|<>()$`\\\"'*?[]#~!")


def argv_problem(argv: list[str], key: str, accepted: tuple[str, ...]) -> str | None:
    """What is wrong with an argv's placeholders ({name} of `accepted`, nothing else str.format reads) or
    its program word (no whitespace or shell syntax around its placeholders), or None."""
    names = ", ".join(f"{{{a}}}" for a in accepted)
    for i, word in enumerate(argv):
        try:
            parts = list(string.Formatter().parse(word))
        except ValueError as e:  # a lone { or }
            return f"{key}[{i}]={shown(word)} is not a template str.format reads ({e}); accepted: placeholders " \
                   f"{names}, a brace itself written twice ({{{{ or }}}})"
        for literal, field, spec, conversion in parts:
            if field is not None and (field not in accepted or spec or conversion):
                named = "{" + field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
                return f"{key}[{i}]={shown(word)} names {named}; accepted: {names}"
            if i == 0 and SHELL_CHARACTERS & set(literal):
                bad = "".join(sorted(SHELL_CHARACTERS & set(literal)))
                return f"{key}[0]={shown(word)} is the program to start and holds {bad!r}: an argv is not a " \
                       f"shell line (nothing splits or interprets it); accepted: the program alone, its arguments " \
                       f"as more items"
    return None


def check_source_tree(path: Path, given: str, source: Path) -> None:
    """The source folder a build command runs in, hashed for the build cache: plain files and folders."""
    from testbed.backends.native.build import LinkInTree, tree_files

    try:
        tree_files(source)
    except LinkInTree as e:
        raise UsageError(f"{path}: source={given!r} holds a symbolic link, {e.link}; accepted: a tree of plain files "
                         "and folders (a link's bytes would come from outside the tree)") from None


def check_prebuilt(path: Path, data: dict, prebuilt: dict[str, Path]) -> None:
    """Every ABI the yaml lists has its prebuilt file, and a file started as the program (invoke begins
    {program}) is one its device can start: an ELF for that ABI's machine, or a script (#!)."""
    from testbed.backends.native.build import ELF_MACHINE_NAMES, TARGET_FOR_ABI
    from testbed.devices.profile import elf_machine_for
    from testbed.devices.transport import elf_machine

    for target in data["abis"]:
        file = prebuilt.get(target)
        if file is None:
            raise UsageError(f"{path}: build.prebuilt has no {target}, which abis lists; accepted: a program file "
                             f"for each ABI of abis (relative to the yaml)")
        given = f"build.prebuilt.{target}={data['build']['prebuilt'][target]!r}"
        if not file.is_file():
            raise UsageError(f"{path}: {given} is not a file; accepted: a program file for each ABI of abis "
                             f"(relative to the yaml)")
        if data["invoke"][0] != "{program}":
            continue  # started by another program (an interpreter): its format is that program's business
        try:
            with open(file, "rb") as f:
                head = f.read(4)
        except OSError as e:
            raise UsageError(f"{path}: {given} cannot be read: {e.strerror}") from None
        want = elf_machine_for({t: abi for abi, t in TARGET_FOR_ABI.items()}[target])
        machine = elf_machine(file)
        if head == b"\x7fELF" and want is not None and machine != want:
            raise UsageError(f"{path}: {given} is an ELF for machine {machine} "
                             f"({ELF_MACHINE_NAMES.get(machine, 'unknown')}), not {want} "
                             f"({ELF_MACHINE_NAMES.get(want, 'unknown')}) of ABI {target}")
        if head != b"\x7fELF" and not head.startswith(b"#!"):
            raise UsageError(f"{path}: {given} begins {head!r}: neither an ELF program nor a script (#!), so the "
                             f"device cannot start it (Exec format error); accepted: a program built for {target}, or "
                             f"invoke naming the program that runs it first")


def _beside(path: Path, key: str, given: str) -> Path:
    """`given`, relative to the yaml, resolved; one line when it cannot name a file here (a NUL, too long)."""
    try:
        resolved = (path.parent / given).resolve()
        resolved.exists()  # a name the system refuses raises here
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: {key}={shown(given)} cannot name a file: {getattr(e, 'strerror', None) or e}; "
                         f"accepted: a path relative to the yaml") from None
    return resolved


def parse(path: Path) -> EngineSpec:
    """engines/NAME.yaml, validated against the schema; every problem one line: the file and the key."""
    path = Path(path)
    raw = read_bounded(path, YAML_MAX_BYTES, str(path), "an engine yaml is a few dozen lines")
    try:
        depth = 0
        for event in yaml.parse(raw, Loader=yaml.SafeLoader):  # checked as it is read: it stops at the first
            if isinstance(event, yaml.AliasEvent):  # `*name`: a value shared, repeated or containing itself
                raise UsageError(f"{path}: line {event.start_mark.line + 1} repeats a value by an alias "
                                 f"(*{event.anchor}); accepted: every value written out (no anchors and aliases)")
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            if depth > YAML_MAX_DEPTH:  # PyYAML's time grows with the square of the depth
                raise UsageError(f"{path}: line {event.start_mark.line + 1} nests more than {YAML_MAX_DEPTH} levels "
                                 f"deep; accepted: an engine yaml's few levels")
        data = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UsageError(f"{path}:{where} is not YAML: {getattr(e, 'problem', e)}") from None
    why = _problem(data, schema(), "")
    if why:
        raise UsageError(f"{path}: {why}")
    if data["name"] != path.stem:
        raise UsageError(f"{path}: name={shown(data['name'])} must equal the file's stem {path.stem!r}")
    build = data.get("build") or {}
    source = _beside(path, "source", data["source"]) if "source" in data else None
    if "command" in build and (source is None or not source.is_dir()):
        raise UsageError(f"{path}: source={shown(data.get('source'))} is not a folder (relative to the yaml); a build "
                         "command runs in it")
    # a prebuilt program is named relative to the engine's source where it has one and the file is there
    # (engines/onnxruntime.yaml: source onnxruntime, prebuilt adapter.py), else relative to the yaml
    prebuilt = {t: source / p if source is not None and (source / p).is_file() else
                _beside(path, f"build.prebuilt.{t}", p) for t, p in build.get("prebuilt", {}).items()} \
        if "prebuilt" in build else None
    if prebuilt is None and "command" not in build:
        raise UsageError(f"{path}: build is missing; accepted: build.command (argv) or build.prebuilt (a path per ABI)")
    for key, argv, accepted in (("invoke", data["invoke"], INVOKE_PLACEHOLDERS),
                                ("build.command", build.get("command") or [], COMMAND_PLACEHOLDERS)):
        why = argv_problem(argv, key, accepted)
        if why:
            raise UsageError(f"{path}: {why}")
    if not any(field == "program" for word in data["invoke"] for _, field, _, _ in string.Formatter().parse(word)):
        raise UsageError(f"{path}: invoke={shown(data['invoke'])} never names {{program}}")
    if "command" in build:
        check_source_tree(path, data["source"], source)
    if prebuilt is not None:
        check_prebuilt(path, data, prebuilt)
    supports = data["supports"]
    state = data.get("state") or {}
    layout = state.get("layout", "bytes")
    if "tolerance" in state and layout == "bytes":
        raise UsageError(f"{path}: state.tolerance={state['tolerance']!r} needs a state.layout that says how to read "
                         "state.bin as numbers; accepted: float32, float16 (bytes are compared exactly)")
    precision = data.get("tolerance") or {}
    export = None
    if "export" in data:
        e = data["export"]
        if "hf" not in supports.get("model_formats", []):
            raise UsageError(f"{path}: export needs supports.model_formats to list hf (the exporter reads a Hugging "
                             f"Face folder); it lists {supports.get('model_formats', ['safetensors'])}")
        if source is None or not source.is_dir():
            raise UsageError(f"{path}: source={data.get('source')!r} is not a folder (relative to the yaml); the "
                             "exporter runs in it")
        fields = {"python", "source", "model", "out", *(k.replace(".", "_") for k in e.get("keys", []))}
        for part in e["command"]:
            for _, name, _, _ in string.Formatter().parse(part):
                if name is not None and name not in fields:
                    raise UsageError(f"{path}: export.command names {{{name}}}; accepted: "
                                     f"{', '.join('{' + f + '}' for f in sorted(fields))} (a key's placeholder "
                                     "needs it in export.keys)")
        if not any("{out}" in part for part in e["command"]) or not any("{model}" in part for part in e["command"]):
            raise UsageError(f"{path}: export.command={e['command']!r} must name {{model}} and {{out}}")
        export = ExportSpec(tuple(e["command"]), e["extra"], tuple(e["modules"]), tuple(e.get("keys", [])),
                            float(e.get("timeout_s", 3600)))
    return EngineSpec(
        name=data["name"], path=path, yaml_sha256=hashlib.sha256(raw).hexdigest(),
        description=data.get("description", ""), source=source,
        command=tuple(build["command"]) if "command" in build else None, prebuilt=prebuilt,
        program=data["program"], abis=tuple(data["abis"]), techniques=tuple(supports["techniques"]),
        model_formats=tuple(supports.get("model_formats", ["safetensors"])),
        weights=tuple(supports.get("weights", ["f32"])), cache=tuple(supports.get("cache", ["float32"])),
        invoke=tuple(data["invoke"]), timeout_s=float(data.get("timeout_s", 600)), counts=data.get("counts", "process"),
        state_in=bool(supports.get("state_in", False)), state_layout=layout,
        state_tolerance=float(state.get("tolerance", 0.0)),
        tolerance=tuple((k, float(v)) for k, v in precision.items() if k != "measured"),
        tolerance_measured=str(precision.get("measured", "")), export=export)

