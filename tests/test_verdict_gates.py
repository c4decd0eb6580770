"""Verdicts in four states, read as a gate (testbed.verdicts): a refusal ("not supported") and a verdict not
judged are never a failure and never a pass. A run exits 0 when something was judged and nothing failed, 1 only
for a failed oracle, 7 when nothing was judged; summaries count each state; an honest engine that exposes no
K/V exits 0, and the same engine with a wrong pinned token exits 1.

The engines are testbed-c behind a wrapper (tests.test_engine_contract.wrapper_engine) that drops its cache/
(the cache oracle: not supported) or answers every request with a refusal."""

from __future__ import annotations

import json

import pytest

from tests.test_engine_contract import SMALL, cli, wrapper_engine
from testbed import runner
from testbed.devices import load_profile
from testbed.oracles.numerical import Verdict
from testbed.results import Record
from testbed.verdicts import ERROR, FAIL, NOT_JUDGED, NOT_SUPPORTED, NOTHING_JUDGED, PASS, Tally, of

NO_CACHE = "import shutil; shutil.rmtree(out / 'cache')"
REFUSE = """\
    for f in out.iterdir():
        f.unlink() if f.is_file() else None
    (out / 'status.json').write_text(json.dumps({'contract': 1, 'status': 'refused', 'reason': 'no past, ever'}))
    """


@pytest.mark.quick
@pytest.mark.parametrize("states, status, phrase", [
    ([PASS, PASS, NOT_SUPPORTED], 0, "2 pass, 1 not supported"),
    ([PASS, FAIL, NOT_SUPPORTED], 1, "1 pass, 1 fail, 1 not supported"),
    ([NOT_SUPPORTED, NOT_JUDGED], NOTHING_JUDGED, "1 not supported, 1 not judged"),
    ([PASS, ERROR], 1, "1 pass, 1 error"),
    ([], 0, "no verdicts"),  # a run that only measures
])
def test_a_tally_says_each_state_and_its_exit_status(states, status, phrase):
    tally = Tally(states)
    assert tally.exit_status() == status and tally.phrase() == phrase


def test_a_pass_of_an_incomplete_run_or_an_unknown_verdict_reads_as_an_error():
    assert of({"verdict": PASS, "incomplete": True}) == ERROR
    assert of({"verdict": "passed"}) == ERROR
    assert of({"verdict": NOT_SUPPORTED, "incomplete": True}) == NOT_SUPPORTED
    assert Tally.of_records([{"kind": "oracle", "verdict": PASS, "incomplete": True}]).exit_status() == 1


@pytest.mark.quick
def test_a_verdict_not_judged_is_never_a_pass():
    v = Verdict.not_judged("state_bytes", "state.bin cannot be told from an empty one")
    assert v.verdict == NOT_JUDGED and not v.passed
    with pytest.raises(ValueError):
        Verdict("x", True, 1.0, unjudged=NOT_SUPPORTED)


def test_a_refusal_on_an_emulated_device_needs_no_evidence_but_a_verdict_does():
    """A refusal claims nothing was computed: it is stored without evidence on any device (it used to break
    the run, exit 4, "carry no evidence that the device computed them"); a pass still needs its evidence."""
    profile = load_profile("qemu-aarch64")
    runner.check_evidence([Record("tail", "state/x", "oracle", "state_bytes", NOT_SUPPORTED, detail="refused")],
                          profile)
    with pytest.raises(runner.ComputedElsewhere):
        runner.check_evidence([Record("tail", "state/x", "oracle", "state_bytes", PASS)], profile)


@pytest.fixture
def lab(tmp_path, monkeypatch):
    folder = tmp_path / "lab"
    folder.mkdir()
    monkeypatch.setenv("TESTBED_LAB", str(folder))
    return folder


@pytest.mark.quick
def test_an_honest_engine_without_a_cache_exits_0_and_a_wrong_pinned_token_exits_1(lab, results_dir):
    wrapper_engine(lab, "nocache", NO_CACHE)
    env = {"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)}
    p = cli("run", "chunk_prefill", "backend=engine", "engine=nocache", *SMALL, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "oracles 3 pass, 1 not supported" in p.stdout and "\nNOT SUPPORTED " in p.stdout, p.stdout
    token = next(json.loads(line)["metrics"]["token_ref"] for line in (results_dir / "records.jsonl").open()
                 if '"oracle": "token"' in line)
    wrong = cli("run", "chunk_prefill", "backend=engine", "engine=nocache", *SMALL,
                f"model.expected_token={(token + 1) % 256}", env=env)
    assert wrong.returncode == 1 and "\nFAIL " in wrong.stdout, wrong.stdout + wrong.stderr
    right = cli("run", "chunk_prefill", "backend=engine", "engine=nocache", *SMALL, f"model.expected_token={token}",
                env=env)
    assert right.returncode == 0, right.stdout + right.stderr


def test_a_sweep_counts_refusals_apart_from_failures(lab, results_dir):
    wrapper_engine(lab, "nocache", NO_CACHE)
    p = cli("sweep", "experiment=chunk_prefill", "backend=engine", "engine=nocache", "chunk=4,8", *SMALL[:2],
            env={"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 runs, oracles 6 pass, 2 not supported" in p.stdout and "failure" not in p.stdout, p.stdout


def test_an_engine_that_refuses_everything_judged_nothing_exit_7(lab, results_dir, tmp_path):
    wrapper_engine(lab, "refuser", REFUSE)
    env = {"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)}
    p = cli("run", "chunk_prefill", "backend=engine", "engine=refuser", *SMALL, env=env)
    assert p.returncode == NOTHING_JUDGED, p.stdout + p.stderr
    assert "oracles 4 not supported" in p.stdout and "NOTHING JUDGED" in p.stdout and "no past, ever" in p.stdout
    report = cli("report", f"--out={tmp_path / 'report'}", env=env)
    assert report.returncode == NOTHING_JUDGED, report.stdout + report.stderr
    page = (tmp_path / "report" / "report.json").read_text()
    [banner] = json.loads(page)["summary"]["verdicts"]
    assert banner["colour"] == "amber" and "nothing judged" in banner["reason"] and "no past, ever" in banner["reason"]
    assert 'class="unjudged' in (tmp_path / "report" / "report.html").read_text()  # grey, never red


def test_a_device_test_fails_on_a_fail_and_skips_when_nothing_was_judged():
    """pytest --device reads verdicts as the CLI does (testbed.pytest_plugin.judge): a refusal is a skip with
    the engine's words, never a pass; a fail fails the test whatever else passed."""
    from testbed.pytest_plugin import judge
    from testbed.results import RunInfo

    def outcome(*states):
        info = RunInfo(experiment="tail", device="qemu-aarch64", backend="engine:x", config={}, fingerprint={})
        return runner.Outcome(info, [{"kind": "oracle", "case": f"c{i}", "verdict": v, "detail": f"said {i}"}
                                     for i, v in enumerate(states)])

    assert judge(outcome(PASS, NOT_SUPPORTED)).phrase() == "1 pass, 1 not supported"
    with pytest.raises(pytest.skip.Exception, match="nothing judged .*NOT SUPPORTED c0: said 0"):
        judge(outcome(NOT_SUPPORTED, NOT_JUDGED))
    with pytest.raises(pytest.fail.Exception, match="1 pass, 1 fail; c1: fail: said 1"):
        judge(outcome(PASS, FAIL))
