"""llama-bench on this host, one process per call, with what the process used.

llama-bench is llama.cpp's own measure (its JSON: per test the repetitions' samples_ns and samples_ts, the
model's type, size and parameter count as llama.cpp reads them); it says nothing of the CPU time or the
memory its process took. `run` starts it as a child of this process and reaps it with os.wait4, whose
resource usage is that one child's CPU time (user + system, every thread, from start to exit: the model
load, the warm-up and the timed repetitions together). Its peak resident set: wait4's ru_maxrss where that is
the child's own, else VmHWM of /proc/PID/status read while it ran. Linux keeps ru_maxrss across execve, so a
child started by this process reads at least this process's own peak (VmHWM when it was started: this
process may hold a model's weights); above that it is the child's peak exactly. At or below it, the child's
own high-water mark read every LOOK_S while it ran (monotonic: the last reading is the greatest, and misses
at most what it grew in its last LOOK_S). The process is waited for LOOK_S at a time (testbed.stop: a signal
kills it and stops the run) and killed, with its process group, past `timeout`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from testbed import stop
from testbed.backends import Evidence
from testbed.backends.llamacpp import output as out
from testbed.devices.transport import elf_machine, quoted, sha256_file
from testbed.errors import DeviceError

LOOK_S = 0.01  # how often the child's memory and STOP are looked at while it runs


@dataclass
class BenchRun:
    """One llama-bench process: its one test's row and JSON object, and what the process used."""

    row: out.BenchRow
    raw: dict                # llama-bench's JSON object for the test (every field it prints)
    process_cpu_s: float     # user + system seconds of the whole process (load, warm-up, repetitions)
    peak_rss_bytes: int      # the process's peak resident set (see the module's docstring)
    process_wall_s: float
    evidence: Evidence


def run(program: Path, argv: list[str], timeout: float, device: str = "host") -> BenchRun:
    """`program` with `argv` (which must ask for `-o json` and one test), on this host. A non-zero exit,
    a kill, an output without exactly one result: DeviceError (exit 4), quoting its last stderr line."""
    command = [str(program), *argv]
    with tempfile.TemporaryDirectory(prefix="testbed-llama-bench-") as tmp:
        stdout_path, stderr_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with open(stdout_path, "w") as so, open(stderr_path, "w") as se:
            floor = high_water_bytes(os.getpid()) or 0  # what ru_maxrss reads at least: this process's peak
            t0 = time.monotonic()
            proc = subprocess.Popen(command, cwd=tmp, stdout=so, stderr=se, start_new_session=True)
            status, usage, polled = _reap(proc, timeout, quoted(command))
            wall = time.monotonic() - t0
        text, said = stdout_path.read_text(errors="replace"), stderr_path.read_text(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        last = " | ".join(said.strip().splitlines()[-2:]) or "no output"
        raise DeviceError(f"{device}: llama-bench exited {code}: {last}")
    rows = out.parse_bench(text)
    objects = json.loads(text)
    if len(rows) != 1 or len(objects) != 1:
        raise DeviceError(f"{device}: llama-bench printed {len(rows)} results; one test was asked ({quoted(command)})")
    exact = usage.ru_maxrss * 1024 > floor
    peak = usage.ru_maxrss * 1024 if exact else polled
    ran = Evidence(device, program.name, sha256_file(program), quoted(command), wall,
                   {"clock": "llama-bench's own (samples_ns); process_cpu_s from os.wait4",
                    "peak_rss": "os.wait4's ru_maxrss (above the starting process's own peak: the child's)" if exact
                                else f"VmHWM of /proc/PID/status read every {LOOK_S:g} s while it ran (ru_maxrss read "
                                     "the starting process's own peak)",
                    "elf_machine": elf_machine(program), "build_commit": objects[0].get("build_commit"),
                    "cpu_info": objects[0].get("cpu_info"), "backends": objects[0].get("backends")})
    return BenchRun(rows[0], objects[0], usage.ru_utime + usage.ru_stime, peak, wall, ran)


def high_water_bytes(pid: int) -> int | None:
    """VmHWM of a running process (Linux), or None when it cannot be read (gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reap(proc: subprocess.Popen, timeout: float, shown: str):
    """Wait for `proc` with os.wait4 (its own resource usage), its VmHWM read at every look, STOP looked at
    every LOOK_S: (wait status, rusage, the greatest VmHWM read). On a stop or past `timeout` its process group
    is killed (and reaped) first."""
    deadline = time.monotonic() + timeout
    peak = 0

    def kill():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.wait4(proc.pid, 0)
        proc.returncode = -signal.SIGKILL

    try:
        while True:
            stop.raise_if_stopped()
            peak = max(peak, high_water_bytes(proc.pid) or 0)  # a zombie has no memory left: read first
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid == proc.pid:
                proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
                return status, usage, peak
            if time.monotonic() > deadline:
                kill()
                raise DeviceError(f"llama-bench did not finish in {timeout:g} s; killed: {shown}")
            time.sleep(LOOK_S)
    except BaseException:
        if proc.returncode is None:
            kill()
        raise
