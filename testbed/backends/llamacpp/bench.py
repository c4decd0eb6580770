"""llama-bench on this host, one process per call, with what the process used.

llama-bench is llama.cpp's own measure (its JSON: per test the repetitions' samples_ns and samples_ts, the
model's type, size and parameter count as llama.cpp reads them); it says nothing of the CPU time or the
memory its process took. `run` starts it (testbed.children) through tb_peak_rss, the wrapper every engine
request runs through (testbed.backends.engine.peak_rss): the wrapper reaps it and writes its peak resident
set (VmHWM, exact at exit). Its CPU time is this process's children's CPU time (getrusage RUSAGE_CHILDREN)
after the run less before: the wrapper and llama-bench, every thread, from start to exit (the model load,
the warm-up and the timed repetitions together), since nothing else of this process is reaped meanwhile.
"""

from __future__ import annotations

import json
import resource
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from testbed import children
from testbed.backends import Evidence
from testbed.backends.engine import peak_rss
from testbed.backends.llamacpp import output as out
from testbed.devices.transport import elf_machine, quoted, sha256_file
from testbed.errors import DeviceError


@dataclass
class BenchRun:
    """One llama-bench process: its one test's row and JSON object, and what the process used."""

    row: out.BenchRow
    raw: dict                    # llama-bench's JSON object for the test (every field it prints)
    process_cpu_s: float         # user + system seconds of the whole process (load, warm-up, repetitions)
    peak_rss_bytes: int | None   # the process's VmHWM at exit (tb_peak_rss), None where it was not read
    evidence: Evidence


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(program: Path, argv: list[str], timeout: float, device: str = "host") -> BenchRun:
    """`program` with `argv` (which must ask for `-o json` and one test), on this host. A non-zero exit,
    a kill, an output without exactly one result: DeviceError (exit 4), quoting its last stderr line."""
    command = [str(program), *argv]
    wrapper = peak_rss.build("host")  # its path, or why the peak is not read
    with tempfile.TemporaryDirectory(prefix="testbed-llama-bench-") as tmp:
        memory_file = Path(tmp) / peak_rss.OUTPUT
        wrapped = [str(wrapper), str(memory_file), *command] if isinstance(wrapper, Path) else command
        cpu = _children_cpu_seconds()
        try:
            done = children.run(wrapped, capture_output=True, text=True, errors="replace", timeout=timeout, cwd=tmp)
        except subprocess.TimeoutExpired:
            raise DeviceError(f"{device}: llama-bench did not finish in {timeout:g} s; killed: {quoted(command)}") from None
        cpu = _children_cpu_seconds() - cpu
        peak = json.loads(memory_file.read_text())["peak_rss_kb"] * 1024 if memory_file.is_file() else None
    if done.returncode != 0:
        last = " | ".join(done.stderr.strip().splitlines()[-2:]) or "no output"
        raise DeviceError(f"{device}: llama-bench exited {done.returncode}: {last}")
    rows = out.parse_bench(done.stdout)
    objects = json.loads(done.stdout)
    if len(rows) != 1 or len(objects) != 1:
        raise DeviceError(f"{device}: llama-bench printed {len(rows)} results; one test was asked ({quoted(command)})")
    raw = objects[0]
    wall = sum(raw.get("samples_ns") or [0]) / 1e9
    ran = Evidence(device, program.name, sha256_file(program), quoted(wrapped), wall,
                   {"clock": "llama-bench's own (samples_ns); process CPU from this process's children's rusage",
                    "peak_rss_bytes" if peak is not None else "peak_rss": peak if peak is not None else wrapper,
                    "peak_rss_how": peak_rss.HOW, "elf_machine": elf_machine(program),
                    "build_commit": raw.get("build_commit"), "cpu_info": raw.get("cpu_info"),
                    "backends": raw.get("backends")})
    return BenchRun(rows[0], raw, cpu, peak, ran)
