"""Bad input is refused before a run's start mark: exit 2, one line, nothing written (issue 44). Found by
running bad-input commands against an empty TESTBED_RESULTS: an engine not built for the device, or
whose prebuilt program is not a file, was refused only inside the run, which then stored a broken run
(its start mark, an error record, its end mark) for what was a mistake in the input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testbed import PROJECT_ROOT
from tests.cli_support import said

ENGINE = """\
name: {name}
contract: 1
build: {{prebuilt: {{{abi}: ../{program}}}}}
program: {program}
abis: [{abi}]
supports: {{techniques: [chunk_prefill, tail]}}
invoke: ["{{program}}", "{{request}}", "{{response}}"]
timeout_s: 60
counts: process
"""
SMALL = ["mode=oracle", "chunk=4"]


@pytest.mark.parametrize("command, says", [
    (["run", "chunk_prefill", "backend=engine", "engine=armonly", *SMALL, "cases=[{past: 5, tokens: 7}]"],
     "engine=armonly is not built for host ({lab}/engines/armonly.yaml: abis=['aarch64']); accepted devices: those "
     "of ABI aarch64"),
    (["run", "tail", "backend=engine", "engine=missing", *SMALL],
     "{lab}/engines/missing.yaml: build.prebuilt.host='{lab}/nothere' is not a file"),
    (["run", "chunk_prefill", "backend=engine", "engine=llamacpp", "device=qemu-arm32", *SMALL],
     "engine=llamacpp is not built for arm32"),
    (["ab", "engine:armonly", "engine:missing", "experiment=chunk_prefill"], "engine=armonly is not built for host"),
    (["ab", "engine:testbed-c", "engine:missing", "experiment=chunk_prefill"], "build.prebuilt.host="),
], ids=["abis", "prebuilt", "project-engine", "ab-A", "ab-B"])
def test_an_engine_that_cannot_run_on_the_device_is_refused_before_the_run_starts(command, says, tmp_path):
    lab, results = tmp_path / "lab", tmp_path / "results"
    (lab / "engines").mkdir(parents=True)
    (lab / "prog.sh").write_text("#!/bin/sh\nexit 0\n")
    (lab / "prog.sh").chmod(0o755)
    (lab / "engines" / "armonly.yaml").write_text(ENGINE.format(name="armonly", abi="aarch64", program="prog.sh"))
    (lab / "engines" / "missing.yaml").write_text(ENGINE.format(name="missing", abi="host", program="nothere"))
    p = subprocess.run([sys.executable, "-m", "testbed", *command], cwd=PROJECT_ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results)})
    assert p.returncode == 2, p.stderr
    (line,) = said(p.stderr)
    assert line.startswith("testbed: error: ") and says.format(lab=lab) in line, line
    assert not (results / "records.jsonl").exists()
