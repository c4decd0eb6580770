"""engines/NAME.yaml: an engine under test as engine contract v1 describes it
(engines/contract-v1.schema.json). A file that breaks the schema is one line naming the file and the
key, exit 2.

An engine with an `export:` section is exporter-based (ExecuTorch, ONNX Runtime, LiteRT, MNN): its
exporter runs on the host, once per content, from the Hugging Face folder testbed hands it, and its
program reads the exporter's output as request/model/ (testbed.backends.engine.export)."""

from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from testbed.config import lab_dir
from testbed.errors import UsageError, did_you_mean

CONTRACT_VERSION = 1
PROJECT_ENGINES = Path(__file__).resolve().parents[3] / "engines"
SCHEMA_FILE = PROJECT_ENGINES / f"contract-v{CONTRACT_VERSION}.schema.json"
TARGETS = ("host", "arm32", "aarch64", "hexagon")
TECHNIQUES = ("chunk_prefill", "tail", "hybrid")


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
    export: ExportSpec | None = None  # exporter-based: the program reads the exporter's output

    def identity(self) -> dict:
        return {"engine": self.name, "engine_yaml": str(self.path), "engine_yaml_sha256": self.yaml_sha256}


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


def _problem(node: Any, rule: dict, key: str) -> str | None:
    """What is wrong with `node` under the schema `rule` (the subset contract-v1.schema.json uses), or None.
    `key` is the dotted key being checked, for nested problems."""
    if "const" in rule and node != rule["const"]:
        return f"{key}={node!r}; accepted: {rule['const']!r}"
    if "enum" in rule and node not in rule["enum"]:
        return f"{key}={node!r}{did_you_mean(node, rule['enum'])}; accepted: {', '.join(map(str, rule['enum']))}"
    kind = rule.get("type")
    if kind == "string" and not isinstance(node, str):
        return f"{key}={node!r} is not a string"
    if kind == "number" and (isinstance(node, bool) or not isinstance(node, (int, float))):
        return f"{key}={node!r} is not a number"
    if kind == "number" and "exclusiveMinimum" in rule and not node > rule["exclusiveMinimum"]:
        return f"{key}={node!r}; accepted: a number > {rule['exclusiveMinimum']}"
    if kind == "string" and "pattern" in rule:
        import re

        if not re.search(rule["pattern"], node):
            return f"{key}={node!r} does not match {rule['pattern']}"
    if kind == "array":
        if not isinstance(node, list):
            return f"{key}={node!r} is not a list"
        if len(node) < rule.get("minItems", 0):
            return f"{key} is empty; accepted: at least {rule['minItems']} item(s)"
        if rule.get("uniqueItems") and len(set(map(str, node))) != len(node):
            return f"{key}={node!r} repeats an item"
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


def parse(path: Path) -> EngineSpec:
    """engines/NAME.yaml, validated against the schema; every problem one line: the file and the key."""
    path = Path(path)
    raw = path.read_bytes()
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UsageError(f"{path}:{where} is not YAML: {getattr(e, 'problem', e)}") from None
    why = _problem(data, schema(), "")
    if why:
        raise UsageError(f"{path}: {why}")
    if data["name"] != path.stem:
        raise UsageError(f"{path}: name={data['name']!r} must equal the file's stem {path.stem!r}")
    build = data.get("build") or {}
    source = (path.parent / data["source"]).resolve() if "source" in data else None
    if "command" in build and (source is None or not source.is_dir()):
        raise UsageError(f"{path}: source={data.get('source')!r} is not a folder (relative to the yaml); a build "
                         "command runs in it")
    # a prebuilt program is named relative to the engine's source where it has one and the file is there
    # (engines/onnxruntime.yaml: source onnxruntime, prebuilt adapter.py), else relative to the yaml
    prebuilt = {t: (source / p if source is not None and (source / p).is_file() else path.parent / p).resolve()
                for t, p in build.get("prebuilt", {}).items()} if "prebuilt" in build else None
    if prebuilt is None and "command" not in build:
        raise UsageError(f"{path}: build is missing; accepted: build.command (argv) or build.prebuilt (a path per ABI)")
    if "{program}" not in data["invoke"] and not any("{program}" in a for a in data["invoke"]):
        raise UsageError(f"{path}: invoke={data['invoke']!r} never names {{program}}")
    supports = data["supports"]
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
        export=export)

