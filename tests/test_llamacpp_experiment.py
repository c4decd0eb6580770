"""`testbed run llamacpp` end to end on a phone over ADB (the loopback adbd): the tool paths come from
the profile, the outputs travel back over ADB, become records, and the run reports "36/36 OK" and
pp512 tokens/s. The phone here has no Hexagon NPU, so its llama.cpp tools are stand-ins: a real program for its
ABI (tests/data/replay_tool.c) that replays real test-backend-ops output (fixtures/) and a llama-bench
JSON output."""

import dataclasses
from pathlib import Path

import pytest

from testbed import config, runner
from testbed.devices import Device
from testbed.peers.fixtures import adb_connect, compile_static
from testbed.results import ResultsStore

from tests.test_llamacpp_output import fixtures

DATA = Path(__file__).parent / "data"
TOOLS = "/data/local/tmp/testbed/tools"

REPLAY = Path(__file__).parent / "data" / "replay_tool.c"  # a real program for the phone that replays


def with_tools(device: Device, tmp_path: Path, test_output: str, code: int = 0) -> Device:
    files = {"test.out": test_output, "perf.out": (fixtures() / "perf_b_CPU.stdout").read_text(),
             "bench.json": (DATA / "llama-bench" / "pp512.json").read_text()}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        device.push(tmp_path / name, f"tools/{name}")
    abi = device.profile.abi
    device.push(compile_static(REPLAY, abi, (f"EXIT_CODE={code}",)), "tools/test-backend-ops", mode=0o755)
    device.push(compile_static(REPLAY, abi), "tools/llama-bench", mode=0o755)
    profile = dataclasses.replace(device.profile, tools={"test-backend-ops": f"{TOOLS}/test-backend-ops",
                                                         "llama-bench": f"{TOOLS}/llama-bench"},
                                  accelerators={"backend": "CPU"}, threads=[1, 8])
    return Device(profile, device.transport)


def run_config(*overrides):
    """The loopback profile's config, told (as a user's profile would say) where the tools are."""
    return config.load(["experiment=llamacpp", "device=adb-loopback", f"+device.tools.test-backend-ops={TOOLS}/t",
                        f"+device.tools.llama-bench={TOOLS}/b", *overrides])


def test_a_run_reports_36_of_36_ok_and_pp512(adb_device, tmp_path, results_dir):
    device = with_tools(adb_device, tmp_path, (fixtures() / "test_mode_b_CPU.stdout").read_text())
    outcome = runner.execute(run_config("gguf=/data/local/tmp/m.gguf"), device=device)
    df = outcome.frame()
    tally = df[df["case"].str.endswith("/tally")].iloc[0]
    assert (tally["verdict"], tally["metrics.tally"]) == ("pass", "36/36 OK")
    assert outcome.failed == 0 and (df["oracle"] == "test-backend-ops").sum() == 37
    pp = df[df["case"] == "pp512/t8"].iloc[0]
    assert pp["figures.tokens_per_s.median"] == pytest.approx(93.34) and pp["figures.tokens_per_s.reps"] == 5
    perf = df[df["case"].str.contains("head_count=32,head_size=128,n_seq_tokens=512,") & df["case"].str.endswith("/perf")]
    assert perf["figures.time.median"].tolist() == [69787.23]
    assert tally["fingerprint.model"] == "Loopback"  # the record says which device measured it
    assert len(ResultsStore(results_dir).records("llamacpp")) == len(df)
    from testbed.cli import _summary
    from testbed.experiments import llamacpp as module

    shown = _summary(outcome, module)  # what `testbed run llamacpp device=hexagon` prints
    assert "36/36 OK" in shown and "pp512/t8" in shown and "| tokens/s" in shown and "93.34" in shown


def test_a_crashed_tool_leaves_no_passing_tally(adb_device, tmp_path, results_dir):
    text = (fixtures() / "test_mode_b_CPU.stdout").read_text()
    crashed = text[: text.index("n_seq_tokens=100,n_seqs=1")]  # aborted mid-way (exit 134)
    device = with_tools(adb_device, tmp_path, crashed, code=134)
    outcome = runner.execute(run_config("mode=test"), device=device)
    tally = [r for r in outcome.rows if r["case"].endswith("/tally")][0]
    assert tally["verdict"] == "error" and "exited 134" in tally["detail"] and "did not finish" in tally["detail"]
    assert outcome.failed == 1


def test_a_device_lost_mid_run_stores_one_error_record(adbd_factory, adb_key, tmp_path, results_dir):
    import threading
    import time

    from testbed.errors import DeviceUnreachable

    adbd = adbd_factory()
    device = with_tools(adb_connect(adbd, adb_key), tmp_path, (fixtures() / "test_mode_b_CPU.stdout").read_text())
    (tmp_path / "hang").write_text('#!/bin/sh\ntouch "$0.started"\nsleep 30\n')
    device.push(tmp_path / "hang", "tools/test-backend-ops", mode=0o755)
    started = adbd.sandbox / "testbed" / "tools" / "test-backend-ops.started"

    def kill_once_the_tool_runs():  # not on a timer: under load a timer can fire before the run starts
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        adbd.kill()

    threading.Thread(target=kill_once_the_tool_runs, daemon=True).start()
    with pytest.raises(DeviceUnreachable, match="connection lost"):
        runner.execute(run_config("mode=test"), device=device)
    rows = ResultsStore(results_dir).records()
    assert [(r["case"], r["verdict"]) for r in rows] == [("run", "error")]


def test_a_device_without_the_tools_is_refused_before_connecting():
    from testbed.errors import UsageError

    with pytest.raises(UsageError, match="device=adb-loopback has no tools.test-backend-ops"):
        runner.check(config.load(["experiment=llamacpp", "device=adb-loopback"]))


def test_gdn_on_a_phone_with_llama_cpp_tools_runs_ggmls_op(adb_device, tmp_path, results_dir):
    """`testbed run gdn device=hexagon`: on a device whose profile has llama.cpp's tools the gdn
    experiment defaults to backend=llamacpp and reports the harness' tally, like seed 002's "28/28 OK"."""
    device = with_tools(adb_device, tmp_path, (fixtures() / "test_mode_b_CPU.stdout").read_text())
    device = Device(dataclasses.replace(device.profile, capabilities=[*device.profile.capabilities, "llamacpp"]),
                    device.transport)
    rc = config.load(["experiment=gdn", "device=adb-loopback", "+device.capabilities=[cpu,llamacpp]",
                      f"+device.tools.test-backend-ops={TOOLS}/test-backend-ops"])
    assert rc.cfg.backend == "llamacpp"
    outcome = runner.execute(rc, device=device)
    df = outcome.frame()
    tally = df[df["case"].str.endswith("/tally")].iloc[0]
    assert (tally["verdict"], tally["metrics.tally"], tally["backend"]) == ("pass", "36/36 OK", "llamacpp")
    assert (df["kind"] == "measure").sum() == 12  # perf mode: us/run and GB/s per case

    from testbed.cli import _summary
    from testbed.experiments import gdn

    assert "test-backend-ops tally" in _summary(outcome, gdn)


def test_a_tool_that_is_not_an_elf_for_the_phone_is_refused(adb_device, tmp_path, results_dir):
    """A shell script in the tool's place runs on any machine, so it proves nothing about the phone: its
    evidence has no ELF machine and the run is refused (a script's bytes 18-19 once read as machine 26912)."""
    from testbed.runner import ComputedElsewhere

    device = with_tools(adb_device, tmp_path, (fixtures() / "test_mode_b_CPU.stdout").read_text())
    (tmp_path / "script").write_text('#!/bin/sh\ncat "$(dirname "$0")/test.out"\n')
    device.push(tmp_path / "script", "tools/test-backend-ops", mode=0o755)
    with pytest.raises(ComputedElsewhere, match="does not say what kind of program ran"):
        runner.execute(run_config("mode=test"), device=device)
