"""Bad input is refused before a run's start mark: exit 2, one line, nothing written (issue 44). Found by
running bad-input commands against an empty TESTBED_RESULTS: an engine whose prebuilt program is not a file
was refused only inside the run, which then stored a broken run (its start mark, an error record, its end
mark) for what was a mistake in the input. An engine not built for the device is not bad input: it declines
the device, and its run records that refusal (not supported, exit 7)."""

from __future__ import annotations

import json
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


def lab_with_two_engines(tmp_path):
    """A lab holding `armonly` (built for aarch64 alone) and `missing` (its prebuilt program is not there)."""
    lab = tmp_path / "lab"
    (lab / "engines").mkdir(parents=True)
    (lab / "prog.sh").write_text("#!/bin/sh\nexit 0\n")
    (lab / "prog.sh").chmod(0o755)
    (lab / "engines" / "armonly.yaml").write_text(ENGINE.format(name="armonly", abi="aarch64", program="prog.sh"))
    (lab / "engines" / "missing.yaml").write_text(ENGINE.format(name="missing", abi="host", program="nothere"))
    return lab


def run_testbed(command, lab, results):
    return subprocess.run([sys.executable, "-m", "testbed", *command], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results)})


@pytest.mark.parametrize("command", [
    ["run", "tail", "backend=engine", "engine=missing", *SMALL],
    ["ab", "engine:testbed-c", "engine:missing", "experiment=chunk_prefill"],
    ["ab", "engine:armonly", "engine:missing", "experiment=chunk_prefill"],
], ids=["run", "ab-B", "ab-both"])
def test_an_engine_whose_prebuilt_is_not_a_file_is_refused_before_the_run_starts(command, tmp_path):
    """A yaml naming a program that is not there is the lab's mistake: exit 2, one line naming file, key and
    value and what is accepted, nothing stored."""
    lab, results = lab_with_two_engines(tmp_path), tmp_path / "results"
    p = run_testbed(command, lab, results)
    assert p.returncode == 2, p.stderr
    (line,) = said(p.stderr)
    assert line.startswith(f"testbed: error: {lab}/engines/missing.yaml: build.prebuilt.host='../nothere' is not a "
                           "file; accepted: "), line
    assert not (results / "records.jsonl").exists()


@pytest.mark.parametrize("command, device", [
    (["run", "chunk_prefill", "backend=engine", "engine=armonly", *SMALL, "cases=[{past: 5, tokens: 7}]"], "host"),
    (["run", "chunk_prefill", "backend=engine", "engine=llamacpp", "device=qemu-arm32", *SMALL], "arm32"),
], ids=["lab-engine", "project-engine"])
def test_an_engine_not_built_for_the_device_is_not_supported_never_a_usage_error(command, device, tmp_path):
    """An engine whose yaml does not build for the device declines it (issue 42: a refusal on any device is
    "not supported", never a failure or a device error): every oracle is recorded not supported with the
    yaml's words, nothing is judged (exit 7), and no record reads as passed or failed."""
    lab, results = lab_with_two_engines(tmp_path), tmp_path / "results"
    p = run_testbed(command, lab, results)
    assert p.returncode == 7, p.stdout + p.stderr
    assert f"is not built for {device}" in p.stdout and "NOT SUPPORTED" in p.stdout, p.stdout
    records = [json.loads(line) for line in (results / "records.jsonl").read_text().splitlines()]
    oracles = [r for r in records if r.get("kind") == "oracle"]
    assert oracles and {r["verdict"] for r in oracles} == {"not supported"}, oracles
