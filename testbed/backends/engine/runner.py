"""One request/response exchange of engine contract v1 with an engine on a device.

The request folder (request.json, request.args, tokens.npy, and the model file as a link to its copy
pushed once per content) is pushed to runs/ID/request; the engine runs in runs/ID as
`invoke` says, writes runs/ID/response; everything it must write is pulled and checked before an
oracle sees it: status.json's version and status, logits.npy's dtype, shape and finiteness,
state.bin when asked (pulled to a file and kept there, testbed.backends.engine.state, never larger than
the model's caches can hold), cache/ when present, timings.json. Whatever is wrong is a ContractError
(exit 4) naming the file and the value; a refusal is a Response with status "refused" (the experiments
record it as "not supported"). A request may carry a state to restore (state_in: a state.bin the same
engine gave earlier, pushed as request/state_in.bin), only to an engine whose yaml says supports.state_in.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from testbed.backends import Evidence
from testbed.backends.engine.keep import Kept, keep
from testbed.backends.engine.spec import CONTRACT_VERSION, EngineSpec
from testbed.backends.engine.state import StateFile
from testbed.backends.native.device import check_machine, program_digest, program_identity, pull_dumps, \
    runner_prefix, stage_folder, stage_program
from testbed.devices import Device
from testbed.devices.transport import CommandTimeout, quoted
from testbed.errors import DeviceError, UsageError
from testbed.measure import counts as counting


class ContractError(DeviceError):
    """The engine's response breaks the contract (a file missing, of the wrong shape or dtype, NaN, another
    version), or the engine failed (non-zero exit, timeout): exit 4, and never a pass. `evidence`: what ran
    (testbed.backends.Evidence dicts), which the run's error record carries."""

    evidence: list[dict] = []


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
    state_in: Path | None = None   # a state.bin of this engine to restore first (supports.state_in engines only)
    state_in_positions: int = 0    # the positions it holds: tokens[0:state_in_positions]
    state_before_last: bool = False  # also ask for state_before_last.bin (the state after every call but the last)

    STATE_IN_FILE = "state_in.bin"

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
                "count": self.count, **({"rs_snapshots": self.rs_snapshots} if self.rs_snapshots else {}),
                **({"state_in": {"file": self.STATE_IN_FILE, "positions": int(self.state_in_positions)}}
                   if self.state_in is not None else {}),
                **({"state_before_last": True} if self.state_before_last else {})}


def request_text(request: Request) -> tuple[dict, str, str]:
    """(request.json as an object, its exact text, that text's sha256): what names a request everywhere
    (the evidence, a kept request's folder)."""
    body = request.as_json()
    text = json.dumps(body, indent=1, sort_keys=True) + "\n"
    return body, text, hashlib.sha256(text.encode()).hexdigest()


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
    state: StateFile | None = None       # response/state.bin when asked
    state_before_last: StateFile | None = None  # response/state_before_last.bin, when asked and written
    cache_k: list[np.ndarray] | None = None  # per layer [kv_heads, rows, head_dim]
    cache_v: list[np.ndarray] | None = None
    timings: dict = field(default_factory=dict)
    evidence: Evidence | None = None
    counts: counting.Counts | None = None
    request_sha256: str = ""

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
    state_max_bytes: int | None = None  # the most a state.bin can hold for this model and request (bigger: refused)


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
    rss = timings.get("peak_rss_bytes")  # optional: the process's peak resident set (tb_engine.h writes it)
    if rss is not None and (isinstance(rss, bool) or not isinstance(rss, int) or rss < 0):
        raise ContractError(f"{shown}: peak_rss_bytes={rss!r} is not a non-negative whole number of bytes")
    return timings


def call(device: Device, spec: EngineSpec, request: Request, expect: Expect, program: Path,
         measured: bool = False) -> Response:
    """Run one request on `device` with the engine's `program` (build.program_for); the validated Response."""
    check_machine(device, program)
    if request.state_in is not None and not spec.state_in:
        raise UsageError(f"engine {spec.name} does not restore a state ({spec.path}: supports.state_in is not true); "
                         "no request carries it one")
    body, text, request_sha = request_text(request)
    run_dir = f"runs/{secrets.token_hex(6)}"
    argv, result = [], None  # what ran and what it said: a failing call's evidence
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
            if request.state_in is not None:
                device.push(Path(request.state_in), f"{run_dir}/request/{request.STATE_IN_FILE}")
            fill = {"program": f"../../{remote_program}", "request": "request", "response": "response"}
            argv = [*runner_prefix(device), *(part.format(**fill) for part in spec.invoke)]
            valgrind = request.count and spec.counts == "marked" and not device.profile.has("counts")
            if valgrind:
                argv = counting.valgrind_argv(argv)

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
            out = Response(status["status"], str(status.get("reason", "")), timings=timings, request_sha256=request_sha)
            if status["status"] == "ok":
                _read_outputs(device, resp, tmp, request, expect, out)
                out.counts = _counts(device, spec, run_dir, tmp, timings, valgrind)
            out.evidence = _evidence(device, spec, program, argv, request_sha, timings, out.counts)
            return out
    except ContractError as e:  # a crash, a hang, a broken response: kept for replay, with what ran
        raise failed_call(e, device, spec, program, argv, request, expect, result) from None
    finally:
        try:
            device.run(["rm", "-rf", run_dir], timeout=60)
        except Exception:  # noqa: BLE001 -- cleanup must not hide the run's own error
            pass


def keep_request(device: Device, spec: EngineSpec, program: Path, request: Request, expect: Expect, why: str,
                 said: dict[str, str] | None = None) -> Kept | None:
    """Keep `request` for replay in the current run's store (testbed.backends.engine.keep); None outside a run."""
    body, text, _ = request_text(request)
    return keep({"request.json": text, "request.args": args_text(body)}, request.tokens, request.model_file,
                request.model_name, asdict(expect), why, said, device=device, spec=spec, program=program)


def failed_call(error: ContractError, device: Device, spec: EngineSpec, program: Path, argv: list[str],
                request: Request, expect: Expect, result) -> ContractError:
    """`error` again, saying where its request is kept and how to replay it, with the evidence of what ran
    (the program, its sha256, the command, the request's sha256): a crash leaves as much as a pass does."""
    said = {"stdout": result.stdout, "stderr": result.stderr} if result is not None else None
    kept = keep_request(device, spec, program, request, expect, str(error), said)
    _, _, request_sha = request_text(request)
    evidence = _evidence(device, spec, program, argv, request_sha, {}, None)
    evidence.detail |= {"failed": str(error), **({"exit_status": result.returncode} if result is not None else {}),
                        **(kept.as_dict() if kept else {})}
    failed = ContractError(f"{error}; {kept.said()}" if kept else str(error))
    failed.evidence = [evidence.as_dict()]
    return failed


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
        out.state = _pull_state(device, resp, "state.bin", tmp, expect)
    if request.state_before_last and device.transport.remote_digest(f"{resp}/state_before_last.bin") is not None:
        out.state_before_last = _pull_state(device, resp, "state_before_last.bin", tmp, expect)
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


def _pull_state(device: Device, resp: str, name: str, tmp: Path, expect: Expect) -> StateFile:
    """response/NAME pulled to a file of its own (never read whole); one larger than the model's caches can
    hold (expect.state_max_bytes) is refused before it is pulled."""
    shown = f"response/{name}"
    found = device.transport.remote_digest(f"{resp}/{name}")
    if found is None:
        raise ContractError(f"{shown} is missing: the engine wrote no such file")
    if expect.state_max_bytes is not None and found[0] > expect.state_max_bytes:
        raise ContractError(f"{shown} holds {found[0]} bytes, more than this model's caches can hold for the request "
                            f"({expect.state_max_bytes} bytes); not pulled")
    device.pull(f"{resp}/{name}", tmp / name)
    return StateFile(tmp / name, shown)


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
              counts) -> Evidence:
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
    return Evidence(device.name, program.name, program_digest(program), quoted(argv),
                    float(sum(float(c["wall_s"]) for c in calls)) if calls else None, detail)
