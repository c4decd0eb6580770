"""Exact instruction counts: the regression signal for native code that load cannot move.

Time on a shared machine is noise (per-run medians move +-20% at load 15-25); the number of instructions
a program executes on given inputs is not. Like rustc-perf (instructions:u) and SQLite (cachegrind),
testbed counts them:

  emulated devices  every ARM (or Hexagon) program that qemu-user runs for testbed, directly (the qemu
                    transport) or behind the loopback adbd, runs under a small TCG plugin built from
                    qemu_insn_plugin.c beside this file (host cc, cached by content under
                    .cache/counts/). The plugin writes COUNTS_FILE into the program's working folder.
  the host          valgrind's callgrind, when a run asks for counts (`counts=true`): the program runs
                    once more under it, never in a timed run.

Both count the instructions executed between the harness's marks (tb_count_begin / tb_count_end in
kernels/bench/harness.c), one region per timed call: the kernel's instructions, apart from process
start, input loading and output writing. A count is stored as what it is: instructions on that ISA, by
that toolchain's build, never time. Identical inputs and program give identical counts; a change of one
instruction is a change.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from testbed import children
from testbed.errors import DeviceError, ToolMissing

PLUGIN_SOURCE = Path(__file__).with_name("qemu_insn_plugin.c")
# Written by the plugin into the emulated program's working folder (a run folder of its own).
COUNTS_FILE = ".tb_instructions.json"
# Where callgrind writes its dumps in the run folder: FILE.1, FILE.2, ... two per timed call (valgrind_argv).
CALLGRIND_FILE = ".tb_callgrind.out"
MARKS = ("tb_count_begin", "tb_count_end")  # the harness's marks, in the order each timed call makes them


class CountError(DeviceError):
    """No count could be had, or what the counter wrote cannot be trusted; the message says why."""


def _cache_root() -> Path:
    from testbed import PROJECT_ROOT

    return PROJECT_ROOT / ".cache" / "counts"


def plugin_path() -> Path:
    """The QEMU plugin, compiled from its source at first use and cached by the source's hash (and the
    compiler's identity), so an edited plugin is rebuilt and an unchanged one never is."""
    source = PLUGIN_SOURCE.read_bytes()
    cc = os.environ.get("HOST_CC", "cc")
    digest = hashlib.sha256(source + b"\0" + cc.encode()).hexdigest()[:16]
    out = _cache_root() / f"libtb_insn-{digest}.so"
    if out.is_file():
        return out
    if shutil.which(cc) is None:
        raise ToolMissing(f"no C compiler {cc!r} to build the instruction-counting plugin (HOST_CC names it, default "
                          "cc; Debian: apt-get install gcc)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    argv = [cc, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(tmp), str(PLUGIN_SOURCE)]
    p = children.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        tmp.unlink(missing_ok=True)
        said = " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:]) or "no output"
        raise ToolMissing(f"building the counting plugin failed: `{' '.join(argv)}` exited {p.returncode}: {said}; "
                          "counts need a working C compiler (HOST_CC names it, default cc; Debian: apt-get install gcc)")
    tmp.replace(out)  # atomic: a concurrent build of the same source leaves one whole file
    return out


def qemu_plugin_args() -> list[str]:
    """What to put between `qemu-ARCH` and the program: the plugin, writing COUNTS_FILE in the cwd."""
    return ["-plugin", f"{plugin_path()},out={COUNTS_FILE}"]


@dataclass(frozen=True)
class Counts:
    """What a counter saw in one program run: the instructions of each marked region (one per timed
    call, in order) and of the whole process."""

    regions: tuple[int, ...]
    total: int | None
    counter: str       # "qemu-tcg-plugin" or "valgrind-callgrind"
    exact: bool        # False when several guest threads shared the plugin's counter
    names: tuple[str, ...] = ("call",)  # the regions one timed repetition marks, in order

    def of(self, name: str) -> list[int]:
        """The counts of the regions called `name`, one per timed repetition."""
        k = len(self.names)
        return [self.regions[i] for i in range(len(self.regions)) if self.names[i % k] == name]

    @property
    def per_call(self) -> int:
        """The count of one call (the first marked name's): all timed calls of a run execute the same
        instructions on the same inputs; where they do not (state carried between calls), the median."""
        return self.median(self.names[0])

    def median(self, name: str) -> int:
        ordered = sorted(self.of(name))
        return ordered[len(ordered) // 2]

    def metadata(self) -> dict:
        return {"counter": self.counter, "exact": self.exact, "marks": list(self.names), "regions": list(self.regions),
                "program_total": self.total}


def parse_plugin_output(text: str, expected_regions: int | None = None, names: tuple[str, ...] = ("call",)) -> Counts:
    """The plugin's JSON -> Counts; refused when it is not the plugin's, or the regions do not match
    the timed calls the program was asked for (a marker missed or doubled: the count is not the
    kernel's)."""
    try:
        data = json.loads(text)
        regions = tuple(int(x) for x in data["regions"])
        total, exact = int(data["total"]), bool(data["exact"])
        unmatched, dropped = int(data["unmatched_markers"]), int(data["regions_dropped"])
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CountError(f"the counting plugin's output is not what it writes ({e}): {text[:200]!r}") from None
    if unmatched or dropped:
        raise CountError(f"the counting plugin saw {unmatched} unmatched marks and dropped {dropped} regions")
    _check_regions(regions, expected_regions)
    return Counts(regions, total, "qemu-tcg-plugin", exact, tuple(names))


_SUMMARY = re.compile(r"^(?:summary|totals):\s+(\d+)", re.M)
_TRIGGER = re.compile(r"^desc: Trigger: --dump-before=(\S+)", re.M)


def valgrind_argv(argv: list[str]) -> list[str]:
    """`argv` under callgrind, dumping (and so zeroing) its costs on entering either mark: dump 2N-1
    (CALLGRIND_FILE.2N-1) holds what ran before timed call N, dump 2N exactly the instructions of timed
    call N. Each dump names the mark that made it, so a doubled or missing mark is seen, as the QEMU
    plugin sees it (parse_callgrind_dumps)."""
    if shutil.which("valgrind") is None:
        raise ToolMissing("valgrind is not installed (Debian: apt-get install valgrind); host instruction counts "
                          "need it")
    return ["valgrind", "--tool=callgrind", "--quiet", f"--callgrind-out-file={CALLGRIND_FILE}",
            *(f"--dump-before={mark}" for mark in MARKS), "--dump-instr=no", "--compress-strings=no", *argv]


def parse_callgrind_dumps(dumps: list[str], expected_regions: int | None = None,
                          names: tuple[str, ...] = ("call",)) -> Counts:
    """The dumps' `summary:` lines (instructions, event Ir) -> Counts, one region per tb_count_end dump.
    Refused unless the marks came in pairs, begin then end (a mark doubled or missing: the count is not
    the kernel's), as the QEMU plugin refuses unmatched marks."""
    marks, summaries = [], []
    for i, text in enumerate(dumps, 1):
        summary, trigger = _SUMMARY.search(text), _TRIGGER.search(text)
        if not summary or not trigger:
            raise CountError(f"callgrind dump {i} has no {'summary' if not summary else 'trigger'} line")
        marks.append(trigger.group(1))
        summaries.append(int(summary.group(1)))
    paired = [MARKS[i % 2] for i in range(len(marks))]
    if marks != paired or len(marks) % 2:
        at = next((i for i, (m, p) in enumerate(zip(marks, paired)) if m != p), len(marks) - 1)
        raise CountError(f"callgrind saw unmatched marks: {marks[at]} at mark {at + 1} of {len(marks)}, where "
                         f"{paired[at] if marks != paired else MARKS[1]} was due (a doubled or missing mark)")
    _check_regions(tuple(summaries[1::2]), expected_regions)
    return Counts(tuple(summaries[1::2]), None, "valgrind-callgrind", True, tuple(names))


def _check_regions(regions: tuple[int, ...], expected: int | None) -> None:
    if not regions:
        raise CountError("the program ran no marked region (is it built with kernels/bench/harness.c's marks?)")
    if expected is not None and len(regions) != expected:
        raise CountError(f"the counter saw {len(regions)} marked regions, the program says it marked {expected}")
