"""`testbed nightly`: real runs on the host, a second night compared with the first, devices in
parallel with a lock a second nightly respects, an unreachable device reported while the rest go on."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from testbed import PROJECT_ROOT, config
from testbed.cli import main
from testbed.devices.private import device_lock
from testbed.lab import nightly
from testbed.report import build as report_module
from testbed.results import ResultsStore


def run_cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=PROJECT_ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


def test_second_night_is_compared_with_the_first(tmp_path):
    env = {"TESTBED_RESULTS": str(tmp_path / "results")}
    lock = f"lock_dir={tmp_path / 'locks'}"
    first = run_cli("nightly", "suite=smoke", lock, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "first night: nothing to compare with yet" in first.stdout
    nights = report_module.night_log(tmp_path / "results")
    assert len(nights) == 1 and nights[0]["devices"]["host"]["status"] == "ok"

    second = run_cli("nightly", "suite=smoke", lock, env=env)
    print(second.stdout)
    # oracles are compared with the first night; figures need min_history earlier nights to be judged
    assert second.returncode == 0, second.stdout + second.stderr
    assert (f"compared with 1 earlier night(s), the last {nights[0]['night']}: 1/1 of tonight's configs have "
            f"earlier runs (oracles compared), 0/1 the {report_module.settings()['min_history']} needed to judge "
            "figures") in second.stdout
    report = json.loads((tmp_path / "results" / "report" / "report.json").read_text())
    night_table = next(s for s in report["sections"] if s["id"] == "nights")["tables"][0]
    assert len(night_table["rows"]) == 2
    history = next(s for s in report["sections"] if s["id"] == "history")
    assert history["images"] and (tmp_path / "results" / "report" / history["images"][0]["file"]).exists()
    runs = {r["run_id"] for r in ResultsStore(tmp_path / "results").records()}
    assert len(runs) == 2 and set(report["current_runs"]) <= runs
    assert second.stdout.strip().splitlines()[-1] == "exit 0: all oracles pass, no regression"


@pytest.fixture
def lab(tmp_path, monkeypatch):
    """A device folder with the host, a second local device, and an SSH device nobody answers for."""
    folder = tmp_path / "devices"
    folder.mkdir()
    shutil.copy(config.DEVICES_DIR / "host.yaml", folder / "host.yaml")
    (folder / "bench2.yaml").write_text(f"name: bench2\ntransport: local\nabi: host\ncapabilities: [cpu, refimpl]\n"
                                        f"work_dir: {tmp_path / 'bench2'}\n")
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (folder / "phone.yaml").write_text(f"name: phone\ntransport: ssh\nabi: arm64-v8a\nwork_dir: /tmp/testbed-phone\n"
                                       f"capabilities: [cpu, native]\n"
                                       f"connection: {{host: 127.0.0.1, port: {port}, user: nobody,\n"
                                       f"  key: {tmp_path / 'no_key'}, known_hosts: {tmp_path / 'known_hosts'}}}\n")
    monkeypatch.setitem(config.GROUPS, "device", folder)
    return folder


def write_suite(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.yaml").write_text(textwrap.dedent(body))
    return folder


class Lines(list):
    def __call__(self, device, message):
        self.append(f"[{device}] {message}")


def test_devices_in_parallel_busy_and_unreachable(tmp_path, lab, results_dir):
    suites = write_suite(tmp_path / "suite", "lab", f"""
        devices: [host, bench2, phone]
        runs:
          gdn:
            experiment: gdn
            overrides: [mode=oracle, matrix=awkward]
        lock_dir: {tmp_path / 'locks'}
        lock_wait_s: 1
        report_out: ""
    """)
    suite = nightly.load_suite(["suite=lab"], suite_dir=suites)
    assert {d: len(jobs) for d, jobs in suite.jobs.items()} == {"host": 1, "bench2": 1, "phone": 1}

    # another nightly on this machine holds bench2
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from testbed.devices.private import device_lock\n"
         f"with device_lock('bench2', 0, 'night other', Path({str(tmp_path / 'locks')!r})):\n"
         "    print('held', flush=True); sys.stdin.read()"],
        cwd=PROJECT_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        log = Lines()
        status, summary = nightly.run_night(suite, ResultsStore(results_dir), nightly.open_device, log)
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    print(summary)

    assert status == 3  # nothing failed, but not every device was there
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in summary.splitlines()[1:4]}
    assert rows["host"][0] == "ok" and "oracles 48 pass" in rows["host"][1]
    assert rows["bench2"][0] == "busy" and "night other" in rows["bench2"][1]
    assert rows["phone"][0] == "unreachable" and "refused" in rows["phone"][1]
    # one worker per device: the phone was given up while the host was still running its experiment
    first = lambda prefix: next(i for i, line in enumerate(log) if line.startswith(prefix))  # noqa: E731
    assert first("[phone] unreachable") < first("[host] ok")
    records = ResultsStore(results_dir).records()
    assert {r["device"] for r in records} == {"host"} and len(records) == 48
    (night,) = report_module.night_log(results_dir)
    assert {d: s["status"] for d, s in night["devices"].items()} == {"host": "ok", "bench2": "busy", "phone": "unreachable"}
    page = (results_dir / "report" / "report.md").read_text()
    assert "phone: unreachable (phone: nothing answers at 127.0.0.1:" in page and "bench2: busy (device bench2 is busy: held by pid" in page
    # the locks were released: the next night gets every device at once
    for device in suite.devices:
        with device_lock(device, 0, "test", suite.lock_dir):
            pass


def test_an_oracle_failure_exits_1_with_the_failures_listed(tmp_path, results_dir):
    # a threshold below float32's reach: every NMSE verdict must fail, the bit-exact ones still pass
    suites = write_suite(tmp_path / "suite", "strict", f"""
        devices: [host]
        runs:
          gdn:
            experiment: gdn
            overrides: [mode=oracle, matrix=awkward, threshold=1e-30]
        lock_dir: {tmp_path / 'locks'}
        lock_wait_s: 1
        report_out: {tmp_path / 'report'}
    """)
    status, summary = nightly.run_night(nightly.load_suite(["suite=strict"], suite_dir=suites),
                                        ResultsStore(results_dir), log=Lines())
    print(summary)
    failing = [r for r in ResultsStore(results_dir).records() if r["verdict"] == "fail"]
    assert status == 1 and failing and all(r["oracle"] == "nmse" for r in failing)
    assert summary.count("\nFAIL ") == nightly.SCREEN and f"and {len(failing) - nightly.SCREEN} more" in summary
    assert summary.splitlines()[-1] == f"exit 1: {len(failing)} failures, 0 regressions"
    assert (tmp_path / "report" / "report.html").exists()


@pytest.mark.parametrize("args, says", [
    (["suite=nope"], "unknown suite 'nope'; accepted: default, engines, smoke"),
    (["suite=smoke", "nokey=1"], "nokey"),
    (["suite=smoke", 'runs.gdn.overrides=["chunk=0"]'], "chunk=0 is out of range"),
    (["suite=smoke", "devices=[nowhere]"], "unknown device 'nowhere'"),
    (["suite=smoke", "lock_wait_s=soon"], "lock_wait_s='soon' is not accepted"),
    (["suite=smoke", "runs.gdn.experiment=null"], "run 'gdn' names no experiment"),
])
def test_usage_errors_exit_2_and_write_nothing(args, says, results_dir, capsys):
    assert main(["nightly", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not results_dir.exists()


# --- the night log: every flag with its quantity, levels, commit range and evidence -------------------------


def planted_nights(store: ResultsStore, plan: list[dict]):
    """A `drive` for run_night that stores, each night, one planted run per entry of `plan` (night i uses
    plan[i]: its commit, instruction counts, kernel time and A/B ratio) instead of running a suite."""
    import numpy as np

    from testbed.results import Figure, Record, RunInfo

    nights = iter(enumerate(plan))
    rng = np.random.default_rng(77)

    def drive(suite, store_, night, log):
        i, p = next(nights)
        info = RunInfo("native_bench", "host", "native", {"threads": 1}, {}, git_commit=p["commit"],
                       started=f"2026-09-{i + 1:02d}T02:00:00+00:00")
        ms = p["ms"] * rng.lognormal(0.0, 0.01, 9)  # a quiet kernel
        records = [info.stamp(Record("native_bench", "attention/keys=512", "measure", figures={
                       "time": Figure.of(ms, "ms"),
                       "instructions": Figure(p["count"], p["count"], p["count"], 1, "instructions")})),
                   info.stamp(Record("native_bench", "cache/append", "measure", figures={
                       "instructions": Figure(p["small"], p["small"], p["small"], 1, "instructions")}))]
        if "ab" in p:
            ratio, pvalue = p["ab"]
            records.append(info.stamp(Record("native_bench", "ab/attention keys=512", "measure", figures={
                "ab_ratio_cpu": Figure(ratio, ratio * 0.98, ratio * 1.03, 16, "ratio",
                                       ab={"a_commit": plan[i - 1]["commit"], "b_commit": p["commit"], "p": pvalue,
                                           "pairs": 16, "test": "wilcoxon", "verdict": "slower"})})))
        store_.append([info.mark("started"), *records, info.mark("ended", "complete")])
        return [nightly.DeviceNight("host", run_ids=[info.run_id], measurements=len(records))]

    return drive


def test_the_night_log_names_every_flag_on_its_night_and_clears_after_a_revert(tmp_path, results_dir):
    commits = [f"{i:02d}" * 20 for i in range(12)]
    plan = [{"commit": commits[i], "ms": 10.0, "count": 1_000_000, "small": 50_000} for i in range(12)]
    for i in (6, 7, 8):
        plan[i]["count"] = 1_015_000  # +1.5% instructions on night 6, reverted on night 9
    for i in (8, 9):
        plan[i]["ms"] = 13.0  # a 30% slower kernel on nights 8 and 9 (flagged on 9), reverted on night 10
    for i in range(7, 12):
        plan[i]["small"] = 50_250  # +0.5% on night 7: reported, never flagged
    plan[11]["ab"] = (1.12, 0.001)  # the A/B job of night 11: B 12% slower, p 0.001
    suite = nightly.Suite("planted", ["host"], {"host": []}, tmp_path / "locks", 0, tmp_path / "report")
    store = ResultsStore(results_dir)
    drive = planted_nights(store, plan)
    statuses = [nightly.run_night(suite, store, log=Lines(), drive=drive)[0] for _ in plan]
    nights = report_module.night_log(results_dir)
    flags = [[(f["kind"], f["what"]) for f in n["flags"]] for n in nights]
    assert flags == [[]] * 6 + [[("instructions", "instructions")], [], [], [("figure", "time")], [],
                                [("ab", "ab_ratio_cpu")]]
    assert statuses == [0] * 6 + [1, 0, 0, 1, 0, 1]
    (count_flag,) = nights[6]["flags"]
    assert (count_flag["before_level"], count_flag["after_level"]) == (1_000_000, 1_015_000)
    assert count_flag["commit_range"] == f"{commits[5][:8]}..{commits[6][:8]}"
    assert count_flag["case"] == "attention/keys=512" and count_flag["change"] == "+1.50%"
    (time_flag,) = nights[9]["flags"]  # "since" is the first commit at the new level, never a clean one
    assert (time_flag["last_clean_commit"], time_flag["since_commit"]) == (commits[7], commits[8])
    assert time_flag["before_level"] == pytest.approx(10.0, rel=0.02) and time_flag["after_level"] == pytest.approx(
        13.0, rel=0.02)
    (ab_flag,) = nights[11]["flags"]
    assert ab_flag["ab"]["p"] == 0.001 and ab_flag["ab"]["pairs"] == 16 and ab_flag["ab"]["b_commit"] == commits[11]
    assert ab_flag["commit_range"] == f"{commits[10][:8]}..{commits[11][:8]}"
    # counts: every change logged on its night, the +0.5% and the revert too, as what they are
    changes = {i: [(c["case"], c["verdict"]) for c in n["count_changes"]] for i, n in enumerate(nights)
               if n["count_changes"]}
    assert changes == {6: [("attention/keys=512", "regression")],
                       7: [("cache/append", "changed (within the rise that counts)")],
                       9: [("attention/keys=512", "improvement")]}
    # the report's banner names every flag of the last night
    page = (tmp_path / "report" / "report.md").read_text()
    assert "1 regression flag: (1) native_bench on host ab/attention keys=512 ab_ratio_cpu +12.0%" in page
