"""The exporter of an exporter-based engine (engines/NAME.yaml's `export:`), run on the host.

Labs ship exported runtimes (ExecuTorch, ONNX Runtime, LiteRT, MNN): the model is exported on a workstation
from its Hugging Face folder, and the runtime on the phone runs the export. testbed does the same: before
the engine's program runs on the device, the exporter's command runs here with {model} = the Hugging Face
folder testbed hands the engine (testbed.backends.engine.models) and {out} = a fresh folder, and the program
then reads that folder as request/model/ (pushed once per content, like any model).

  exported(spec, folder, values, say) -> Export     the export of `folder`, made once per content

An export is cached in .cache/exports/KEY/ by KEY = sha256 of: the folder's files (names and sha256),
the exporter's source tree (the yaml's `source`), the versions of the Python modules it names, its command,
and the request values its `keys` name (a fixed-size chunk graph is one export per C). What it reports
(Export.evidence: its key, size on disk, the seconds it took, the modules' versions) goes into the evidence
of every run that used it, and its size into the engines table.

Failures, each one line: a module the exporter needs that is not installed is exit 3 naming the pyproject
extra that installs it; an exporter that fails (non-zero exit, nothing written, a file that is not a plain
file) is exit 4 quoting its first error, its whole output kept in .cache/exports/KEY.log; a run
that is interrupted leaves no export behind. While it runs, testbed.heartbeat says "still exporting NAME
(N s)" at least every 25 s.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from testbed import children
from testbed.backends.engine.spec import EngineSpec
from testbed.backends.native.build import ROOT, tree_files
from testbed.devices.transport import sha256_file
from testbed.errors import DeviceError, ToolMissing, UsageError
from testbed.heartbeat import heartbeat

CACHE_DIR = ROOT / ".cache" / "exports"


class ExportFailed(DeviceError):
    """The exporter failed: exit 4, quoting its first error."""


@dataclass(frozen=True)
class Export:
    """An export testbed made (or found cached): the folder the program reads, and what it is."""

    engine: str
    folder: Path
    key: str
    size_bytes: int            # the files' bytes on disk: what a phone must hold
    seconds: float | None      # the exporter's wall time when it ran (None: unknown, an old cache entry)
    cached: bool               # found in .cache/exports/ rather than made by this call
    versions: dict             # the exporter's Python modules and their versions
    values: dict               # the request values the export depends on

    def evidence(self) -> dict:
        return {"export_key": self.key[:16], "export_bytes": self.size_bytes, "export_seconds": self.seconds,
                "export_cached": self.cached, "exporter_versions": self.versions,
                **({"export_values": self.values} if self.values else {})}


def _say_on_stderr(message: str) -> None:
    print(f"testbed: {message}", file=sys.stderr, flush=True)


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    """Top-level module -> the installed distributions providing it (read once: it scans every one)."""
    return importlib.metadata.packages_distributions()


def module_versions(spec: EngineSpec) -> dict[str, str]:
    """{module: version of the distribution that provides it} for every module the exporter names; a
    module that is not installed is ToolMissing (exit 3) naming the extra that installs it."""
    provides = _distributions()
    versions = {}
    for module in spec.export.modules:
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):  # a parent package missing, or broken
            found = None
        if found is None:
            raise ToolMissing(f"engine={spec.name}: its exporter needs the Python module {module!r}, which is not "
                              f"installed: pip install 'testbed[{spec.export.extra}]' ({spec.path}: export.modules)")
        top = module.split(".")[0]
        dists = sorted(set(provides.get(top, [])))
        versions[module] = ",".join(f"{d}=={importlib.metadata.version(d)}" for d in dists) or "unversioned"
    return versions


_DIGESTS: dict[tuple, str] = {}  # a folder's digest while its files keep their size and mtime (this process)


def folder_digest(folder: Path) -> str:
    """sha256 over a flat folder's files (names and contents' sha256), as the folder is pushed to a device.
    A run asks for one folder's export once per request: its bytes (a real checkpoint's gigabyte) are read
    again only when a file's name, size or mtime changed."""
    files = [p for p in sorted(Path(folder).iterdir()) if p.is_file() and not p.is_symlink()]
    seen = (str(Path(folder).resolve()), *((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    if seen not in _DIGESTS:
        h = hashlib.sha256()
        for path in files:
            h.update(path.name.encode() + b"\0" + sha256_file(path).encode() + b"\n")
        _DIGESTS[seen] = h.hexdigest()
    return _DIGESTS[seen]


def exporter_digest(spec: EngineSpec) -> str:
    """sha256 over the exporter's source: every file of the yaml's `source` (names and bytes) but the
    engine's prebuilt programs, which the export never reads (a changed adapter is not a new export)."""
    program_files = {p.resolve() for p in (spec.prebuilt or {}).values()}
    h = hashlib.sha256()
    for path in tree_files(spec.source):
        if path.resolve() not in program_files and "__pycache__" not in path.parts:
            h.update(path.relative_to(spec.source).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def export_key(spec: EngineSpec, folder: Path, values: dict, versions: dict) -> str:
    """What an export is cached by: the folder's content, the exporter's source, its modules' versions, its
    command and the request values its keys name (not the engine's name: two engines with one exporter,
    e.g. a lab's build of an adapter, share their exports)."""
    h = hashlib.sha256(json.dumps({"command": list(spec.export.command), "values": values, "versions": versions},
                                  sort_keys=True).encode())
    h.update(exporter_digest(spec).encode())
    h.update(folder_digest(folder).encode())
    return h.hexdigest()


def first_error(text: str) -> str:
    """The line of an exporter's output that says what went wrong first: the first exception line of a
    Python traceback (the cause, before any exception raised while handling it) or the first line that
    says error; else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    exception = re.compile(r"^([A-Za-z_][\w.]*)?(Error|Exception|Interrupt)\b(:|$)")
    for line in lines:
        if exception.match(line):
            return line
    said = next((line for line in lines if re.search(r"\berror\b", line, re.IGNORECASE)), None)
    return said or (lines[-1] if lines else "no output")


def _check_output(spec: EngineSpec, out: Path) -> int:
    """The bytes of the files the exporter wrote; what the contract cannot push (a subfolder, a link, an
    empty folder) is an ExportFailed."""
    size, files = 0, 0
    for path in sorted(out.iterdir()):
        if path.is_symlink() or not path.is_file():
            kind = "a link" if path.is_symlink() else "a folder"
            raise ExportFailed(f"engine={spec.name}: the exporter wrote {kind} {path.name!r}; the model folder an "
                               f"engine reads holds plain files only ({spec.path}: export.command)")
        size += path.stat().st_size
        files += 1
    if not files:
        raise ExportFailed(f"engine={spec.name}: the exporter exited 0 and wrote nothing in {{out}} "
                           f"({spec.path}: export.command)")
    return size


def _final_log(log: Path) -> Path:
    """Where a log written as KEY.tmpPID.log ends up: KEY.log."""
    return log.with_name(re.sub(r"\.tmp\d+\.log$", ".log", log.name))


def _run(spec: EngineSpec, argv: list[str], log: Path, say: Callable[[str], None]) -> float:
    """Run the exporter in its source folder, its output into `log`; its wall seconds. Its process group
    is killed on a timeout or when testbed is interrupted."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    began = time.monotonic()
    with open(log, "wb") as sink, heartbeat(f"exporting {spec.name}", say):
        try:  # a child of testbed's (testbed.children): a timeout, a stop or testbed's end ends it and all it started
            code = children.run(argv, cwd=spec.source, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                timeout=spec.export.timeout_s).returncode
        except FileNotFoundError:
            raise ToolMissing(f"engine={spec.name}: its exporter's tool {argv[0]!r} is not installed "
                              f"({spec.path}: export.command)") from None
        except subprocess.TimeoutExpired:
            raise ExportFailed(f"engine={spec.name}: the exporter did not finish within export.timeout_s="
                               f"{spec.export.timeout_s:g} ({spec.path}); killed, its output in "
                               f"{_final_log(log)}") from None
    if code != 0:
        text = log.read_text(errors="replace")
        if code == 3:  # the exporter's own word for a missing tool, as testbed's builders say it
            raise ToolMissing(f"engine={spec.name}: exporting: {first_error(text)} (pip install "
                              f"'testbed[{spec.export.extra}]')")
        raise ExportFailed(f"engine={spec.name}: the exporter exited {code}: {first_error(text)} (its output: "
                           f"{_final_log(log)})")
    return time.monotonic() - began


def exported(spec: EngineSpec, folder: Path, values: dict | None = None,
             say: Callable[[str], None] | None = None) -> Export:
    """The export of the Hugging Face `folder` for `spec`'s engine at the request `values` its keys name,
    made here once per content and reused after."""
    if spec.export is None:
        raise UsageError(f"engine={spec.name} has no export section ({spec.path})")
    say = say or _say_on_stderr
    values = {k: (values or {})[k] for k in spec.export.keys}
    versions = module_versions(spec)
    key = export_key(spec, Path(folder), values, versions)
    out = CACHE_DIR / key[:16]
    sidecar = out.with_name(out.name + ".json")
    if out.is_dir():
        known = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
        return Export(spec.name, out, key, _check_output(spec, out), known.get("seconds"), True, versions, values)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    fill = {"python": sys.executable, "source": str(spec.source), "model": str(Path(folder).resolve()),
            "out": str(tmp), **{k.replace(".", "_"): str(v) for k, v in values.items()}}
    argv = [part.format(**fill) for part in spec.export.command]
    shown = ", ".join(f"{k}={v}" for k, v in values.items())
    say(f"exporting {spec.name} from {folder}{f' at {shown}' if shown else ''} (once per content: "
        f".cache/exports/{out.name})")
    log = out.with_name(out.name + ".log")  # written under this process's name, then put in place whatever happens
    own_log = out.with_name(f"{out.name}.tmp{os.getpid()}.log")
    try:
        seconds = _run(spec, argv, own_log, say)
        size = _check_output(spec, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if own_log.exists():
            own_log.replace(log)
    sidecar.write_text(json.dumps({"engine": spec.name, "key": key, "seconds": seconds, "size_bytes": size,
                                   "versions": versions, "values": values, "command": argv[1:],
                                   "model": str(folder)}, indent=1) + "\n")
    try:
        tmp.rename(out)
    except OSError:  # another process finished the same export first
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"exported {spec.name} in {seconds:.0f} s: {size / 1e6:.1f} MB")
    return Export(spec.name, out, key, size, seconds, False, versions, values)
