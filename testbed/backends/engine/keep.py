"""Engine calls kept for replay: a failing or crashing request's folder, beside the run's records.

  RESULTS/engine-requests/SHA/          SHA: the sha256 of request.json's exact text
    request/request.json, request.args, tokens.npy
    request/MODEL -> the model file      a link (model.safetensors, model.gguf or model/), never a copy
    call.json                            the engine (yaml, sha256, invoke, timeout), the program (path,
                                         sha256), the device, the model (path, sha256, bytes), what the
                                         response must hold, why it was kept, the commands below
    stdout.txt, stderr.txt               what a crashing engine said, where it said anything
  RESULTS/engine-requests/by-run/RUN    one JSON line per call the run kept, numbered from 1

Kept only inside a run (testbed.results.current_run), only for calls that failed: a crash, a hang, a
response that breaks the contract (testbed.backends.engine.runner), a request whose answer an oracle
failed (testbed.backends.engine.gemma). Each kept call names three commands: the engine by hand in
the folder, the same under gdb, and `python3 -m testbed engine replay RUN CALL` (testbed.cli.engine),
which rebuilds the request folder on the device and runs the engine once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from testbed import PROJECT_ROOT
from testbed.backends.engine.spec import EngineSpec
from testbed.backends.native.device import program_digest, runner_prefix
from testbed.devices import Device
from testbed.devices.transport import sha256_file
from testbed.errors import UsageError
from testbed.results import current_run

FOLDER = "engine-requests"
BY_RUN = "by-run"
CALL_FILE = "call.json"


@dataclass(frozen=True)
class Kept:
    """A kept call: its folder, the run that kept it and its number there, and the commands that replay it."""

    folder: Path
    sha256: str
    run_id: str
    number: int
    by_hand: str
    gdb: str
    replay: str

    def said(self) -> str:
        """One clause for a FAIL line."""
        return f"request kept in {self.folder}; replay: {self.replay}"

    def as_dict(self) -> dict:
        return {"request_folder": str(self.folder), "request_sha256": self.sha256, "kept_by_run": self.run_id,
                "kept_call": self.number, "by_hand": self.by_hand, "under_gdb": self.gdb, "replay": self.replay}


def model_pointer(model: Path) -> dict:
    """Where the model is and what it is (a folder: its files' sha256 in name order, as stage_folder pushes it)."""
    model = Path(model).resolve()
    if model.is_dir():
        h, size = hashlib.sha256(), 0
        for p in sorted(q for q in model.iterdir() if q.is_file()):
            h.update(p.name.encode() + b"\0" + sha256_file(p).encode())
            size += p.stat().st_size
        return {"path": str(model), "folder": True, "sha256": h.hexdigest(), "bytes": size}
    return {"path": str(model), "folder": False, "sha256": sha256_file(model), "bytes": model.stat().st_size}


def host_commands(device: Device, spec_invoke, program: Path, folder: Path) -> tuple[str, str]:
    """(by hand, under gdb): the engine run in the kept folder as the device runs it, where the device is
    this host or qemu-user on it; on another machine, the command to run there after pushing the folder."""
    argv = [*runner_prefix(device), *(p.format(program=str(program), request="request", response="response")
                                      for p in spec_invoke)]
    setup = f"cd {shlex.quote(str(folder))} && rm -rf response && mkdir response && "
    kind = getattr(device.transport, "kind", "")
    if kind == "local":
        return setup + shlex.join(argv), setup + shlex.join(["gdb", "--args", *argv])
    if kind == "qemu":
        emulator = [device.transport.emulator, *(["-L", device.transport.sysroot] if device.transport.sysroot else [])]
        return (setup + shlex.join([*emulator, *argv]),
                setup + shlex.join([*emulator, "-g", "1234", *argv]) + " & gdb-multiarch "
                + shlex.quote(str(program)) + " -ex 'target remote :1234'")
    where = f"on {device.name}, in a folder holding {folder}/request/ and the program"
    return f"{where}: {shlex.join(argv)}", f"{where}: gdb --args {shlex.join(argv)}"


def replay_command(run_id: str, number: int, store: Path) -> str:
    """The replay command; it names the store unless it is the project's own results/ (TESTBED_RESULTS or
    results_dir may point elsewhere when it is run)."""
    results = [] if Path(store).resolve() == (PROJECT_ROOT / "results").resolve() else ["--results", str(store)]
    return shlex.join(["python3", "-m", "testbed", "engine", "replay", *results, run_id, str(number)])


def keep(files: dict[str, str], tokens, model: Path, model_name: str, expect: dict, why: str,
         said: dict[str, str] | None = None, *, device: Device, spec: EngineSpec, program: Path) -> Kept | None:
    """Keep a request (`files`: request.json's and request.args's text; its tokens; a link named `model_name`
    to `model`) in the current run's store; None outside a run. `said`: what the engine printed (stdout,
    stderr)."""
    place = current_run()
    if place is None:
        return None
    sha = hashlib.sha256(files["request.json"].encode()).hexdigest()
    root = place.store / FOLDER
    folder = root / sha
    by_hand, gdb = host_commands(device, spec.invoke, Path(program).resolve(), folder)
    if not (folder / CALL_FILE).is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{sha[:16]}.", dir=root))
        try:
            (tmp / "request").mkdir()
            for name, content in files.items():
                (tmp / "request" / name).write_text(content)
            np.save(tmp / "request" / "tokens.npy", np.ascontiguousarray(np.asarray(tokens, np.int32)))
            os.symlink(Path(model).resolve(), tmp / "request" / Path(model_name).name)
            for name, output in (said or {}).items():
                (tmp / f"{name}.txt").write_text(output[-(1 << 20):])  # the end of a long log
            (tmp / CALL_FILE).write_text(json.dumps({
                "request_sha256": sha, **spec.identity(), "invoke": list(spec.invoke), "timeout_s": spec.timeout_s,
                "counts": spec.counts, "program": str(Path(program).resolve()),
                "program_sha256": program_digest(program),
                "device": device.name, "model": model_pointer(model), "expect": expect, "why": why}, indent=1) + "\n")
            try:
                tmp.rename(folder)
            except OSError:  # kept already by another run, or a moment ago
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    number = _index(root, place.run_id, sha, why)
    return Kept(folder, sha, place.run_id, number, by_hand, gdb, replay_command(place.run_id, number, place.store))


def _index(root: Path, run_id: str, sha: str, why: str) -> int:
    """The call's number in the run's list (appended once per request)."""
    index = root / BY_RUN / run_id
    index.parent.mkdir(parents=True, exist_ok=True)
    kept = read_index(index)
    for entry in kept:
        if entry["sha256"] == sha:
            return entry["call"]
    with open(index, "a") as f:
        f.write(json.dumps({"call": len(kept) + 1, "sha256": sha, "why": why}) + "\n")
    return len(kept) + 1


def read_index(index: Path) -> list[dict]:
    if not index.is_file():
        return []
    out = []
    for line in index.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("call"), int) and isinstance(entry.get("sha256"), str):
            out.append(entry)
    return out


# --- finding and reading a kept call ---------------------------------------------------------------


def find(store: Path, run_or_sha: str, call: str | None = None) -> Path:
    """The folder of a kept call: RUN CALL (its number in the run's list, or its sha256 or a prefix of it),
    or a request's sha256 (or a unique prefix) alone. One line naming what was not found otherwise."""
    root = Path(store) / FOLDER
    if call is not None:
        index = root / BY_RUN / Path(run_or_sha).name
        kept = read_index(index)
        if not kept:
            runs = sorted(p.name for p in (root / BY_RUN).glob("*")) if (root / BY_RUN).is_dir() else []
            raise UsageError(f"run {run_or_sha!r} kept no engine request in {root}; runs that kept some: "
                             f"{', '.join(runs[-5:]) or 'none'}")
        match = [e for e in kept if str(e["call"]) == call or e["sha256"].startswith(call.lower())]
        if len(match) != 1:
            listed = ", ".join(f"{e['call']} ({e['sha256'][:12]}: {e['why']})" for e in kept)
            raise UsageError(f"call {call!r} is not one of run {run_or_sha}'s kept calls; accepted: {listed}")
        sha = match[0]["sha256"]
    else:
        prefix = run_or_sha.lower()
        if len(prefix) < 8 or any(c not in "0123456789abcdef" for c in prefix):
            raise UsageError(f"{run_or_sha!r} is not a request's sha256 (at least 8 hex digits); accepted: "
                             "SHA, or RUN CALL (a run id and the call's number)")
        found = sorted(p.name for p in root.glob(f"{prefix}*") if p.is_dir()) if root.is_dir() else []
        if len(found) != 1:
            raise UsageError(f"{run_or_sha!r} names {len(found)} kept requests in {root}; accepted: a sha256 prefix "
                             "naming one")
        sha = found[0]
    folder = root / sha
    if folder.is_symlink() or not (folder / CALL_FILE).is_file():
        raise UsageError(f"{folder} is not a kept request (no {CALL_FILE})")
    return folder


@dataclass(frozen=True)
class KeptCall:
    """A kept call read back: what call.json says, request.json's object and text, the tokens."""

    folder: Path
    call: dict
    body: dict
    text: str
    tokens: np.ndarray

    @property
    def model(self) -> Path:
        return Path(self.call["model"]["path"])

    @property
    def program(self) -> Path:
        return Path(self.call["program"])


def read(folder: Path) -> KeptCall:
    """A kept call, checked: request.json is the one its folder is named by, the program and the model are
    still the bytes that ran (one line naming what changed otherwise)."""
    folder = Path(folder)
    request = folder / "request"
    try:
        call = json.loads((folder / CALL_FILE).read_text())
        text = (request / "request.json").read_text()
        tokens = np.load(request / "tokens.npy", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UsageError(f"{folder}: the kept request cannot be read: {e}") from None
    sha = hashlib.sha256(text.encode()).hexdigest()
    if sha != folder.name or call.get("request_sha256") != sha:
        raise UsageError(f"{request / 'request.json'} has sha256 {sha}, not the {folder.name} it was kept as")
    kept = KeptCall(folder, call, json.loads(text), text, tokens)
    ran, model_sha = str(call.get("program_sha256", "?")), str(call["model"].get("sha256", "?"))
    if not kept.program.is_file() or program_digest(kept.program) != ran:
        raise UsageError(f"{kept.program}: the program that ran (sha256 {ran[:16]}) is gone or changed; rebuild "
                         "that engine's source to replay it")
    if not kept.model.exists() or model_pointer(kept.model)["sha256"] != model_sha:
        raise UsageError(f"{kept.model}: the model the engine was handed (sha256 {model_sha[:16]}) is gone or changed")
    return kept
