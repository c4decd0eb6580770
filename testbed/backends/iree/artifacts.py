"""IREE artifacts: a jax graph exported to StableHLO, compiled for a named target, cached by content.

An artifact is a folder that says everything needed to run and to rebuild it:

    module.vmfb              the compiled module
    graph.mlir               the StableHLO text it was compiled from
    manifest.json            the contract (function, argument and result names, shapes, dtypes), the
                             target, the parameter names the module loads, the cache key
    compile_command.sh       the exact iree-compile command line
    compiler_version.txt     `iree-compile --version`
    flags.txt                the target's flags, one a line
    parameters-<digest>.irpa parameter archives (weights), one per set of weights; any archive with
                             the manifest's names and shapes serves the same module (hard links to
                             the cache's parameters/ store, so modules of one model share the bytes)

The folder's name carries a hash of the graph text, the contract's shapes, the compiler version and
the flags, so the same graph for the same target compiles once; weights are not in the key when they
are module parameters (one module, many weights), and they are in the graph text when constants.
A folder is written under a temporary name and renamed when complete, so an interrupted compile
leaves nothing that could be mistaken for an artifact.

Targets are named configs, experiments/iree_target/NAME.yaml: their flags, the device kind the module
needs (local or vulkan), the Vulkan device name they were built for, and whether they run here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
from omegaconf import OmegaConf

from testbed import PROJECT_ROOT, children
from testbed.config import CONFIG_DIR
from testbed.errors import UsageError
from testbed.heartbeat import heartbeat

TARGETS_DIR = CONFIG_DIR / "iree_target"
CACHE_DIR = PROJECT_ROOT / ".cache" / "iree"
PARAMETER_SCOPE = "model"
MLIR_DTYPES = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16", "int64": "i64",
               "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "ui8", "bool": "i1"}


class ContractError(Exception):
    """A module, its manifest or the arrays handed to it disagree; the message names the first
    differing argument or result."""


# --- targets ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    device_kind: str                 # "local" (CPU, llvm-cpu) or "vulkan"
    flags: tuple[str, ...]
    drivers: tuple[str, ...]         # runtime drivers that load the module; the first is the default
    runs_here: bool
    vulkan_device: str | None = None  # a Vulkan device runs the module only if its name contains this


def target_names() -> list[str]:
    return sorted(p.stem for p in TARGETS_DIR.glob("*.yaml"))


def load_target(name: str) -> Target:
    if name not in target_names():
        raise UsageError(f"unknown IREE target {name!r}; accepted: {', '.join(target_names())}")
    data = OmegaConf.to_container(OmegaConf.load(TARGETS_DIR / f"{name}.yaml"), resolve=True)
    return Target(name=name, description=data["description"], device_kind=data["device_kind"],
                  flags=tuple(data["flags"]), drivers=tuple(data["drivers"]), runs_here=bool(data["runs_here"]),
                  vulkan_device=data.get("vulkan_device"))


# --- the contract ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def like(cls, name: str, array) -> "TensorSpec":
        return cls(name, tuple(int(d) for d in array.shape), np.dtype(array.dtype).name)

    @property
    def mlir(self) -> str:
        """The type as MLIR and the module's reflection spell it: tensor<2x4xf32>."""
        return "tensor<" + "".join(f"{d}x" for d in self.shape) + MLIR_DTYPES[self.dtype] + ">"


@dataclass(frozen=True)
class Contract:
    """A function's calling convention: the order, shapes and dtypes of its arguments and results."""

    function: str
    args: tuple[TensorSpec, ...]
    results: tuple[TensorSpec, ...]

    def to_json(self) -> dict:
        return {"function": self.function, "args": [asdict(a) for a in self.args],
                "results": [asdict(r) for r in self.results]}

    @classmethod
    def from_json(cls, data: Mapping) -> "Contract":
        def specs(items):
            return tuple(TensorSpec(i["name"], tuple(i["shape"]), i["dtype"]) for i in items)

        return cls(data["function"], specs(data["args"]), specs(data["results"]))

    def check_inputs(self, arrays: Sequence[np.ndarray]) -> None:
        """The arrays a caller hands over, against the argument list."""
        if len(arrays) != len(self.args):
            raise ContractError(f"{self.function}: {len(arrays)} inputs given, the contract has "
                                f"{len(self.args)} arguments")
        for i, (spec, a) in enumerate(zip(self.args, arrays)):
            got = TensorSpec.like(spec.name, a)
            if got != spec:
                raise ContractError(f"{self.function}: argument {i} ({spec.name}) is {got.mlir}, "
                                    f"the contract says {spec.mlir}")


_DECLARATION = re.compile(r"@(?P<fn>[\w$.]+)\((?P<args>.*)\)\s*->\s*(?P<results>.*)$")
_TYPED = re.compile(r"%\w+:\s*(tensor<[^>]*>|[\w!.<>]+)")


def parse_declaration(declaration: str) -> tuple[str, list[str], list[str]]:
    """`sync func @f(%input0: tensor<2x4xf32>) -> (%output0: tensor<2x4xf32>)` -> (f, args, results),
    the form of IREE's `iree.abi.declaration` reflection attribute."""
    m = _DECLARATION.search(declaration)
    if m is None:
        raise ContractError(f"cannot read the module's signature {declaration!r}")
    return m["fn"], _TYPED.findall(m["args"]), _TYPED.findall(m["results"])


def check_signature(contract: Contract, declaration: str) -> None:
    """The contract against a compiled module's signature: counts, then each argument and result in
    order; a mismatch names the first one that differs."""
    fn, args, results = parse_declaration(declaration)
    for kind, specs, types in (("argument", contract.args, args), ("result", contract.results, results)):
        for i, spec in enumerate(specs):
            module_type = types[i] if i < len(types) else "nothing"
            if module_type != spec.mlir:
                raise ContractError(
                    f"{contract.function}: {kind} {i} ({spec.name}) is {spec.mlir} in the contract but "
                    f"{module_type} in the module's @{fn} ({len(types)} {kind}s vs {len(specs)})")
        if len(types) > len(specs):
            raise ContractError(f"{contract.function}: the module's @{fn} has {len(types)} {kind}s, the "
                                f"contract {len(specs)}; first extra: {kind} {len(specs)} {types[len(specs)]}")


# --- graphs and export -----------------------------------------------------------------------------


@dataclass
class Graph:
    """A jax function and its contract. `fn(weights, *args)` takes the weights as a dict of arrays
    and the contract's arguments in order, and returns the contract's results as a tuple.

    Weights become module parameters (`util.global` loaded from a parameter archive) unless
    `weights_as_constants`, which folds them into the graph text."""

    name: str
    fn: Callable
    contract: Contract
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    weights_as_constants: bool = False

    def weight_specs(self) -> list[TensorSpec]:
        return [TensorSpec.like(n, w) for n, w in self.weights.items()]


def export_stablehlo(graph: Graph) -> str:
    """Lower `graph` with jax to StableHLO text whose public function is the contract's."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    arg_structs = [jax.ShapeDtypeStruct(a.shape, np.dtype(a.dtype)) for a in graph.contract.args]
    names = list(graph.weights)
    if graph.weights_as_constants or not names:
        weights = {n: np.asarray(w) for n, w in graph.weights.items()}
        text = jax.jit(lambda *args: tuple(graph.fn(weights, *args)), keep_unused=True).lower(*arg_structs).as_text()
        return _rename_main(text, graph.contract.function, public=True)

    weight_structs = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in graph.weights.values()]

    def with_weights(*flat):
        return tuple(graph.fn(dict(zip(names, flat[: len(names)])), *flat[len(names):]))

    text = jax.jit(with_weights, keep_unused=True).lower(*weight_structs, *arg_structs).as_text()
    body = f"{graph.contract.function}$graph"
    text = _rename_main(text, body, public=False)
    return _insert_before_module_end(text, _parameter_wrapper(graph, body))


def _rename_main(text: str, name: str, public: bool) -> str:
    visibility = "public" if public else "private"
    renamed = text.replace("func.func public @main(", f'func.func {visibility} @"{name}"(', 1)
    if renamed == text:
        raise RuntimeError("jax's lowering has no public @main; the export convention changed")
    return renamed


def _insert_before_module_end(text: str, addition: str) -> str:
    end = text.rstrip().rfind("}")
    return text[:end] + addition + text[end:]


def _parameter_wrapper(graph: Graph, body: str) -> str:
    """The public function: load each weight from its global (initialised from the parameter
    archive by name) and call the lowered graph with weights first, then the caller's arguments."""
    c = graph.contract
    lines = []
    for i, spec in enumerate(graph.weight_specs()):
        lines.append(f'  util.global private @weight{i} = #stream.parameter.named<"{PARAMETER_SCOPE}"::'
                     f'"{spec.name}"> : {spec.mlir}')
    arg_list = ", ".join(f"%arg{i}: {a.mlir}" for i, a in enumerate(c.args))
    result_types = ", ".join(r.mlir for r in c.results)
    lines.append(f'  func.func @"{c.function}"({arg_list}) -> ({result_types}) {{')
    for i, spec in enumerate(graph.weight_specs()):
        lines.append(f"    %w{i} = util.global.load @weight{i} : {spec.mlir}")
    operands = [f"%w{i}" for i in range(len(graph.weights))] + [f"%arg{i}" for i in range(len(c.args))]
    operand_types = [w.mlir for w in graph.weight_specs()] + [a.mlir for a in c.args]
    lines.append(f'    %r:{len(c.results)} = func.call @"{body}"({", ".join(operands)}) : '
                 f'({", ".join(operand_types)}) -> ({result_types})')
    returned = ", ".join(f"%r#{i}" for i in range(len(c.results)))
    lines.append(f"    return {returned} : {result_types}")
    lines.append("  }")
    return "\n" + "\n".join(lines) + "\n"


# --- compile and cache -----------------------------------------------------------------------------


def compiler_path() -> str:
    from iree.compiler.tools.binaries import find_tool

    return find_tool("iree-compile")


@lru_cache(maxsize=1)
def compiler_version() -> str:
    out = children.run([compiler_path(), "--version"], capture_output=True, text=True, check=True)
    return " ".join(line.strip() for line in out.stdout.splitlines() if "version" in line.lower())


def cache_key(graph_text: str, contract: Contract, weight_specs: list[TensorSpec], flags: Sequence[str]) -> str:
    h = hashlib.sha256()
    for part in (graph_text, json.dumps(contract.to_json(), sort_keys=True),
                 json.dumps([asdict(w) for w in weight_specs]), compiler_version(), "\n".join(flags)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def weights_digest(weights: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name, w in weights.items():
        w = np.ascontiguousarray(w)
        h.update(f"{name}{w.dtype.str}{w.shape}".encode())
        h.update(w.tobytes())
    return h.hexdigest()


@dataclass
class Artifact:
    """A compiled module folder (built here or brought by a user) and the parameter archive to run
    it with."""

    folder: Path
    manifest: dict
    parameters: Path | None = None
    compiled: bool = False            # True when this call compiled it, False on a cache hit
    compile_seconds: float | None = None

    @property
    def module(self) -> Path:
        return self.folder / self.manifest.get("module", "module.vmfb")

    @property
    def contract(self) -> Contract:
        return Contract.from_json(self.manifest)

    @property
    def target(self) -> dict:
        return self.manifest.get("target", {})

    @classmethod
    def load(cls, folder: str | Path, parameters: str | Path | None = None) -> "Artifact":
        """A user's artifact: a folder with manifest.json (the contract, optionally `module` and
        `parameters` file names and a `target` section) and the module."""
        folder = Path(folder)
        path = folder / "manifest.json"
        if not path.is_file():
            raise UsageError(f"{folder} has no manifest.json; an artifact folder holds module, parameters "
                             "and manifest.json with function, args and results")
        manifest = json.loads(path.read_text())
        missing = [k for k in ("function", "args", "results") if k not in manifest]
        if missing:
            raise UsageError(f"{path}: missing {', '.join(missing)}; a manifest needs function, args, results")
        if parameters is None and manifest.get("parameters", {}).get("archive"):
            parameters = folder / manifest["parameters"]["archive"]
        artifact = cls(folder, manifest, Path(parameters) if parameters else None)
        if not artifact.module.is_file():
            raise UsageError(f"{folder}: module {artifact.module.name!r} not found")
        return artifact


def compile_graph(graph: Graph, target: Target | str, cache_dir: Path | None = None,
                  progress: Callable[[str], None] = lambda msg: None) -> Artifact:
    """Export, compile (unless the cache has it) and write the weights' parameter archive."""
    target = load_target(target) if isinstance(target, str) else target
    cache_dir = Path(cache_dir) if cache_dir else CACHE_DIR
    text = export_stablehlo(graph)
    as_parameters = bool(graph.weights) and not graph.weights_as_constants
    weight_specs = graph.weight_specs() if as_parameters else []
    key = cache_key(text, graph.contract, weight_specs, target.flags)
    folder = cache_dir / f"{graph.name}-{target.name}-{key[:16]}"
    compiled, seconds = False, None
    if not (folder / "manifest.json").is_file():
        seconds = _compile_into(folder, text, graph, target, key, weight_specs, progress)
        compiled = True
    parameters = _write_parameters(folder, graph.weights) if as_parameters else None
    manifest = json.loads((folder / "manifest.json").read_text())
    return Artifact(folder, manifest, parameters, compiled, seconds)


def _compile_into(folder: Path, text: str, graph: Graph, target: Target, key: str,
                  weight_specs: list[TensorSpec], progress: Callable[[str], None]) -> float:
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        (staging / "graph.mlir").write_text(text)
        command = [compiler_path(), "--iree-input-type=stablehlo", *target.flags,
                   "graph.mlir", "-o", "module.vmfb"]
        t0 = time.perf_counter()
        _run_compiler(command, staging, f"compiling {graph.name} for {target.name}", progress)
        seconds = time.perf_counter() - t0
        (staging / "compile_command.sh").write_text(
            f"# run in this folder; took {seconds:.1f} s\n" + shlex.join(["iree-compile", *command[1:]]) + "\n")
        (staging / "compiler_version.txt").write_text(compiler_version() + "\n")
        (staging / "flags.txt").write_text("\n".join(target.flags) + "\n")
        manifest = {
            **graph.contract.to_json(),
            "module": "module.vmfb",
            "target": {"name": target.name, "device_kind": target.device_kind,
                       "vulkan_device": target.vulkan_device, "flags": list(target.flags)},
            "parameters": {"scope": PARAMETER_SCOPE, "entries": [asdict(w) for w in weight_specs]},
            "compiler_version": compiler_version(),
            "cache_key": key,
            "compile_seconds": round(seconds, 2),
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        try:
            os.rename(staging, folder)
        except OSError:  # another process finished the same artifact first: theirs is identical
            shutil.rmtree(staging, ignore_errors=True)
        return seconds
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def compile_mlir_file(mlir: Path, target: Target | str, cache_dir: Path | None = None,
                      progress: Callable[[str], None] = lambda msg: None) -> Path:
    """Someone else's MLIR file compiled for `target`, once per content: the cache folder's name carries
    a hash of the file's bytes, the target's flags and the compiler version. The input dialect is
    detected by the compiler (`--iree-input-type=auto`: StableHLO from jax or SKaiNET, linalg, ...).
    Returns the compiled module.vmfb."""
    target = load_target(target) if isinstance(target, str) else target
    cache_dir = Path(cache_dir) if cache_dir else CACHE_DIR
    h = hashlib.sha256()
    for part in (mlir.read_bytes(), compiler_version().encode(), "\n".join(target.flags).encode()):
        h.update(part)
        h.update(b"\0")
    folder = cache_dir / f"user-{mlir.stem}-{target.name}-{h.hexdigest()[:16]}"
    if (folder / "module.vmfb").is_file():
        return folder / "module.vmfb"
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        shutil.copyfile(mlir, staging / "graph.mlir")
        command = [compiler_path(), "--iree-input-type=auto", *target.flags, "graph.mlir", "-o", "module.vmfb"]
        _run_compiler(command, staging, f"compiling {mlir.name} for {target.name}", progress)
        (staging / "compile_command.sh").write_text(shlex.join(["iree-compile", *command[1:]]) + "\n")
        try:
            os.rename(staging, folder)
        except OSError:  # another process compiled the same file first: theirs is identical
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder / "module.vmfb"


def _run_compiler(command: list[str], cwd: Path, what: str, progress: Callable[[str], None]) -> None:
    """Run the compiler with a heartbeat through `progress` (iree-compile prints nothing while it
    works, and a large graph takes minutes)."""
    progress(f"{what} ...")
    t0 = time.perf_counter()
    with heartbeat(what, progress):
        out = children.run(command, cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"iree-compile failed ({what}), exit {out.returncode}:\n"
                           + "\n".join(out.stderr.strip().splitlines()[:20]))
    progress(f"{what}: done in {time.perf_counter() - t0:.1f} s")


def _write_parameters(folder: Path, weights: Mapping[str, np.ndarray]) -> Path:
    """The weights as an IREE parameter archive (.irpa) named by their digest, written once into the
    cache's parameter store and hard-linked into each artifact folder that uses them (the chunk and
    decode modules of one model share a gigabyte of weights, not copy it)."""
    import iree.runtime as rt

    name = f"parameters-{weights_digest(weights)[:16]}.irpa"
    path = folder / name
    if path.is_file():
        return path
    stored = folder.parent / "parameters" / name
    if not stored.is_file():
        stored.parent.mkdir(parents=True, exist_ok=True)
        index = rt.ParameterIndex()
        for key, w in weights.items():
            index.add_buffer(key, np.ascontiguousarray(w).tobytes())
        partial = stored.with_name(f".{name}.{os.getpid()}")
        index.create_archive_file(str(partial))
        os.replace(partial, stored)
    try:
        os.link(stored, path)
    except FileExistsError:
        pass
    except OSError:  # a file system without hard links
        shutil.copyfile(stored, path)
    return path
