"""One request/response exchange of engine contract v1 with an engine on a device.

The request folder (request.json, request.args, tokens.npy, and the model file as a link to its copy
pushed once per content) is pushed to runs/ID/request; the engine runs in runs/ID as
`invoke` says (through tb_peak_rss where its peak RSS can be read: testbed.backends.engine.peak_rss),
writes runs/ID/response; an exporter-based engine's model is its exporter's output, made on the host
once per content (testbed.backends.engine.export); everything it must write is pulled and checked before an
oracle sees it: status.json's version and status, logits.npy's dtype, shape and finiteness,
state.bin when asked, cache/ when present, timings.json. Whatever is wrong is a ContractError (exit 4)
naming the file and the value; a refusal is a Response with status "refused" (the experiments record
it as "not supported").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from testbed.backends import Evidence
from testbed.backends.engine import export as exporting, peak_rss
from testbed.backends.engine.spec import CONTRACT_VERSION, EngineSpec
from testbed.backends.native.build import target_for_abi
from testbed.backends.native.device import check_machine, program_digest, program_identity, pull_dumps, \
    runner_prefix, stage_folder, stage_program
from testbed.devices import Device
from testbed.devices.transport import CommandTimeout, elf_machine, quoted
from testbed.errors import DeviceError, UsageError
from testbed.measure import counts as counting


class ContractError(DeviceError):
    """The engine's response breaks the contract (a file missing, of the wrong shape or dtype, NaN, another
    version), or the engine failed (non-zero exit, timeout): exit 4, and never a pass."""


@dataclass
class Request:
    """What testbed asks of an engine (README, "Engine under test"; CONTRACT's request.json)."""

    technique: str
    tokens: np.ndarray
    model_file: Path
    model_format: str = "safetensors"
    weights: str = "f32"
    config: dict = field(default_factory=dict)
    past: int = 0
    chunk: int = 1
    logits_at: list[int] = field(default_factory=list)
    tail_mode: str = "none"
    cache: dict = field(default_factory=lambda: {"dtype": "float32", "window": 0, "sink": 0})
    state: bool = False
    threads: int = 1
    bench: dict | None = None
    count: bool = False
    rs_snapshots: int = 0  # recurrent-state snapshots kept for rollback (llama.cpp's n_rs_seq); sent when > 0

    @property
    def model_name(self) -> str:
        """The model's name in the request folder: model.safetensors, model.gguf, or the folder model/ (hf)."""
        return "model" if self.model_format == "hf" else f"model.{self.model_format}"

    def as_json(self) -> dict:
        return {"contract": CONTRACT_VERSION, "technique": self.technique,
                "model": {"format": self.model_format, "file": self.model_name, "weights": self.weights,
                          "config": self.config},
                "tokens": "tokens.npy", "n_tokens": int(np.asarray(self.tokens).size), "past": self.past,
                "chunk": self.chunk, "logits_at": [int(p) for p in self.logits_at], "tail": {"mode": self.tail_mode},
                "cache": self.cache, "state": self.state, "threads": self.threads, "bench": self.bench,
                "count": self.count, **({"rs_snapshots": self.rs_snapshots} if self.rs_snapshots else {})}


def args_text(request: dict) -> str:
    """request.json flattened for programs that parse no JSON: key=value lines, nested keys dotted, lists
    comma-separated, booleans 1/0, null left out."""
    lines = []

    def walk(node, prefix):
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, name + ".")
            elif isinstance(value, bool):
                lines.append(f"{name}={int(value)}")
            elif isinstance(value, (list, tuple)):
                lines.append(f"{name}={','.join(map(str, value))}")
            elif value is not None:
                lines.append(f"{name}={value}")

    walk(request, "")
    return "\n".join(lines) + "\n"


@dataclass
class Response:
    status: str                          # "ok" | "refused"
    reason: str = ""
    logits: np.ndarray | None = None     # [len(logits_at), vocab] float32
    state: bytes | None = None
    cache_k: list[np.ndarray] | None = None  # per layer [kv_heads, rows, head_dim]
    cache_v: list[np.ndarray] | None = None
    timings: dict = field(default_factory=dict)
    evidence: Evidence | None = None
    counts: counting.Counts | None = None
    request_sha256: str = ""
    peak_rss_bytes: int | None = None    # the engine process's VmHWM, where the device lets it be read
    export: exporting.Export | None = None  # what an exporter-based engine's program read

    @property
    def refused(self) -> bool:
        return self.status == "refused"

    def call_seconds(self, name: str | None = None, clock: str = "wall_s") -> list[float]:
        return [float(c[clock]) for c in self.timings.get("calls", []) if name is None or c.get("name") == name]


@dataclass(frozen=True)
class Expect:
    """What the response's arrays must be: the vocabulary, and for cache/ the layers and their K/V shape."""

    vocab: int
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None


def _load_npy(path: Path, shown: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ContractError(f"{shown} is not a readable .npy file: {e}") from None


def _finite(a: np.ndarray, shown: str) -> None:
    bad = ~np.isfinite(a)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ContractError(f"{shown} holds {int(bad.sum())} non-finite value(s), the first {float(a[at])!r} at index {at}")


def _pull(device: Device, remote: str, local: Path, shown: str) -> Path:
    if device.transport.remote_digest(remote) is None:
        raise ContractError(f"{shown} is missing: the engine wrote no such file")
    device.pull(remote, local)
    return local


def _validate_status(text: str, shown: str) -> dict:
    try:
        status = json.loads(text)
    except json.JSONDecodeError as e:
        raise ContractError(f"{shown} is not JSON: {e}") from None
    if not isinstance(status, dict):
        raise ContractError(f"{shown} is {status!r}, not an object")
    if status.get("contract") != CONTRACT_VERSION:
        raise ContractError(f"{shown}: contract={status.get('contract')!r}; testbed speaks contract {CONTRACT_VERSION}")
    if status.get("status") not in ("ok", "refused"):
        raise ContractError(f"{shown}: status={status.get('status')!r}; accepted: ok, refused")
    return status


def _validate_timings(text: str, shown: str) -> dict:
    try:
        timings = json.loads(text)
    except json.JSONDecodeError as e:
        raise ContractError(f"{shown} is not JSON: {e}") from None
    calls = timings.get("calls") if isinstance(timings, dict) else None
    if not isinstance(calls, list):
        raise ContractError(f"{shown}: calls={calls!r} is not a list of calls")
    for i, c in enumerate(calls):
        for key in ("wall_s", "cpu_s"):
            v = c.get(key) if isinstance(c, dict) else None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                raise ContractError(f"{shown}: calls[{i}].{key}={v!r} is not a non-negative number of seconds")
    return timings


def request_values(body: dict, keys) -> dict:
    """request.json's values at dotted `keys` (an exporter's keys: chunk, cache.dtype, ...)."""
    out = {}
    for key in keys:
        node = body
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out[key] = node
    return out


def call(device: Device, spec: EngineSpec, request: Request, expect: Expect, program: Path,
         measured: bool = False, say=None) -> Response:
    """Run one request on `device` with the engine's `program` (build.program_for); the validated Response.
    An exporter-based engine's model is exported first (on the host, once per content; `say` hears its
    progress and heartbeats)."""
    check_machine(device, program)
    if getattr(device.transport, "kind", "") == "qemu" and elf_machine(program) is None:
        # qemu-user emulates ELF programs only: a script would run on this host and pass as the device's
        raise UsageError(f"{device.name}: engine {spec.name}'s program {program.name} is not an ELF program; under "
                         f"qemu-user it would run on this host, not emulated; accepted: a program built for "
                         f"{device.profile.abi} ({spec.path}: build)")
    body = request.as_json()
    export = None
    if spec.export is not None:
        if request.model_format != "hf":
            raise ContractError(f"engine={spec.name} exports from a Hugging Face folder; the request holds "
                                f"model.format={request.model_format}")
        export = exporting.exported(spec, Path(request.model_file), request_values(body, spec.export.keys), say)
        request = dataclasses.replace(request, model_file=export.folder)
        body["model"]["exported"] = spec.name  # what the program reads: the exporter's output, not the folder
    text = json.dumps(body, indent=1, sort_keys=True) + "\n"
    request_sha = hashlib.sha256(text.encode()).hexdigest()
    run_dir = f"runs/{secrets.token_hex(6)}"
    try:
        with tempfile.TemporaryDirectory(prefix="testbed-engine-") as tmp:
            tmp = Path(tmp)
            remote_program = stage_program(device, program)
            model = Path(request.model_file)  # pushed once per content, like programs
            remote_model = stage_folder(device, model) if model.is_dir() else stage_program(device, model)
            device.run(["mkdir", "-p", f"{run_dir}/request", f"{run_dir}/response"], timeout=60)
            device.run(["ln", "-s", f"../../../{remote_model}", f"{run_dir}/request/{body['model']['file']}"],
                       timeout=60)
            (tmp / "request.json").write_text(text)
            (tmp / "request.args").write_text(args_text(body))
            np.save(tmp / "tokens.npy", np.ascontiguousarray(np.asarray(request.tokens, np.int32)))
            for name in ("request.json", "request.args", "tokens.npy"):
                device.push(tmp / name, f"{run_dir}/request/{name}")
            fill = {"program": f"../../{remote_program}", "request": "request", "response": "response"}
            argv = [*runner_prefix(device), *(part.format(**fill) for part in spec.invoke)]
            valgrind = request.count and spec.counts == "marked" and not device.profile.has("counts")
            if valgrind:
                argv = counting.valgrind_argv(argv)
            wrapper = peak_rss.wrapper_for(device, target_for_abi(device.profile.abi), valgrind)
            if isinstance(wrapper, Path):  # the engine's peak RSS, read by the wrapper that reaps it
                argv = [f"../../{stage_program(device, wrapper)}", peak_rss.OUTPUT, *argv]

            def once():
                return device.run(argv, timeout=spec.timeout_s, cwd=run_dir)

            try:
                result, _ = device.measured(once) if measured else (once(), {})
            except CommandTimeout:
                raise ContractError(f"{device.name}: engine {spec.name} did not answer within timeout_s="
                                    f"{spec.timeout_s:g} ({spec.path}); killed") from None
            if result.returncode != 0:
                said = (result.stderr or result.stdout).strip().splitlines()
                raise ContractError(f"{device.name}: engine {spec.name} exited {result.returncode}: "
                                    f"{' | '.join(said[-2:]) or 'no output'}")
            resp = f"{run_dir}/response"
            status = _validate_status(_pull(device, f"{resp}/status.json", tmp / "status.json",
                                            "response/status.json").read_text(), "response/status.json")
            timings = {}
            if device.transport.remote_digest(f"{resp}/timings.json") is not None or status["status"] == "ok":
                timings = _validate_timings(_pull(device, f"{resp}/timings.json", tmp / "timings.json",
                                                  "response/timings.json").read_text(), "response/timings.json")
            out = Response(status["status"], str(status.get("reason", "")), timings=timings, request_sha256=request_sha,
                           export=export)
            if status["status"] == "ok":
                _read_outputs(device, resp, tmp, request, expect, out)
                out.counts = _counts(device, spec, run_dir, tmp, timings, valgrind)
            memory = _peak_rss(device, run_dir, tmp) if isinstance(wrapper, Path) else wrapper
            if isinstance(memory, int):
                out.peak_rss_bytes = memory
            out.evidence = _evidence(device, spec, program, argv, request_sha, timings, out.counts, memory, export)
            return out
    finally:
        try:
            device.run(["rm", "-rf", run_dir], timeout=60)
        except Exception:  # noqa: BLE001 -- cleanup must not hide the run's own error
            pass


def _read_outputs(device: Device, resp: str, tmp: Path, request: Request, expect: Expect, out: Response) -> None:
    shown = "response/logits.npy"
    logits = _load_npy(_pull(device, f"{resp}/logits.npy", tmp / "logits.npy", shown), shown)
    want = (len(request.logits_at), expect.vocab)
    if logits.dtype != np.float32:
        raise ContractError(f"{shown} has dtype {logits.dtype}; the contract says float32")
    if logits.shape != want:
        raise ContractError(f"{shown} has shape {logits.shape}; the contract says {want} (len(logits_at), vocab)")
    _finite(logits, shown)
    out.logits = logits
    if request.state:
        out.state = _pull(device, f"{resp}/state.bin", tmp / "state.bin", "response/state.bin").read_bytes()
    if expect.layers and device.transport.remote_digest(f"{resp}/cache/k_0.npy") is not None:
        out.cache_k, out.cache_v = [], []
        for layer in range(expect.layers):
            pair = []
            for part in ("k", "v"):
                shown = f"response/cache/{part}_{layer}.npy"
                a = _load_npy(_pull(device, f"{resp}/cache/{part}_{layer}.npy", tmp / f"{part}_{layer}.npy", shown),
                              shown)
                if a.dtype != np.float32:
                    raise ContractError(f"{shown} has dtype {a.dtype}; the contract says float32")
                if a.ndim != 3 or a.shape[0] != expect.kv_heads or a.shape[2] != expect.head_dim:
                    raise ContractError(f"{shown} has shape {a.shape}; the contract says ({expect.kv_heads}, rows, "
                                        f"{expect.head_dim}) (kv_heads, rows, head_dim)")
                _finite(a, shown)
                pair.append(a)
            if pair[0].shape != pair[1].shape:
                raise ContractError(f"response/cache/k_{layer}.npy {pair[0].shape} and v_{layer}.npy {pair[1].shape} "
                                    "differ in shape")
            out.cache_k.append(pair[0])
            out.cache_v.append(pair[1])


def _peak_rss(device: Device, run_dir: str, tmp: Path) -> int | str:
    """The engine's peak RSS in bytes from the wrapper's file, or why it could not be read."""
    remote = f"{run_dir}/{peak_rss.OUTPUT}"
    if device.transport.remote_digest(remote) is None:
        return "not read: tb_peak_rss wrote nothing"
    device.pull(remote, tmp / peak_rss.OUTPUT)
    try:
        kb = json.loads((tmp / peak_rss.OUTPUT).read_text())["peak_rss_kb"]
    except (ValueError, KeyError, TypeError) as e:
        return f"not read: {peak_rss.OUTPUT} is not what tb_peak_rss writes ({e})"
    if isinstance(kb, bool) or not isinstance(kb, int) or kb <= 0:
        return f"not read: {peak_rss.OUTPUT} says peak_rss_kb={kb!r}"
    return kb * 1024


def _counts(device: Device, spec: EngineSpec, run_dir: str, tmp: Path, timings: dict, valgrind: bool):
    """Per call where the engine marks its calls (tb_engine.h), on a device that counts (or the host under
    valgrind); the whole process where it does not, labelled so by the evidence."""
    marks = tuple(timings.get("marks") or ())
    try:
        if device.profile.has("counts"):
            device.pull(f"{run_dir}/{counting.COUNTS_FILE}", tmp / "counts.json")
            text = (tmp / "counts.json").read_text()
            if marks:
                return counting.parse_plugin_output(text, len(marks), marks)
            total = json.loads(text).get("total")
            return counting.Counts((), int(total), "qemu-tcg-plugin", True, ("process",)) if total else None
        if valgrind and marks:
            return counting.parse_callgrind_dumps(pull_dumps(device, run_dir, 2 * len(marks), tmp), len(marks), marks)
    except counting.CountError as e:
        raise counting.CountError(f"{device.name}: engine {spec.name}: {e}") from None
    return None


def _evidence(device: Device, spec: EngineSpec, program: Path, argv: list[str], request_sha: str, timings: dict,
              counts, memory: int | str, export: exporting.Export | None) -> Evidence:
    calls = timings.get("calls") or []
    detail = {**spec.identity(), "request_sha256": request_sha, "engine_reported": timings.get("engine"),
              "device_time": timings.get("device_time"), "timed_calls": len(calls),
              "cpu_seconds": sum(float(c["cpu_s"]) for c in calls),
              "clock": "the engine's own clock on the device (timings.json)",
              "counted": ("per call (tb_engine.h marks)" if counts and counts.regions else
                          "per process (the engine marks no calls)" if counts else "not counted")}
    detail |= program_identity(program)
    if counts:
        detail["instructions"] = counts.metadata()
    detail |= {"peak_rss_bytes": memory, "peak_rss_how": peak_rss.HOW} if isinstance(memory, int) else \
        {"peak_rss": memory}
    if export is not None:
        detail |= export.evidence()
    return Evidence(device.name, program.name, program_digest(program), quoted(argv),
                    float(sum(float(c["wall_s"]) for c in calls)) if calls else None, detail)
