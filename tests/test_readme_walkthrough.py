"""The README's walk-through ("Engine under test") runs as written: its adapter (C), Makefile and yaml are
taken from README.md, the lab's engine behind `my_engine.h` is tests/data/walkthrough/my_engine.c
(testbed's own model engine, kernels/tb_model.h), `/path/to/testbed` is this checkout, and each of the
five commands under them must exit 0: something judged, nothing failed (what the engine declines is "not
supported"). The commands run as the README prints them, sizes included (an emulated device takes its
profile's small sizes: devices/qemu-aarch64.yaml, `sizes`)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.backends.native.build import ROOT

README = ROOT / "README.md"
ENGINE = Path(__file__).parent / "data" / "walkthrough"

pytestmark = pytest.mark.skipif(any(shutil.which(t) is None for t in ("make", "aarch64-linux-gnu-gcc", "qemu-aarch64")),
                                reason="make, gcc-aarch64-linux-gnu and qemu-user (scripts/bootstrap.sh --test)")


def walkthrough() -> tuple[dict[str, str], list[str]]:
    """The section's fenced blocks by language (c, make, yaml) and its indented commands."""
    text = README.read_text()
    section = text[text.index("## Engine under test\n"):]
    section = section[:section.index("\n### ")]
    blocks = dict(re.findall(r"```(\w+)\n(.*?)```", section, re.S))
    prose = re.sub(r"```.*?```", "", section, flags=re.S)
    commands = [line.strip() for line in prose.splitlines() if line.startswith("    ")]
    return blocks, commands


def test_the_walkthrough_runs_as_written(tmp_path):
    blocks, commands = walkthrough()
    assert set(blocks) == {"c", "make", "yaml"} and commands[0] == "export TESTBED_LAB=$PWD/lab", commands
    lab = tmp_path / "lab"
    (lab / "mine").mkdir(parents=True)
    (lab / "engines").mkdir()
    (lab / "mine" / "adapter.c").write_text(blocks["c"])
    (lab / "mine" / "Makefile").write_text(blocks["make"].replace("/path/to/testbed", str(ROOT)))
    assert blocks["yaml"].startswith("# lab/engines/mine.yaml\n")
    (lab / "engines" / "mine.yaml").write_text(blocks["yaml"])
    for name in ("my_engine.h", "my_engine.c"):
        shutil.copy(ENGINE / name, lab / "mine" / name)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(tmp_path / "results")}
    for command in commands[1:]:
        argv = shlex.split(command, comments=True)
        assert argv[0] == "testbed", command
        p = subprocess.run([sys.executable, "-m", "testbed", *argv[1:]], capture_output=True, text=True, env=env,
                           cwd=tmp_path)
        assert p.returncode == 0, f"{command}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        assert "Traceback" not in p.stderr, p.stderr
