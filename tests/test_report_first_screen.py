"""The report's first screen, read as a reader reads it (issue 46, item 3): after a day of commands, some runs
killed by a time limit, three engines on one case, the page must open on what broke, where, and what next.

The store is written by real runs (`python3 -m testbed ...`, the real results store) of several engines: the
project's testbed-c and a lab's honest build of it pass; the lab's build with a planted fault
(TB_FAULT_STATE_NOT_CARRIED, tests/test_engine_contract.py) fails and keeps its request for replay; a lab engine
whose yaml is not built for aarch64 is refused on qemu-aarch64 (not supported); and runs stopped by a real
signal after their first verdict: SIGTERM (what `timeout` sends: the run stores "interrupted by SIGTERM") on the
host, SIGKILL (no end mark at all) on a lab's second local device. What the page must say is computed here from
those runs, not copied from the report's code; the first screen is measured in headless Chromium at 1400 x 900.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from testbed.backends.native import build as kernel_build
from testbed.report import build as report
from testbed.results import ResultsStore
from tests.test_engine_contract import SMALL, TAIL_SMALL, declining_engine, lab_engine
from tests.test_report import CHROMIUM, FIXTURES, chromium

HOST_PROFILE = kernel_build.ROOT / "devices" / "host.yaml"
SECOND_DEVICE = "bench-box"  # a lab's second local device: only a killed run ever ran there


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(kernel_build.ROOT), **env}, stdin=subprocess.DEVNULL)


def stopped_after_first_verdict(env: dict, signum: int, *args: str) -> str:
    """`testbed run ARGS`, sent `signum` the moment it prints its first verdict (an event, never a timer);
    the run's id, read from the store."""
    before = {r["run_id"] for r in ResultsStore(Path(env["TESTBED_RESULTS"])).records()} \
        if (Path(env["TESTBED_RESULTS"]) / ResultsStore.FILE).exists() else set()
    proc = subprocess.Popen([sys.executable, "-m", "testbed", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(kernel_build.ROOT), **env})
    for line in proc.stderr:
        if "PASS " in line:
            proc.send_signal(signum)
            break
    proc.communicate(timeout=600)
    assert proc.returncode in (128 + signum, -signum), proc.returncode
    (run,) = {r["run_id"] for r in ResultsStore(Path(env["TESTBED_RESULTS"])).records()} - before
    return run


@pytest.fixture(scope="module")
def day(tmp_path_factory) -> dict:
    """A day of commands: each engine's run, a refusal, two runs stopped by signals; what each left."""
    root = tmp_path_factory.mktemp("day")
    lab, results = root / "lab", root / "results"
    lab_engine(lab, "toy")
    lab_engine(lab, "faulty", ("TB_FAULT_STATE_NOT_CARRIED",))
    declining_engine(lab, "hostonly", "{techniques: [chunk_prefill, tail]}")
    (lab / "never-built").write_text("#!/bin/sh\nexit 9\n")  # for the host; qemu-aarch64 is refused by the yaml alone
    (lab / "devices").mkdir()
    (lab / "devices" / f"{SECOND_DEVICE}.yaml").write_text(
        HOST_PROFILE.read_text().replace("name: host", f"name: {SECOND_DEVICE}", 1))
    env = {"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results)}
    for engine, status in (("testbed-c", 0), ("toy", 0), ("faulty", 1)):
        done = cli(env, "run", "chunk_prefill", "backend=engine", f"engine={engine}", *SMALL)
        assert done.returncode == status, done.stderr[-2000:]
    refused = cli(env, "run", "tail", "backend=engine", "engine=hostonly", *TAIL_SMALL, "device=qemu-aarch64")
    assert refused.returncode == 7, refused.stderr[-2000:]
    # the same case as testbed-c's complete run above, stopped later: the page must go on showing the complete one
    interrupted = stopped_after_first_verdict(env, signal.SIGTERM, "chunk_prefill", "backend=engine",
                                              "engine=testbed-c", *SMALL)
    killed = stopped_after_first_verdict(env, signal.SIGKILL, "chunk_prefill", "backend=engine", "engine=toy",
                                         *SMALL, f"device={SECOND_DEVICE}")
    return {"results": results, "env": env, "interrupted": interrupted, "killed": killed,
            "records": ResultsStore(results).records()}


def built(day: dict, out: Path) -> dict:
    done = cli(day["env"], "report", "--out", str(out))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr  # the planted fault fails
    return json.loads((out / "report.json").read_text())


def failing_of(day: dict) -> list[dict]:
    return [r for r in day["records"] if r["kind"] == "oracle" and r["verdict"] == "fail"]


# Runs in the page once it has loaded: the window, the page's height and width, and where each part of the
# first screen lies (measured before the probe's own text is added).
SCREEN_PROBE = """<script>
window.addEventListener("load", () => {
  const box = e => { const r = e.getBoundingClientRect();
                     return {text: e.textContent, top: r.top, bottom: r.bottom, right: r.right}; };
  const matrix = document.querySelector("#oracles .table-box");
  const found = {window: [window.innerWidth, window.innerHeight],
    page: [document.documentElement.scrollWidth, document.documentElement.scrollHeight],
    devices: [...document.querySelectorAll("p.verdict")].map(box),
    worst: [...document.querySelectorAll("#worst, p.worst")].map(box),
    commands: [...document.querySelectorAll(".first pre")].map(box),
    sections: [...document.querySelectorAll("details.section")].map(d => [d.id, d.open]),
    matrix: matrix && (matrix.parentElement.open = true, {style: getComputedStyle(matrix).overflow,
      height: getComputedStyle(matrix).maxHeight, right: matrix.getBoundingClientRect().right,
      page: document.documentElement.scrollWidth, scroll: [matrix.scrollWidth, matrix.clientWidth]})};
  const probe = document.createElement("pre");
  probe.id = "probe";
  probe.textContent = JSON.stringify(found);
  document.body.appendChild(probe);
});
</script>"""


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed (scripts/bootstrap.sh --test)")
def test_the_first_screen_names_each_devices_state_and_the_worst_failure(day, tmp_path):
    content = built(day, tmp_path / "report")
    html = tmp_path / "report" / "report.html"
    probe = html.with_name("probe.html")
    probe.write_text(html.read_text().replace("<head>", "<head>\n" + SCREEN_PROBE, 1))
    dom = chromium("--window-size=1400,900", "--virtual-time-budget=5000", "--dump-dom", probe.as_uri(),
                   profile=tmp_path / "profile")
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = json.loads(dom.stdout.split('<pre id="probe">', 1)[1].split("</pre>", 1)[0].replace("&quot;", '"')
                       .replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
    # the viewport a 1400 x 900 window leaves the page (headless Chromium keeps room for its own bars)
    assert found["window"][0] == 1400 and 600 < found["window"][1] <= 900, found["window"]
    screen = found["window"][1]

    # each device's state, on the first screen: red where the planted fault failed, amber where the only verdicts
    # were refusals, grey where the only run was killed
    expected = {"host": "red", "qemu-aarch64": "amber", SECOND_DEVICE: "grey"}
    said = {line["text"].split(":")[0]: line for line in found["devices"]}
    assert set(said) == set(expected)
    for device, colour in expected.items():
        assert said[device]["text"].startswith(f"{device}: {colour}. "), said[device]["text"]
        assert said[device]["bottom"] <= screen, (device, said[device])
    fails = failing_of(day)
    host_passes = sum(r["kind"] == "oracle" and r["verdict"] == "pass" and r["run_id"] != day["interrupted"]
                      and r["device"] == "host" for r in day["records"])
    assert f"{host_passes} pass, {len(fails)} fail, 0 not supported, 0 not judged, 1 not run (incomplete)" \
        in said["host"]["text"]
    assert "0 pass, 0 fail, 0 not supported, 0 not judged, 1 not run (incomplete)" in said[SECOND_DEVICE]["text"]
    refused = sum(r["kind"] == "oracle" and r["verdict"] == "not supported" and r["device"] == "qemu-aarch64"
                  for r in day["records"])
    assert refused and f"0 pass, 0 fail, {refused} not supported, 0 not judged, 0 not run" \
        in said["qemu-aarch64"]["text"]

    # the worst failure, named with its engine and case, on the first screen, and the commands that reproduce it
    heading, worst = found["worst"]
    assert heading["text"].startswith("Worst failure") and worst["bottom"] <= screen
    named = {(r["case"], r["oracle"]) for r in fails}
    assert worst["text"].startswith("FAIL chunk_prefill ") and "on host (engine:faulty)" in worst["text"]
    assert any(case in worst["text"] for case, _ in named)
    commands = [c["text"] for c in found["commands"]]
    run_again = "testbed run chunk_prefill backend=engine engine=faulty " + " ".join(
        f"'{o}'" if " " in o else o for o in SMALL) + " device=host"
    assert commands[0] == run_again, commands
    assert commands[1].startswith("python3 -m testbed engine replay --results ") and day["records"] and \
        any(r["run_id"] in commands[1] for r in fails)
    assert all(c["bottom"] <= screen for c in found["commands"][:2]), found["commands"]

    # below it every section folds, the page is short and never wider than the window; the oracle matrix
    # scrolls inside its own frame
    assert found["sections"] and not any(is_open for _, is_open in found["sections"])
    assert found["page"][0] <= 1400 and found["page"][1] < 3 * screen, found["page"]
    matrix = found["matrix"]
    assert matrix["style"] == "auto" and matrix["height"].endswith("px") and matrix["right"] <= 1400, matrix
    assert matrix["page"] <= 1400
    assert content["first_screen"]["worst"]["reproduce"] == run_again


def test_the_commands_the_first_screen_gives_reproduce_the_worst_failure(day, tmp_path):
    """The reader's next step, as printed: the run command fails again with the same oracles, and the replay
    command runs the engine's kept call once more."""
    import shlex

    content = built(day, tmp_path / "report")
    worst = content["first_screen"]["worst"]
    again = cli(day["env"], *shlex.split(worst["reproduce"])[1:])
    assert again.returncode == 1, again.stderr[-2000:]
    failed = {(r["case"], r["oracle"]) for r in failing_of(day)}
    again_failed = {(r["case"], r["oracle"]) for r in ResultsStore(day["results"]).records()
                    if r["kind"] == "oracle" and r["verdict"] == "fail" and r["run_id"] not in
                    {x["run_id"] for x in day["records"]}}
    assert again_failed == failed
    replay = cli(day["env"], *shlex.split(worst["replay"])[3:])
    assert replay.returncode == 0 and "Traceback" not in replay.stderr, replay.stderr[-2000:]  # the engine answered
    assert replay.stdout.strip(), replay.stderr[-2000:]


def test_killed_runs_read_incomplete_never_failing_nor_current(day, tmp_path):
    content = built(day, tmp_path / "report")
    stopped = {day["interrupted"]: "interrupted by SIGTERM", day["killed"]: "never ended (killed, or still running)"}
    # never current: no matrix cell, no table of the page but Incomplete runs holds their records
    assert not set(stopped) & set(content["current_runs"])
    ids = {r["record_id"][:12] for r in day["records"] if r["run_id"] in stopped}
    for section in content["sections"]:
        if section["id"] in ("incomplete", "glossary"):
            continue
        text = json.dumps(section)
        assert not any(i in text for i in ids) and not any(run in text for run in stopped), section["id"]
    # listed apart, grey, with how each ended and what it had reached
    (table,) = next(s for s in content["sections"] if s["id"] == "incomplete")["tables"]
    rows = {row["run"]: row for row in table["rows"]}
    assert {run: row["how it ended"] for run, row in rows.items()} == stopped
    reached = {run: sum(r["kind"] == "oracle" and r["verdict"] == "pass" and r["case"] != "run"
                        for r in day["records"] if r["run_id"] == run) for run in stopped}
    assert {run: row["reached"]["pass"] for run, row in rows.items()} == reached and min(reached.values()) >= 1
    complete = next(r["run_id"] for r in day["records"] if r["backend"] == "engine:testbed-c"
                    and r["run_id"] not in stopped)
    assert rows[day["interrupted"]]["shown instead"] == complete and rows[day["killed"]]["shown instead"] is None
    # never a failing verdict: the failures counted are the planted fault's alone
    assert content["summary"]["oracles_failed"] == len(failing_of(day))
    assert content["summary"]["incomplete_runs"] == 2
    grey = next(v for v in content["summary"]["verdicts"] if v["device"] == SECOND_DEVICE)
    assert grey["colour"] == "grey" and grey["counts"]["not_run"] == 1 and grey["counts"]["fail"] == 0


def test_a_killed_runs_figures_are_never_shown_as_current(tmp_path):
    """A run that stored figures and was then killed (its start mark and records, no end mark, as SIGKILL
    leaves them), newer than a complete run of the same config: the page shows the complete run's figures,
    and the killed run's are named under Incomplete runs, never in a table of figures or judged."""
    results = tmp_path / "results"
    env = {"TESTBED_RESULTS": str(results)}
    done = cli(env, "run", "gdn", "mode=bench", "bench.tokens=[48]", "bench.heads=2", "bench.head_size=32",
                   "bench.reps=2")
    assert done.returncode == 0, done.stderr[-2000:]
    store = ResultsStore(results)
    complete = store.records()
    run_id = uuid.uuid4().hex[:12]
    killed = []
    for r in complete:
        r = copy.deepcopy(r)
        r.pop("incomplete", None)
        for fig in r["figures"].values():  # ten times slower: a figure no table may show as current
            fig.update({k: fig[k] * 10 for k in ("median", "min", "max") if k in fig})
        r.update(run_id=run_id, record_id=uuid.uuid4().hex, started="2099-01-01T00:00:00+00:00")
        killed.append(r)
    start = {k: killed[0][k] for k in ("schema", "run_id", "started", "experiment", "device", "backend", "emulated",
                                       "host_load", "fingerprint", "config", "git_commit", "testbed_version", "time")}
    store.append([{**start, "run_mark": "started", "outcome": None, "host": "elsewhere", "pid": 1}, *killed])
    content = report.build(store.records(), tmp_path / "report", FIXTURES, report.settings())
    assert run_id not in content["current_runs"] and content["flags"] == []
    medians = {r["figures"]["time"]["median"] for r in killed if "time" in r["figures"]}
    shown = [row for s in content["sections"] if s["id"] not in ("incomplete",) for t in s["tables"]
             for row in t["rows"]]
    values = {v for row in shown for v in row.values() if isinstance(v, float)}
    assert medians and not medians & values
    assert {r["figures"]["time"]["median"] for r in complete if "time" in r["figures"]} <= values  # the complete run's
    (table,) = next(s for s in content["sections"] if s["id"] == "incomplete")["tables"]
    (row,) = table["rows"]
    assert row["run"] == run_id and row["figures"] == sum(len(r["figures"]) for r in killed if r["kind"] == "measure")
    host = next(v for v in content["summary"]["verdicts"] if v["device"] == "host")
    # bench figures alone: no verdict either way ("no oracle verdicts"), the killed run a count, never a failure
    assert host["colour"] == "amber" and "no oracle verdicts in its current runs" in host["reason"]
    assert host["counts"]["not_run"] == 1 and host["counts"]["fail"] == host["counts"]["error"] == 0


def test_what_regressed_names_the_engine_and_its_commits(tmp_path):
    """The first screen's "Regressed" lines and the Regressions table name the engine under test (three
    engines may run one case) and the commit range; what to do next compares those commits."""
    from tests.test_report_judging import planted

    def of_an_engine(record: dict) -> dict:  # the planted nights, as an engine's (backend=engine engine=testbed-c)
        record = copy.deepcopy(record)
        if record["experiment"] == "native_bench":
            record["config"] = {**record["config"], "backend": "engine", "engine": "testbed-c"}
            record["backend"] = "engine:testbed-c"
        return record

    content = report.build([of_an_engine(r) for r in planted({"k1"}, ab=False)], tmp_path / "report", FIXTURES,
                           report.settings())
    flags = content["flags"]
    regressed = content["first_screen"]["regressed"]
    assert flags and len(regressed) == len(flags)
    for flag, line in zip(flags, regressed):
        assert f"on {flag['device']} (engine:testbed-c): {flag['case']}" in line["line"]
        assert f"commits {flag['commit_range']}" in line["line"]
    (table,) = next(s for s in content["sections"] if s["id"] == "regressions")["tables"]
    assert {row["backend"] for row in table["rows"]} == {"engine:testbed-c"}
    compare = [step["command"] for step in content["first_screen"]["next"] if step["command"]]
    first = flags[0]
    assert compare == [f"testbed compare {first['last_clean_commit'][:12]} {first['since_commit'][:12]}"]
    page = (tmp_path / "report" / "report.html").read_text()
    assert "Regressed (" in page and page.index("Regressed (") < page.index('<details class="section"')
