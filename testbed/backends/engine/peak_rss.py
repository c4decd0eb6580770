"""Peak memory of an engine run: the engine process's peak resident set size (VmHWM), read on the device.

Every engine request runs through tb_peak_rss (tb_peak_rss.c beside this file), a wrapper that starts the
engine, reaps it with wait4 and writes its ru_maxrss: the kernel's high-water mark of the process's
resident memory (VmHWM of /proc/PID/status, kept up to the process's exit), in kilobytes. Exact, read at
exit, the same for a C engine and a Python adapter; nothing is sampled. The wrapper is built per build
target (host: cc; arm32 and aarch64: Debian's static cross gcc), cached by content in .cache/engines/.

Where it is not read, the reason is said (wrapper_for returns it): an emulated device (under qemu-user
the process's resident memory is the emulator's, not a phone's), the host under valgrind (valgrind's own
memory), a target no compiler here builds it for (hexagon).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from testbed import children
from testbed.backends.native.build import ROOT
from testbed.devices import Device

SOURCE = Path(__file__).with_name("tb_peak_rss.c")
CACHE_DIR = ROOT / ".cache" / "engines"
PROGRAM = "tb_peak_rss"
OUTPUT = "peak_rss.json"        # in the run folder, beside request/ and response/
HOW = "VmHWM of the engine process at exit (wait4's ru_maxrss through tb_peak_rss)"
COMPILERS = {"host": ["cc"], "aarch64": ["aarch64-linux-gnu-gcc", "-static"],
             "arm32": ["arm-linux-gnueabihf-gcc", "-static"]}


def build(target: str) -> Path | str:
    """The wrapper for `target`, or why there is none."""
    if target not in COMPILERS:
        return f"not read: no compiler here builds tb_peak_rss for {target}"
    compiler = COMPILERS[target]
    if shutil.which(compiler[0]) is None:
        return f"not read: {compiler[0]} (which builds tb_peak_rss for {target}) is not installed"
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(compiler).encode()).hexdigest()[:16]
    out = CACHE_DIR / f"peak-rss-{target}-{key}" / PROGRAM
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{PROGRAM}.tmp{os.getpid()}")
    p = children.run([*compiler, "-std=c99", "-O2", "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
    if p.returncode != 0:
        tmp.unlink(missing_ok=True)
        return f"not read: tb_peak_rss did not build for {target}: {(p.stderr or p.stdout).strip().splitlines()[:1]}"
    tmp.rename(out)
    return out


def wrapper_for(device: Device, target: str, valgrind: bool) -> Path | str:
    """The wrapper that reads the engine's peak RSS on `device`, or the reason it is not read there."""
    if device.profile.has("emulated"):
        return "not read: the device is emulated (under qemu-user resident memory is the emulator's)"
    if valgrind:
        return "not read: the engine ran under valgrind (its memory is valgrind's)"
    return build(target)
