"""Nothing outlives testbed (issue 44, item 2): every program it starts (testbed.children) leads a
session of its own that testbed ends on every way out. Each test kills testbed the way the world does
(SIGKILL of its process group, as a CI timeout; SIGTERM of a nightly) while a program of its hangs, then
waits, bounded but never on a short timer, until no process of that program is left: its own, and what
it started, found by process id and by session.

The hanging program is a shell script (not Python: nothing of testbed's runs inside it) that starts a
`sleep` in the background, writes both process ids where the test reads them, and waits."""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from testbed import PROJECT_ROOT, children
from testbed.peers.fixtures import ssh_profile

GONE_WITHIN_S = 120  # a bound for what happens within a second or two; a loaded machine must not fail it
STARTED_WITHIN_S = 600  # the testbed command up to its program's start (imports, reference computations)


def hang_script(pids: Path) -> str:
    """A shell command that hangs: a background sleep, both ids written to `pids` (whole: renamed), a wait."""
    return f'sleep 100000 & echo "$$ $!" > "{pids}.tmp" && mv "{pids}.tmp" "{pids}"; wait'


def state(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, session) of a live process; None once it is gone or a zombie (dead, not yet
    reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in ("Z", "X") else (fields[0], int(fields[2]), int(fields[3]))


def in_sessions(sessions: set[int]) -> list[int]:
    """The live processes of these sessions."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        now = state(int(entry.name))
        if now is not None and now[2] in sessions:
            found.append(int(entry.name))
    return found


def below(pid: int) -> list[int]:
    """`pid`'s live descendants now."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError):
            continue
    out, todo = [], list(parents.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return [p for p in out if state(p) is not None]


def wait_for(what: str, done, limit_s: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + limit_s
    while not (found := done()):
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: the command ended first (exit {proc.returncode}): {proc.communicate()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {limit_s} s")
        time.sleep(0.1)
    return found


def read_pids(path: Path) -> list[int] | None:
    return [int(p) for p in path.read_text().split()] if path.is_file() else None


def assert_all_gone(pids: list[int], sessions: set[int]) -> None:
    """Every process of `pids` and of `sessions` ends, within GONE_WITHIN_S."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while True:
        left = sorted({p for p in pids if state(p) is not None} | set(in_sessions(sessions)))
        if not left:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"still running {GONE_WITHIN_S} s after testbed ended: "
                        + "; ".join(f"{p} {Path(f'/proc/{p}/cmdline').read_bytes()[:80]!r}" for p in left
                                    if Path(f"/proc/{p}").exists()))
        time.sleep(0.1)


def env_with_testbed(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])),
            **extra}


@pytest.fixture
def drop_box():
    """A folder any user may write in (the SSH login user's program writes its ids there)."""
    folder = Path(tempfile.mkdtemp(prefix="tb-children-", dir="/tmp"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


# --- one way to start a program ------------------------------------------------------------------------


STARTING = {("subprocess", name) for name in ("run", "Popen", "call", "check_call", "check_output", "getoutput",
                                              "getstatusoutput")} | \
           {("os", name) for name in ("system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp",
                                      "spawnl", "spawnlp", "spawnv", "spawnvp", "execv", "execvp", "execve")}


def test_every_program_testbed_starts_goes_through_children():
    """The mechanism lives in one place: no module of the package but testbed/children.py calls
    subprocess or os to start a program."""
    found = []
    for path in sorted((PROJECT_ROOT / "testbed").rglob("*.py")):
        if path == PROJECT_ROOT / "testbed" / "children.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in STARTING:
                found.append(f"{path.relative_to(PROJECT_ROOT)}:{node.lineno} {node.func.value.id}.{node.func.attr}")
    assert not found, found


# --- in this process -------------------------------------------------------------------------------------


def test_what_a_program_leaves_running_in_its_group_is_killed_when_it_returns(tmp_path):
    """The background sleep holds the program's output open: without the kill, run would wait for it."""
    pids = tmp_path / "pids"
    done = children.run(["sh", "-c", f"{hang_script(pids).removesuffix('; wait')}; echo said"], capture_output=True,
                        text=True, timeout=600)
    assert (done.returncode, done.stdout) == (0, "said\n")
    shell, sleep = read_pids(pids)
    assert_all_gone([shell, sleep], {shell})
    assert shell not in children.running()


def test_a_timeout_kills_the_whole_group(tmp_path):
    pids = tmp_path / "pids"
    proc = children.start(["sh", "-c", hang_script(pids)])
    shell, sleep = wait_for("the program's ids", lambda: read_pids(pids), STARTED_WITHIN_S)
    assert proc.pid == shell and state(sleep)[2] == shell  # the program leads a session of its own
    children.end(proc)
    assert_all_gone([shell, sleep], {shell})
    with pytest.raises(subprocess.TimeoutExpired):
        children.run(["sh", "-c", hang_script(tmp_path / "again")], timeout=1)
    assert_all_gone(read_pids(tmp_path / "again"), {read_pids(tmp_path / "again")[0]})


# --- testbed killed: SIGKILL of its process group, while its program hangs ------------------------------------


HANG_ENGINE = """\
name: hang
contract: 1
build: {prebuilt: {host: ../hang.sh}}
program: hang.sh
abis: [host]
supports: {techniques: [chunk_prefill]}
invoke: ["{program}", "{request}", "{response}"]
timeout_s: 86400
counts: process
"""


def test_sigkill_of_a_testbed_run_leaves_nothing_of_its_hung_engine(tmp_path):
    """`testbed run` of a lab's engine that hangs (timeout_s a day: nobody but testbed's own end stops
    it), killed as a CI timeout kills a job: SIGKILL to its process group. The engine was in a group
    of its own, which that signal never reaches: testbed's warden ends it."""
    lab, pids = tmp_path / "lab", tmp_path / "pids"
    (lab / "engines").mkdir(parents=True)
    (lab / "engines" / "hang.yaml").write_text(HANG_ENGINE)
    (lab / "hang.sh").write_text(f"#!/bin/sh\n{hang_script(pids)}\n")
    (lab / "hang.sh").chmod(0o755)
    run = subprocess.Popen([sys.executable, "-m", "testbed", "run", "chunk_prefill", "backend=engine", "engine=hang",
                            "mode=oracle", "cases=[{past: 5, tokens: 7}]", "chunk=4"], cwd=PROJECT_ROOT,
                           env=env_with_testbed(TESTBED_LAB=str(lab), TESTBED_RESULTS=str(tmp_path / "results")),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    shell, sleep = wait_for("the engine's start", lambda: read_pids(pids), STARTED_WITHIN_S, run)
    started = below(run.pid)  # the warden, the engine and what it started
    # the engine runs in a session of its own (led by tb_peak_rss, which every engine request runs through),
    # apart from testbed's
    engine_session = state(shell)[2]
    assert engine_session != run.pid and engine_session in started
    os.killpg(run.pid, signal.SIGKILL)
    run.communicate()
    assert_all_gone([shell, sleep, *started], {engine_session})


# A daemon: a process that leaves the program's session (setsid: a session of its own), its id written once
# it has; then the program's ids and the daemon's, as hang_script writes them.
LEAVES_ITS_SESSION = """setsid sh -c 'echo $$ > "{pids}.daemon"; exec sleep 100000' &
while [ ! -s "{pids}.daemon" ]; do sleep 0.1; done
echo "$$ $(cat "{pids}.daemon")" > "{pids}.tmp" && mv "{pids}.tmp" "{pids}"; wait"""


@pytest.mark.parametrize("program", ["hangs", "starts a daemon"])
def test_a_program_started_by_a_process_that_dies_is_ended_by_its_warden(program, tmp_path):
    """The warden alone: a Python process starts the program through testbed.children, then kills
    itself (no atexit, no finally). A daemon (a process that left the program's session with setsid) is
    found by testbed's mark in its environment."""
    pids = tmp_path / "pids"
    script = hang_script(pids) if program == "hangs" else LEAVES_ITS_SESSION.format(pids=pids)
    dies = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""\
        import os, signal, time
        from testbed import children
        children.start(["sh", "-c", {script!r}])
        while not os.path.exists({str(pids)!r}):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
        """)], env=env_with_testbed())
    dies.wait(timeout=STARTED_WITHIN_S)
    assert dies.returncode == -signal.SIGKILL
    shell, other = read_pids(pids)  # the sleep in the program's session, or the daemon in its own
    assert_all_gone([shell, other], {shell})


# Run by a process that is "testbed" on a remote device: it connects, runs the hang there, waits.
DRIVER = """\
import json, sys
from testbed.devices import Profile, connect, load_profile
how = json.loads(sys.argv[1])
if how["profile"]:
    profile = load_profile(how["profile"])
    device = connect(profile, {**profile.connection, **how["connection"]})
else:
    device = connect(Profile(**how["fields"]), how["connection"])
device.transport.run(["sh", "-c", how["script"]], timeout=86400)
"""


@pytest.mark.parametrize("transport", ["adb", "ssh"])
def test_a_program_run_over_the_loopback_adb_or_ssh_dies_with_testbed(transport, drop_box, adb_key, sshd):
    """adb: the profile's own loopback adbd, a peer testbed starts (its warden ends the adbd, whose own
    warden ends the adbd's programs). ssh: the session's sshd, which is not testbed's: the program's
    SSH session ends it once the connection is gone (testbed.devices.ssh.WATCHED)."""
    pids = drop_box / "pids"
    if transport == "adb":
        how = {"profile": "adb-loopback", "connection": {"key": str(adb_key)}}
    else:
        profile = ssh_profile(sshd, "children")
        how = {"profile": "", "connection": sshd.connection(),
               "fields": {"name": profile.name, "transport": "ssh", "abi": "x86_64", "work_dir": profile.work_dir}}
    how["script"] = hang_script(pids)
    import json

    driver = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(how)], env=env_with_testbed(), cwd=PROJECT_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    shell, sleep = wait_for("the program's start", lambda: read_pids(pids), STARTED_WITHIN_S, driver)
    started = below(driver.pid)  # adb: the warden, the adbd peer, its warden and shell; ssh: the warden at most
    os.killpg(driver.pid, signal.SIGKILL)
    driver.communicate()
    assert_all_gone([shell, sleep, *started], set())


# --- a SIGTERM'd nightly stops its builds ---------------------------------------------------------------------


def test_sigterm_stops_a_nightly_and_the_build_it_was_running(tmp_path):
    """The nightly's worker thread is inside an engine's build (its command hangs) when SIGTERM
    arrives: the nightly exits 143 and the build's processes are gone, not running on to their end."""
    lab, pids = tmp_path / "lab", tmp_path / "pids"
    (lab / "engines").mkdir(parents=True)
    (lab / "src").mkdir()
    (lab / "src" / "engine.c").write_text("int main(void) { return 0; }\n")
    (lab / "engines" / "slow.yaml").write_text(HANG_ENGINE.replace("name: hang", "name: slow").replace(
        "build: {prebuilt: {host: ../hang.sh}}", "source: ../src\nbuild:\n  command: [sh, -c, " + repr(hang_script(pids))
        + "]").replace("program: hang.sh", "program: engine"))
    (lab / "suite").mkdir()
    (lab / "suite" / "build.yaml").write_text(textwrap.dedent(f"""\
        devices: [host]
        runs:
          slow:
            experiment: chunk_prefill
            overrides: [backend=engine, engine=slow, mode=oracle, "cases=[{{past: 5, tokens: 7}}]", chunk=4]
        lock_dir: {tmp_path / 'locks'}
        lock_wait_s: 0
        report_out: ''
        """))
    night = subprocess.Popen([sys.executable, "-m", "testbed", "nightly", "suite=build"], cwd=PROJECT_ROOT,
                             env=env_with_testbed(TESTBED_LAB=str(lab), TESTBED_RESULTS=str(tmp_path / "results")),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    shell, sleep = wait_for("the build's start", lambda: read_pids(pids), STARTED_WITHIN_S, night)
    started = below(night.pid)
    night.send_signal(signal.SIGTERM)
    out, err = night.communicate(timeout=GONE_WITHIN_S)
    assert night.returncode == 128 + signal.SIGTERM, err
    assert_all_gone([shell, sleep, *started], {shell})
