"""A user's prefill_with_past module (seed 000's contract) as the engine under test:
`testbed run chunk_prefill backend=iree iree.artifact=DIR model.checkpoint=...`.

The folder is what an exporter (SKaiNET's FunctionGemmaExportHarness, testbed's `write_user_folder`)
leaves, with a manifest naming the contract:

    manifest.json    testbed.models.contract.write_manifest's form:
                       contract   {graph: prefill_with_past, version: 1, args, results}: every argument
                                  and result in order with its name, shape and dtype
                       files      {module: {path, sha256}, parameters: {path, sha256}} (paths relative
                                  to the folder; parameters only if the module loads any; sha256 optional)
                       function   the module's exported function (default: prefill_with_past)
                       parameter_scope  the scope its parameters are named in (default: model)
                       model      the model's config (optional; each of refimpl.gemma.GemmaConfig's fields
                                  it holds is checked against the run's model)
    the module       .mlir (compiled here for the device's target, once per content: the IREE cache)
                     or .vmfb (compiled by the user for the device)
    the parameters   the archive the module loads its weights from: .irpa, .safetensors or .gguf

Before anything runs, and before any record is stored, each of these is a UsageError (exit 2), one
line naming the file and the value: no folder or manifest; a manifest that is not a JSON object (of at
most 4 MiB); another contract or version; a manifest argument or result that is not the seed's contract
for the run's model (count, name, shape, dtype: the first that differs); `files` or an entry of another
kind, or a path leading out of the folder; a module or parameter file that is missing, of an unknown
kind or changed since its sha256 was written; a model config that differs; an MLIR file that does not
compile; a .vmfb IREE's runtime does not load (empty, random, an ELF, damaged); a module without the
function, or whose signature disagrees with the manifest (the first differing argument or result); a
.vmfb built for another kind of device. A module that fails on the device is a
device operation that failed (IreeRunFailed, exit 4).

The module runs ON the device (host, qemu-aarch64, lavapipe: testbed.backends.iree.device): each
call's inputs are pushed as .npy files, iree-run-module runs there, its outputs are pulled back for
the oracle (testbed.oracles.module_contract), which makes the inputs from the checkpoint and judges.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from refimpl.gemma import GemmaConfig
from testbed.backends import EvidenceLog
from testbed.backends.iree.artifacts import (PARAMETER_SCOPE, Artifact, ContractError, Graph, check_signature,
                                             compile_mlir_file, export_stablehlo)
from testbed.backends.iree.device import file_digest
from testbed.backends.iree.graphs.gemma import _convert
from testbed.errors import UsageError
from testbed.inputs import parse_json, read_bounded, shown
from testbed.models import contract as gemma_contract
from testbed.results import Figure

MANIFEST = "manifest.json"
MANIFEST_MAX_BYTES = 4 << 20
MODULE_KINDS = (".mlir", ".vmfb")
PARAMETER_KINDS = (".irpa", ".safetensors", ".gguf")
GRAPH = "prefill_with_past"


@dataclass(frozen=True)
class UserModule:
    """A user's folder, checked: the contract it follows (testbed.models.contract.Contract), the module
    to run (compiled from .mlir, or the user's .vmfb), its parameters, and the digests records carry."""

    folder: Path
    contract: gemma_contract.Contract
    source: Path                  # the user's module file (.mlir or .vmfb)
    module: Path                  # what runs: source itself, or its compile for the target
    parameters: Path | None
    function: str
    scope: str
    module_sha256: str            # of `source`
    manifest_sha256: str
    parameters_sha256: str | None = None

    @property
    def chunk(self) -> int:
        return self.contract.args[0].shape[0]

    @property
    def past(self) -> int:
        """The cache rows the module takes (k_0's second dimension)."""
        return self.contract.args[self.arg_index("k_0")].shape[1]

    def arg_index(self, name: str) -> int:
        return next(i for i, a in enumerate(self.contract.args) if a.name == name)

    def artifact(self) -> Artifact:
        """As testbed.backends.iree.device stages and runs artifacts."""
        c = _convert(self.contract)
        manifest = {**c.to_json(), "function": self.function, "module": self.module.name,
                    "parameters": {"scope": self.scope}}
        return Artifact(self.module.parent, manifest, self.parameters)

    def record_artifacts(self) -> dict:
        return {"user_folder": str(self.folder), "user_module": self.source.name,
                "user_module_sha256": self.module_sha256, "user_manifest_sha256": self.manifest_sha256,
                "user_parameters": self.parameters.name if self.parameters else None,
                "user_parameters_sha256": self.parameters_sha256}


# --- reading and checking a folder -----------------------------------------------------------------


def _spec(spec: gemma_contract.TensorSpec) -> str:
    return f"{spec.name} {spec.dtype}{list(spec.shape)}"


def _specs(items, where: str) -> tuple[gemma_contract.TensorSpec, ...]:
    try:
        return tuple(gemma_contract.TensorSpec(str(i["name"]), tuple(int(d) for d in i["shape"]), str(i["dtype"]))
                     for i in items)
    except (TypeError, KeyError, ValueError):
        raise UsageError(f"{where} is not a list of {{name, shape, dtype}} entries") from None


def contract_of(manifest: dict, path: Path) -> gemma_contract.Contract:
    """The manifest's contract, if it names the seed's: graph prefill_with_past, version 1."""
    c = manifest.get("contract")
    if not isinstance(c, dict):
        raise UsageError(f"{path}: no contract section; accepted: contract: {{graph: {GRAPH}, "
                         f"version: {gemma_contract.CONTRACT_VERSION}, args, results}}")
    graph, version = c.get("graph"), c.get("version")
    if graph != GRAPH or type(version) is not int or version != gemma_contract.CONTRACT_VERSION:
        raise UsageError(f"{path}: contract graph={shown(graph)} version={shown(version)} is not accepted; accepted: "
                         f"graph={GRAPH!r} version={gemma_contract.CONTRACT_VERSION} (seed 000's argument order)")
    return gemma_contract.Contract(GRAPH, version, _specs(c.get("args", []), f"{path}: contract.args"),
                                   _specs(c.get("results", []), f"{path}: contract.results"))


def check_against_seed(contract: gemma_contract.Contract, model: GemmaConfig, path: Path) -> None:
    """The manifest's arguments and results against the seed's contract for the run's model at the
    manifest's own chunk (tokens) and cache rows (k_0): the first that differs, by index and name."""
    args = {a.name: a for a in contract.args}
    if "tokens" not in args or "k_0" not in args or len(args["k_0"].shape) != 3:
        raise UsageError(f"{path}: contract.args lacks tokens or k_0 [kv_heads, rows, head_dim]; the seed's "
                         f"contract begins tokens, then the first layer's tables and k_0")
    want = gemma_contract.prefill_with_past_contract(model, args["tokens"].shape[0], args["k_0"].shape[1])
    for kind, got, need in (("argument", contract.args, want.args), ("result", contract.results, want.results)):
        for i in range(max(len(got), len(need))):
            g = _spec(got[i]) if i < len(got) else "nothing"
            n = _spec(need[i]) if i < len(need) else "nothing"
            if g != n:
                raise UsageError(f"{path}: {kind} {i} is {g}; the seed's contract for this model "
                                 f"({model.layers} layers, {len(need)} {kind}s, the manifest has {len(got)}) "
                                 f"says {n}")


def _file(folder: Path, manifest: dict, key: str, kinds: tuple[str, ...], path: Path,
          required: bool) -> tuple[Path | None, str | None]:
    accepted = f"files: {{{key}: {{path: NAME, sha256: ...}}}} with NAME a *{', *'.join(kinds)} file in the folder"
    files = manifest.get("files") or {}
    if not isinstance(files, dict):
        raise UsageError(f"{path}: files={shown(files)} is not accepted; accepted: {accepted}")
    entry = files.get(key)
    if entry is None:
        if required:
            raise UsageError(f"{path}: files.{key} is not set; accepted: {accepted}")
        return None, None
    name = entry.get("path") if isinstance(entry, dict) else entry
    said = entry.get("sha256") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not isinstance(said, (str, type(None))) or "\0" in name \
            or Path(name).is_absolute() or ".." in Path(name).parts or Path(name).suffix not in kinds:
        raise UsageError(f"{path}: files.{key}={shown(entry)} is not accepted; accepted: {accepted}")
    file = folder / name
    try:
        if not file.is_file():
            raise UsageError(f"{path}: files.{key}={name!r}: {file} is missing")
        digest = file_digest(file)
    except OSError as e:
        raise UsageError(f"{path}: files.{key}={shown(name)} cannot be read: {e.strerror}") from None
    if said and said != digest:
        raise UsageError(f"{path}: files.{key}={name!r} has sha256 {digest[:16]}..., the manifest says "
                         f"{said[:16]}...: the file changed since the manifest was written")
    return file, digest


def check_model(manifest: dict, model: GemmaConfig, path: Path) -> None:
    said = manifest.get("model")
    if not isinstance(said, dict):
        return
    mine = json.loads(json.dumps(dataclasses.asdict(model)))  # tuples as lists, as a manifest holds them
    # the fields testbed's model has; an exporter's other keys (its own names, paths) are its business
    for key in sorted(set(said) & set(mine)):
        if said.get(key) != mine.get(key):
            raise UsageError(f"{path}: model.{key}={shown(said.get(key))}, the run's model has {shown(mine.get(key))} "
                             f"(model.checkpoint / model.preset)")


def module_declaration(module: Path, function: str) -> str:
    """The exported function's signature (IREE's iree.abi.declaration reflection), read on the host
    without a HAL device: a module's bytecode loads for any target."""
    import iree.runtime as rt

    if module.stat().st_size == 0:
        raise UsageError(f"{module}: the module is empty; accepted: a .vmfb IREE compiled (or the .mlir it compiles)")
    try:
        vm = rt.VmModule.mmap(rt.VmInstance(), str(module))
    except (ValueError, IndexError, RuntimeError, OSError) as e:  # IREE's loader and verifier, by status code
        said = str(e).splitlines()[0].removeprefix("Error creating vm module from aligned memory: ")
        said = re.sub(r"^\S+\.c:\d+: ", "", said)  # IREE's source location
        raise UsageError(f"{module}: not a module IREE's runtime loads ({said}); accepted: a .vmfb IREE compiled "
                         f"(or the .mlir it compiles)") from None
    found = vm.lookup_function(function)
    if found is None:
        raise UsageError(f"{module.name} exports no function {function!r}; it has {', '.join(vm.function_names)} "
                         f"(manifest key: function)")
    return found.reflection.get("iree.abi.declaration", "")


def load(folder: str | Path, model: GemmaConfig, target: str,
         progress: Callable[[str], None] = lambda msg: None) -> UserModule:
    """The folder, checked against the seed's contract for `model`, its module compiled for `target`
    if it is MLIR; every problem a one-line UsageError (see the module docstring)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"iree.artifact={str(folder)!r} is not a folder; accepted: a folder holding {MANIFEST}, "
                         f"the module (*.mlir or *.vmfb) and its parameters")
    path = folder / MANIFEST
    if not path.is_file():
        raise UsageError(f"{folder} has no {MANIFEST}; accepted: a folder holding {MANIFEST} (the contract and the "
                         f"files), the module and its parameters")
    manifest = parse_json(read_bounded(path, MANIFEST_MAX_BYTES, str(path), "a manifest of the seed's 44 arguments "
                                       "is about 10 kB"), str(path), kind=dict)
    for key in ("function", "parameter_scope"):
        if not isinstance(manifest.get(key, ""), (str, type(None))):
            raise UsageError(f"{path}: {key}={shown(manifest[key])} is not accepted; accepted: a name (a string)")
    contract = contract_of(manifest, path)
    check_against_seed(contract, model, path)
    check_model(manifest, model, path)
    source, module_sha = _file(folder, manifest, "module", MODULE_KINDS, path, required=True)
    parameters, parameters_sha = _file(folder, manifest, "parameters", PARAMETER_KINDS, path, required=False)
    function = str(manifest.get("function") or GRAPH)
    module = source
    if source.suffix == ".mlir":
        try:
            module = compile_mlir_file(source, target, progress=progress)
        except RuntimeError as e:
            raise UsageError(f"{source} does not compile for target={target}: "
                             f"{' '.join(str(e).splitlines()[1:3]).strip() or e}") from None
    try:
        check_signature(_convert(contract), module_declaration(module, function))
    except ContractError as e:
        raise UsageError(f"{source.name} disagrees with {path}: {e}") from None
    return UserModule(folder, contract, source, module, parameters, function,
                      str(manifest.get("parameter_scope") or PARAMETER_SCOPE), module_sha, file_digest(path),
                      parameters_sha)


# --- running it on the device ----------------------------------------------------------------------


class UserModuleRunner:
    """A checked user module on one device: `call(args)` runs it once on arrays in the contract's order
    and returns its results; `bench(args)` times one call there (iree-benchmark-module)."""

    name = "iree"

    def __init__(self, user: UserModule, iree):
        self.user, self.iree = user, iree
        self._staged = None

    @property
    def evidence(self) -> EvidenceLog:
        return self.iree.evidence

    def staged(self):
        if self._staged is None:
            self._staged = self.iree.stage(self.user.artifact())
        return self._staged

    def call(self, args: Sequence[np.ndarray]) -> list[np.ndarray]:
        gemma_contract.check_args(self.user.contract, list(args))
        outputs = [f"result{i}.npy" for i in range(len(self.user.contract.results))]
        with self.iree.folder() as run:
            inputs = [run.put(f"arg{i}.npy", a) for i, a in enumerate(args)]
            self.iree.run(run, self.staged(), inputs, outputs)
            return [run.get(o) for o in outputs]

    def bench(self, args: Sequence[np.ndarray], reps: int, warmup: int) -> Figure:
        """Seconds per call by the device's clock; `warmup` repetitions run and dropped."""
        with self.iree.folder() as run:
            inputs = [run.put(f"arg{i}.npy", a) for i, a in enumerate(args)]
            samples = [self.iree.benchmark(run, self.staged(), inputs).median for _ in range(warmup + reps)]
        return Figure.of(samples[warmup:], "s")


# --- testbed's own module written out as a user's folder -------------------------------------------


def write_user_folder(folder: str | Path, graph: Graph, model: GemmaConfig, form: str = "mlir",
                      target: str = "host", manifest_contract: gemma_contract.Contract | None = None) -> Path:
    """`graph` (testbed.backends.iree.graphs.gemma.prefill_with_past, or any Graph of that contract)
    written out as a user's exporter would: module.mlir (StableHLO; form="mlir") or module.vmfb
    compiled for `target` (form="vmfb"), its weights as parameters.irpa, and manifest.json naming the
    contract (`manifest_contract`, default the graph's own signature, as an exporter writes it)."""
    import shutil

    from testbed.backends.iree.artifacts import compile_graph

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    if form == "mlir":
        (folder / "module.mlir").write_text(export_stablehlo(graph))
        files["module"] = folder / "module.mlir"
    elif form == "vmfb":
        shutil.copyfile(compile_graph(graph, target).module, folder / "module.vmfb")
        files["module"] = folder / "module.vmfb"
    else:
        raise UsageError(f"form={form!r} is not accepted; accepted: mlir, vmfb")
    if graph.weights and not graph.weights_as_constants:
        import iree.runtime as rt

        index = rt.ParameterIndex()
        for key, w in graph.weights.items():
            index.add_buffer(key, np.ascontiguousarray(w).tobytes())
        index.create_archive_file(str(folder / "parameters.irpa"))
        files["parameters"] = folder / "parameters.irpa"
    contract = manifest_contract or gemma_contract.Contract(
        GRAPH, gemma_contract.CONTRACT_VERSION,
        tuple(gemma_contract.TensorSpec(a.name, a.shape, a.dtype) for a in graph.contract.args),
        tuple(gemma_contract.TensorSpec(r.name, r.shape, r.dtype) for r in graph.contract.results))
    manifest = gemma_contract.write_manifest(folder / MANIFEST, contract, model, {}, {
        "function": graph.contract.function, "parameter_scope": PARAMETER_SCOPE,
        "files": {k: {"path": p.name, "sha256": gemma_contract.sha256_file(p)} for k, p in files.items()}})
    return manifest.parent


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m testbed.backends.iree.user_module OUT [--checkpoint DIR | --preset tiny|functiongemma]
    [--chunk C] [--past R] [--form mlir|vmfb] [--target T]`: testbed's own prefill_with_past for a model
    written out as a user's folder, to run as `testbed run chunk_prefill backend=iree iree.artifact=OUT`
    with the same model (model.checkpoint=DIR, or model.preset with its seeded weights)."""
    import argparse

    from refimpl import gemma
    from testbed.backends.iree.graphs.gemma import prefill_with_past
    from testbed.models.checkpoints import load_checkpoint

    parser = argparse.ArgumentParser(prog="python -m testbed.backends.iree.user_module", description=main.__doc__)
    parser.add_argument("out")
    parser.add_argument("--checkpoint", help="a Hugging Face folder or .gguf (else --preset's seeded weights)")
    parser.add_argument("--preset", choices=("tiny", "functiongemma"), default="tiny")
    parser.add_argument("--weights-seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--past", type=int, default=800, help="the cache rows the module takes")
    parser.add_argument("--form", choices=("mlir", "vmfb"), default="mlir")
    parser.add_argument("--target", default="host", help="for --form vmfb: experiments/iree_target/NAME")
    a = parser.parse_args(argv)
    if a.checkpoint:
        cfg, w = load_checkpoint(a.checkpoint)
    else:
        cfg = {"tiny": gemma.tiny_config, "functiongemma": gemma.functiongemma_config}[a.preset]()
        w = gemma.init_weights(cfg, a.weights_seed)
    out = write_user_folder(a.out, prefill_with_past(cfg, w, a.chunk, a.past), cfg, a.form, a.target)
    print(f"{out}: prefill_with_past C={a.chunk} against {a.past} cache rows, {cfg.layers} layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
