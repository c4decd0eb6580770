"""One request/response exchange of engine contract v1 with an engine on a device.

The contract whole (README, "Engine under test"; engines/contract-v1.schema.json, whose $defs describe the
request and the response files):

  request/   pushed to runs/ID/request on the device
    request.json   contract 1; technique (chunk_prefill | tail | hybrid); model {format (safetensors | gguf |
                   hf), file (its name here), weights (f32 | f16 | int8), config (the shape: tb_model_bench's
                   or tb_hybrid_bench's argument keys)}; tokens (tokens.npy), n_tokens; past P (tokens[0:P] in
                   calls of at most C rows first); chunk C (the rest in calls of C rows); logits_at (ascending
                   positions); tail.mode (the last partial call: none | padded: C rows, the pads then removed |
                   scalar: one row per call); cache {dtype, window (the model's sliding window; 0 none), sink,
                   group}; state (write state.bin); threads; bench (null | {reps, warmup}: the plan again, the
                   timed calls marked); count; rs_snapshots (hybrid, optional); state_in (optional: {file,
                   positions}, a state.bin the same engine gave earlier to restore first, pushed as
                   request/state_in.bin, only to an engine whose yaml says supports.state_in);
                   state_before_last (optional: also write state_before_last.bin)
    request.args   the same flattened: key=value lines, nested keys dotted, lists comma-separated, 1/0, no nulls
    tokens.npy     int32 [n_tokens]
    MODEL          a link to the model's copy, pushed once per content (like programs)
  the engine runs in runs/ID as `invoke` says (relative paths request, response) and exits 0 once it wrote
  status.json; any other exit, or a hang past timeout_s, is a ContractError
  response/  everything it must write is pulled and checked before an oracle sees it
    status.json    {"contract": 1, "status": "ok"} | {"contract": 1, "status": "refused", "reason": ...}
    logits.npy     float32 [len(logits_at), vocab], finite
    state.bin      when asked: the sequence's state, the engine's own bytes (pulled to a file and kept there,
                   testbed.backends.engine.state; never larger than the model's caches can hold)
    cache/         optional: k_L.npy, v_L.npy float32 [kv_heads, rows, head_dim] per layer, the P + n real rows
                   in order, then at most C - n_last pad rows (each its pad token alone at its position)
    timings.json   {"contract": 1, "calls": [{name, rows, wall_s, cpu_s, counted}], "marks": [...],
                   "device_time", "engine": {name, version, source_hash}}

The engine runs through tb_peak_rss where its peak RSS can be read (testbed.backends.engine.peak_rss); an
exporter-based engine's model is its exporter's output, made on the host once per content
(testbed.backends.engine.export), and request.json's model says `exported: NAME`. Whatever is wrong is a
ContractError (exit 4) naming the file and the value; a refusal is a Response with status "refused" (the
experiments record it as "not supported").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import struct
import tempfile
import tokenize
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from testbed import inputs
from testbed.backends import Evidence
from testbed.backends.engine import export as exporting, peak_rss
from testbed.backends.engine.keep import Kept, keep
from testbed.backends.engine.spec import CONTRACT_VERSION, EngineSpec
from testbed.backends.engine.state import StateFile
from testbed.backends.native.build import target_for_abi
from testbed.backends.native.device import check_machine, program_digest, program_identity, pull_dumps, \
    runner_prefix, stage_folder, stage_program
from testbed.devices import Device
from testbed.devices.transport import CommandTimeout, elf_machine, quoted
from testbed.errors import DeviceError, UsageError
from testbed.inputs import parse_json
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
    exported: str | None = None    # the engine whose exporter made the model folder (an exporter-based engine)

    STATE_IN_FILE = "state_in.bin"

    @property
    def model_name(self) -> str:
        """The model's name in the request folder: model.safetensors, model.gguf, or the folder model/ (hf)."""
        return "model" if self.model_format == "hf" else f"model.{self.model_format}"

    def as_json(self) -> dict:
        return {"contract": CONTRACT_VERSION, "technique": self.technique,
                "model": {"format": self.model_format, "file": self.model_name, "weights": self.weights,
                          "config": self.config, **({"exported": self.exported} if self.exported else {})},
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
    state_max_bytes: int | None = None  # the most a state.bin can hold for this model and request (bigger: refused)


# What a response's small files may hold: status.json a status and a reason; timings.json a few hundred bytes
# per call, and a request of n tokens runs at most 2n calls per repetition (each of one row at least, the
# tail's re-run rows again); an .npy header numpy writes in at most a few hundred bytes.
STATUS_MAX_BYTES = 64 << 10
TIMINGS_BYTES_PER_CALL = 1 << 10
NPY_HEADER_MAX_BYTES = 64 << 10


def timings_limit(request: Request) -> int:
    """The most bytes timings.json (and the counter's counts.json) may hold for this request."""
    bench = request.bench or {}
    repetitions = 1 + sum(int(bench.get(k) or 0) for k in ("reps", "warmup") if isinstance(bench.get(k), int))
    calls = 2 * (int(np.asarray(request.tokens).size) + 1) * repetitions
    return STATUS_MAX_BYTES + TIMINGS_BYTES_PER_CALL * calls


def npy_limit(shape: tuple[int, ...]) -> int:
    """The most bytes a float32 .npy of `shape` may take: its header and its data."""
    return NPY_HEADER_MAX_BYTES + 4 * int(np.prod(shape, dtype=np.int64))


def _load_npy(path: Path, shown: str, fits, want: str) -> np.ndarray:
    """A float32 .npy whose header's shape `fits(shape)` (checked before any data is read, so a header
    claiming (10^6, 10^6) is refused, not allocated); `want` says what fits, for the message."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read_header is None:
                raise ValueError(f"format version {version}")
            if version == (2, 0):  # a 4-byte header length: numpy would allocate what it claims before reading
                (length,) = struct.unpack("<I", f.read(4).ljust(4, b"\0"))
                if length > NPY_HEADER_MAX_BYTES:
                    raise ValueError(f"its header claims {length} bytes; accepted: at most {NPY_HEADER_MAX_BYTES}")
                f.seek(-4, 1)
            shape, fortran, dtype = read_header(f)
            data_at = f.tell()
    except (ValueError, OSError, EOFError, SyntaxError, RecursionError, tokenize.TokenError) as e:  # numpy's parse
        raise ContractError(f"{shown} is not a readable .npy file: {str(e).splitlines()[0]}") from None
    if dtype != np.float32:
        raise ContractError(f"{shown} has dtype {dtype}; the contract says float32")
    if not fits(shape):
        raise ContractError(f"{shown} has shape {shape}; the contract says {want}")
    size = path.stat().st_size
    if size != data_at + 4 * int(np.prod(shape, dtype=np.int64)):
        raise ContractError(f"{shown} holds {size - data_at} bytes of data; its header's float32 {shape} needs "
                            f"{4 * int(np.prod(shape, dtype=np.int64))}")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ContractError(f"{shown} is not a readable .npy file: {e}") from None


def _finite(a: np.ndarray, shown: str) -> None:
    bad = ~np.isfinite(a)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ContractError(f"{shown} holds {int(bad.sum())} non-finite value(s), the first {float(a[at])!r} at index {at}")


def _pull(device: Device, remote: str, local: Path, shown: str, limit: int | None = None, why: str = "") -> Path:
    """The engine's file `remote` pulled to `local`; refused before it is pulled when it holds more than
    `limit` bytes (`why`: what the request allows)."""
    size = device.transport.remote_size(remote)
    if size is None:
        raise ContractError(f"{shown} is missing: the engine wrote no such file")
    if limit is not None and size > limit:
        raise ContractError(f"{shown} is {size} bytes; accepted: at most {limit} ({why})")
    device.pull(remote, local)
    return local


def _validate_status(text: str | bytes, shown: str) -> dict:
    status = parse_json(text, shown, ContractError, kind=dict)
    if not _is(status.get("contract"), CONTRACT_VERSION):
        raise ContractError(f"{shown}: contract={inputs.shown(status.get('contract'))}; testbed speaks contract "
                            f"{CONTRACT_VERSION}")
    if status.get("status") not in ("ok", "refused"):
        raise ContractError(f"{shown}: status={inputs.shown(status.get('status'))}; accepted: ok, refused")
    return status


def _is(value, expected) -> bool:
    """`value` is `expected` and of its type (JSON's true is not the contract version 1)."""
    return type(value) is type(expected) and value == expected


def _validate_timings(text: str | bytes, shown: str) -> dict:
    timings = parse_json(text, shown, ContractError, kind=dict)
    calls = timings.get("calls")
    if not isinstance(calls, list):
        raise ContractError(f"{shown}: calls={inputs.shown(calls)} is not a list of calls")
    for i, c in enumerate(calls):
        if not isinstance(c, dict):
            raise ContractError(f"{shown}: calls[{i}]={inputs.shown(c)} is not an object {{name, rows, wall_s, cpu_s}}")
        for key in ("wall_s", "cpu_s"):
            v = c.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                raise ContractError(f"{shown}: calls[{i}].{key}={inputs.shown(v)} is not a non-negative number of "
                                    "seconds")
        if not isinstance(c.get("name", ""), str):
            raise ContractError(f"{shown}: calls[{i}].name={inputs.shown(c['name'])} is not a string")
    for key, kind, accepted in (("device_time", str, "a time stamp"),
                                ("engine", dict, "an object {name, version, ...}")):
        if timings.get(key) is not None and not isinstance(timings[key], kind):
            raise ContractError(f"{shown}: {key}={inputs.shown(timings[key])} is not accepted; accepted: absent, or "
                                f"{accepted}")
    marks = timings.get("marks")
    if marks is not None and (not isinstance(marks, list) or not all(isinstance(m, str) for m in marks)
                              or len(marks) > len(calls)):
        raise ContractError(f"{shown}: marks={inputs.shown(marks)} is not accepted; accepted: absent, or the names of "
                            f"the marked calls (strings, at most the {len(calls)} calls)")
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
    if request.state_in is not None and not spec.state_in:
        raise UsageError(f"engine {spec.name} does not restore a state ({spec.path}: supports.state_in is not true); "
                         "no request carries it one")
    if getattr(device.transport, "kind", "") == "qemu" and elf_machine(program) is None:
        # qemu-user emulates ELF programs only: a script would run on this host and pass as the device's
        raise UsageError(f"{device.name}: engine {spec.name}'s program {program.name} is not an ELF program; under "
                         f"qemu-user it would run on this host, not emulated; accepted: a program built for "
                         f"{device.profile.abi} ({spec.path}: build)")
    export = None
    if spec.export is not None:
        if request.model_format != "hf":
            raise ContractError(f"engine={spec.name} exports from a Hugging Face folder; the request holds "
                                f"model.format={request.model_format}")
        export = exporting.exported(spec, Path(request.model_file), request_values(request.as_json(),
                                                                                  spec.export.keys), say)
        # what the program reads: the exporter's output, not the folder
        request = dataclasses.replace(request, model_file=export.folder, exported=spec.name)
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
            status = _validate_status(_pull(device, f"{resp}/status.json", tmp / "status.json", "response/status.json",
                                            STATUS_MAX_BYTES, "a status and a reason").read_bytes(),
                                      "response/status.json")
            timings = {}
            if device.transport.remote_size(f"{resp}/timings.json") is not None or status["status"] == "ok":
                timings = _validate_timings(_pull(device, f"{resp}/timings.json", tmp / "timings.json",
                                                  "response/timings.json", timings_limit(request),
                                                  "what this request's calls take").read_bytes(),
                                            "response/timings.json")
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
    want = (len(request.logits_at), expect.vocab)
    logits = _load_npy(_pull(device, f"{resp}/logits.npy", tmp / "logits.npy", shown, npy_limit(want),
                             f"float32 {want}"), shown, lambda shape: shape == want, f"{want} (len(logits_at), vocab)")
    _finite(logits, shown)
    out.logits = logits
    if request.state:
        out.state = _pull_state(device, resp, "state.bin", tmp, expect)
    if request.state_before_last and device.transport.remote_size(f"{resp}/state_before_last.bin") is not None:
        out.state_before_last = _pull_state(device, resp, "state_before_last.bin", tmp, expect)
    if expect.layers and device.transport.remote_size(f"{resp}/cache/k_0.npy") is not None:
        out.cache_k, out.cache_v = [], []
        rows = cache_rows(request)
        want = (expect.kv_heads, rows, expect.head_dim)
        for layer in range(expect.layers):
            pair = []
            for part in ("k", "v"):
                shown = f"response/cache/{part}_{layer}.npy"
                a = _load_npy(_pull(device, f"{resp}/cache/{part}_{layer}.npy", tmp / f"{part}_{layer}.npy", shown,
                                    npy_limit(want), f"float32 {want}, at most {rows} rows"), shown,
                              lambda shape: len(shape) == 3 and shape[0] == expect.kv_heads and shape[1] <= rows
                              and shape[2] == expect.head_dim,
                              f"({expect.kv_heads}, rows, {expect.head_dim}) (kv_heads, rows, head_dim), rows at most "
                              f"{rows} (the request's tokens and one chunk)")
                _finite(a, shown)
                pair.append(a)
            if pair[0].shape != pair[1].shape:
                raise ContractError(f"response/cache/k_{layer}.npy {pair[0].shape} and v_{layer}.npy {pair[1].shape} "
                                    "differ in shape")
            out.cache_k.append(pair[0])
            out.cache_v.append(pair[1])


def cache_rows(request: Request) -> int:
    """The most rows an engine's cache may hold after this request: its tokens (P + n), and the pad rows of
    its last chunk (C)."""
    return int(np.asarray(request.tokens).size) + int(request.chunk)


def _pull_state(device: Device, resp: str, name: str, tmp: Path, expect: Expect) -> StateFile:
    """response/NAME pulled to a file of its own (never read whole); one larger than the model's caches can
    hold (expect.state_max_bytes) is refused before it is pulled."""
    shown = f"response/{name}"
    size = device.transport.remote_size(f"{resp}/{name}")
    if size is None:
        raise ContractError(f"{shown} is missing: the engine wrote no such file")
    if expect.state_max_bytes is not None and size > expect.state_max_bytes:
        raise ContractError(f"{shown} holds {size} bytes, more than this model's caches can hold for the request "
                            f"({expect.state_max_bytes} bytes); not pulled")
    device.pull(f"{resp}/{name}", tmp / name)
    return StateFile(tmp / name, shown)


def _peak_rss(device: Device, run_dir: str, tmp: Path) -> int | str:
    """The engine's peak RSS in bytes from the wrapper's file, or why it could not be read."""
    remote = f"{run_dir}/{peak_rss.OUTPUT}"
    size = device.transport.remote_size(remote)
    if size is None:
        return "not read: tb_peak_rss wrote nothing"
    if size > STATUS_MAX_BYTES:
        return f"not read: {peak_rss.OUTPUT} holds {size} bytes, more than tb_peak_rss writes"
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
    marks = tuple(timings.get("marks") or ())  # _validate_timings: a list of names
    limit = STATUS_MAX_BYTES + TIMINGS_BYTES_PER_CALL * max(len(timings.get("calls") or ()), 1)
    try:
        if device.profile.has("counts"):
            shown = f"{run_dir}/{counting.COUNTS_FILE}"  # the counter's, in the folder the engine writes to
            size = device.transport.remote_size(shown)
            if size is not None and size > limit:
                raise counting.CountError(f"{shown} is {size} bytes; accepted: at most {limit} (what the counter "
                                          f"writes of {len(timings.get('calls') or ())} calls)")
            device.pull(shown, tmp / "counts.json")
            text = (tmp / "counts.json").read_text(errors="replace")
            if marks:
                return counting.parse_plugin_output(text, len(marks), marks)
            total = parse_json(text, shown, counting.CountError, kind=dict).get("total")
            if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
                raise counting.CountError(f"{shown}: total={inputs.shown(total)} is not a count of instructions")
            return counting.Counts((), total, "qemu-tcg-plugin", True, ("process",)) if total else None
        if valgrind and marks:
            return counting.parse_callgrind_dumps(pull_dumps(device, run_dir, 2 * len(marks), tmp), len(marks), marks)
    except counting.CountError as e:
        raise counting.CountError(f"{device.name}: engine {spec.name}: {e}") from None
    return None


def _evidence(device: Device, spec: EngineSpec, program: Path, argv: list[str], request_sha: str, timings: dict,
              counts, memory: int | str = "not read: the engine did not answer", export: exporting.Export | None = None
              ) -> Evidence:
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
