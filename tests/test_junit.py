"""JUnit XML from `testbed run`, `sweep` and `nightly` (--junit FILE; testbed.report.junit): every verdict in its
state, read back the way CI tools read it.

Two readers check each file: junitparser (the reader GitHub's publish-unit-test-result action uses; installed by
scripts/bootstrap.sh --test) for what each testcase says, and `schema_problems`, the structure of Jenkins'
junit-10.xsd (what the Jenkins junit and xunit plugins and GitLab's test reports accept) written out as rules:
its elements, their required attributes, counts that are integers and agree with the testcases. The verdicts
come from real runs through the CLI: a GDN oracle run whose NMSE threshold no float32 result can meet (fails
beside bit-exact passes), lab engines whose yaml declines the technique (not supported) or whose program exits
at once (an error), a run stopped by SIGTERM after its first verdict, and a nightly of the first of these; a
verdict "not judged" and an engine's control characters are planted in stored records.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from testbed.backends.native import build as kernel_build
from testbed.lab import nightly
from testbed.report import junit
from testbed.results import ResultsStore
from tests.test_engine_contract import SMALL, TAIL_SMALL, declining_engine
from tests.test_nightly import lab  # noqa: F401 -- the host, and a phone nobody answers for

junitparser = pytest.importorskip("junitparser", reason="scripts/bootstrap.sh --test installs it (testbed[junit])")

STRICT_GDN = ["gdn", "mode=oracle", "matrix=awkward", "threshold=1e-30"]  # NMSE fails, bit-exact passes

# Jenkins' junit-10.xsd, as rules: each element's allowed children and attributes, the required ones, the integers
ELEMENTS = {
    "testsuites": ({"testsuite"}, {"name", "time", "tests", "failures", "disabled", "errors", "skipped"}, set()),
    "testsuite": ({"properties", "testcase", "system-out", "system-err"},
                  {"name", "tests", "failures", "errors", "time", "disabled", "skipped", "timestamp", "hostname", "id",
                   "package", "file", "log", "url", "version", "group"}, {"name", "tests"}),
    "properties": ({"property"}, set(), set()),
    "property": (set(), {"name", "value"}, {"name", "value"}),
    "testcase": ({"skipped", "error", "failure", "system-out", "system-err"},
                 {"name", "assertions", "time", "classname", "status", "class", "file", "line", "log", "group", "url"},
                 {"name"}),
    "failure": (set(), {"type", "message"}, set()),
    "error": (set(), {"type", "message"}, set()),
    "skipped": (set(), {"message"}, set()),
}
INTEGERS = {"tests", "failures", "errors", "skipped", "disabled"}


def schema_problems(path: Path) -> list[str]:
    problems = []
    root = ET.parse(path).getroot()  # well-formed XML 1.0, or this raises
    if root.tag != "testsuites":
        problems.append(f"root is <{root.tag}>")

    def visit(element):
        children, attributes, required = ELEMENTS.get(element.tag, (None, None, None))
        if children is None:
            problems.append(f"<{element.tag}> is not in the schema")
            return
        problems.extend(f"<{element.tag}> lacks {a}" for a in required - set(element.attrib))
        problems.extend(f"<{element.tag}> has {a}" for a in set(element.attrib) - attributes)
        problems.extend(f"<{element.tag}> {a}={element.attrib[a]!r}" for a in INTEGERS & set(element.attrib)
                        if not element.attrib[a].isdigit())
        for child in element:
            if child.tag not in children:
                problems.append(f"<{child.tag}> inside <{element.tag}>")
            visit(child)
        if element.tag == "testcase" and len([c for c in element if c.tag in ("skipped", "error", "failure")]) > 1:
            problems.append(f"testcase {element.get('name')} has more than one result")
        if element.tag in ("testsuite", "testsuites"):  # the counts agree with the testcases
            cases = list(element.iter("testcase"))
            said = {"tests": len(cases)} | {k: sum(c.find(tag) is not None for c in cases)
                                            for k, tag in (("failures", "failure"), ("errors", "error"),
                                                           ("skipped", "skipped"))}
            problems.extend(f"<{element.tag}> {k}={element.get(k)} but {v} testcases" for k, v in said.items()
                            if element.get(k) != str(v))

    visit(root)
    return problems


def read_cases(path: Path) -> dict[str, tuple[str, str]]:
    """What junitparser reads: testcase (suite name + case name) -> (state, message)."""
    out = {}
    for suite in junitparser.JUnitXml.fromfile(str(path)):
        for case in suite:
            result = case.result
            kind = type(result[0]).__name__ if result else "Pass"
            out[f"{suite.name} :: {case.name}"] = (kind, result[0].message if result else "")
    return out


STATE = {"pass": "Pass", "fail": "Failure", "error": "Error", "not supported": "Skipped", "not judged": "Skipped"}


def expected_cases(records: list[dict]) -> dict[str, tuple[str, str]]:
    """Each stored verdict as a testcase, computed from the records (never from testbed.report.junit)."""
    out = {}
    for r in records:
        if r["kind"] != "oracle":
            continue
        impl_backend = r["backend"]
        name = r["case"] if not r.get("oracle") or r["case"].endswith(r["oracle"]) else f"{r['case']} {r['oracle']}"
        suite = f"{r['experiment']} on {r['device']} ({impl_backend}): run {r['run_id']}"
        out[f"{suite} :: {name}"] = (STATE[r["verdict"]], r.get("detail") or "")
    return out


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(kernel_build.ROOT), **env})


@pytest.fixture
def engines_lab(tmp_path) -> Path:
    folder = tmp_path / "lab"
    declining_engine(folder, "decliner", "{techniques: [chunk_prefill]}")  # declines the tail: not supported
    declining_engine(folder, "crasher", "{techniques: [chunk_prefill, tail]}")  # its program exits at once: an error
    (folder / "never-built").write_text("#!/bin/sh\necho 'crashed' >&2\nexit 9\n")
    (folder / "never-built").chmod(0o755)
    return folder


def test_run_junit_says_each_verdict_in_its_state(tmp_path):
    env = {"TESTBED_RESULTS": str(tmp_path / "results")}
    done = cli(env, "run", *STRICT_GDN, "--junit", str(tmp_path / "run.xml"))
    assert done.returncode == 1, done.stderr[-2000:]
    assert schema_problems(tmp_path / "run.xml") == []
    records = ResultsStore(tmp_path / "results").records()
    cases = read_cases(tmp_path / "run.xml")
    expected = expected_cases(records)
    assert {k: v[0] for k, v in cases.items()} == {k: v[0] for k, v in expected.items()}
    assert {"Pass", "Failure"} <= {kind for kind, _ in cases.values()}
    assert all(cases[k][1] == expected[k][1] for k in cases if cases[k][0] == "Failure")  # the oracle's own words


def test_sweep_junit_holds_refusals_as_skipped_and_a_crash_as_an_error(tmp_path, engines_lab):
    env = {"TESTBED_RESULTS": str(tmp_path / "results"), "TESTBED_LAB": str(engines_lab)}
    done = cli(env, "sweep", "experiment=tail", "backend=engine", "engine=decliner,crasher", *TAIL_SMALL,
               "--junit", str(tmp_path / "sweep.xml"))
    assert done.returncode == 4, done.stderr[-2000:]  # the crash ends the sweep; the file is still written
    assert schema_problems(tmp_path / "sweep.xml") == []
    records = ResultsStore(tmp_path / "results").records()
    cases = read_cases(tmp_path / "sweep.xml")
    assert {k: v[0] for k, v in cases.items()} == {k: v[0] for k, v in expected_cases(records).items()}
    refused = [message for kind, message in cases.values() if kind == "Skipped"]
    assert refused and all(m.startswith("not supported: engine=decliner does not support tail") for m in refused)
    (crashed,) = [message for kind, message in cases.values() if kind == "Error"]
    assert "crasher" in crashed or "exit" in crashed, crashed


def test_a_run_stopped_by_a_signal_reads_incomplete_never_passed(tmp_path):
    env = {"TESTBED_RESULTS": str(tmp_path / "results")}
    proc = subprocess.Popen([sys.executable, "-m", "testbed", "run", "chunk_prefill", "backend=engine",
                             "engine=testbed-c", *SMALL, "--junit", str(tmp_path / "stopped.xml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(kernel_build.ROOT), **env})
    for line in proc.stderr:
        if "PASS " in line:  # its first verdict: stopped the way `timeout` stops a command
            proc.send_signal(signal.SIGTERM)
            break
    proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM
    assert schema_problems(tmp_path / "stopped.xml") == []
    cases = read_cases(tmp_path / "stopped.xml")
    reached = [r for r in ResultsStore(tmp_path / "results").records() if r["kind"] == "oracle" and r["case"] != "run"]
    assert reached and all(r["verdict"] == "pass" for r in reached)
    kinds = [kind for kind, _ in cases.values()]
    assert "Pass" not in kinds and kinds.count("Skipped") == len(reached) and kinds.count("Error") == 1
    assert all(m.startswith("incomplete: the run was stopped before it ended (interrupted by SIGTERM)")
               for kind, m in cases.values() if kind == "Skipped")


def test_nightly_junit_fails_exactly_when_the_night_does(tmp_path, lab, results_dir):
    suites = tmp_path / "suite"
    suites.mkdir()
    (suites / "strict.yaml").write_text(textwrap.dedent(f"""\
        devices: [host, phone]
        runs:
          gdn:
            experiment: gdn
            devices: [host]
            overrides: [mode=oracle, matrix=awkward, threshold=1e-30]
        lock_dir: {tmp_path / 'locks'}
        lock_wait_s: 1
        report_out: {tmp_path / 'report'}
        """))
    status, _ = nightly.run_night(nightly.load_suite(["suite=strict"], suite_dir=suites), ResultsStore(results_dir),
                                  log=lambda *a: None, junit=tmp_path / "night.xml")
    assert status == 1
    assert schema_problems(tmp_path / "night.xml") == []
    cases = read_cases(tmp_path / "night.xml")
    records = ResultsStore(results_dir).records()
    runs = {k: v for k, v in cases.items() if not k.startswith("nightly ")}
    assert {k: v[0] for k, v in runs.items()} == {k: v[0] for k, v in expected_cases(records).items()}
    (phone,) = [v for k, v in cases.items() if k.endswith(":: device phone")]  # the phone has no run tonight
    assert phone[0] == "Error" and phone[1].startswith("unreachable: ")


def test_not_judged_and_an_engines_control_characters(tmp_path):
    """A verdict not judged is skipped with its reason; what an engine printed (an escape sequence, a NUL) is
    written so that the file stays XML (as \\xNN), never raw."""
    store = ResultsStore(tmp_path / "results")
    env = {"TESTBED_RESULTS": str(tmp_path / "results")}
    assert cli(env, "run", *STRICT_GDN).returncode == 1
    records = store.records()
    oracles = [r for r in records if r["kind"] == "oracle"]
    oracles[0].update(verdict="not judged", detail="no reference here")
    oracles[1].update(verdict="fail", detail="engine said \x1b[31mred\x00 and \ufffe")
    path = junit.write(tmp_path / "planted.xml", junit.run_suites(records))
    assert schema_problems(path) == []
    cases = read_cases(path)
    said = {k.split(" :: ", 1)[1]: v for k, v in cases.items()}
    name = lambda r: f"{r['case']} {r['oracle']}" if not r["case"].endswith(r["oracle"]) else r["case"]  # noqa: E731
    assert said[name(oracles[0])] == ("Skipped", "not judged: no reference here")
    assert said[name(oracles[1])] == ("Failure", "engine said \\x1b[31mred\\x00 and \\ufffe")
    assert "\x1b" not in path.read_text(encoding="utf-8")


def test_junit_is_written_whole_or_not_at_all(tmp_path):
    """Bad input writes nothing (one line, exit 2), and a folder given as the file is refused before anything runs."""
    env = {"TESTBED_RESULTS": str(tmp_path / "results")}
    bad = cli(env, "run", "gdn", "chunk=0", "--junit", str(tmp_path / "x.xml"))
    assert bad.returncode == 2 and not (tmp_path / "x.xml").exists()
    assert bad.stderr.strip().endswith("(usage: testbed run --help)"), bad.stderr
    folder = cli(env, "run", *STRICT_GDN, "--junit", str(tmp_path))
    assert folder.returncode == 2 and "is a folder" in folder.stderr and not (tmp_path / "results").exists()
    assert json.dumps(sorted(p.name for p in tmp_path.iterdir())) == json.dumps([])
