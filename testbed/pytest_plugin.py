"""pytest plugin: `pytest --device=NAME` selects the device profile the equivalence suites run on.

  device fixture                 the connected device (session-scoped; closed, and its loopback peer
                                 stopped, at the end). A device other than the host is connected when
                                 the session starts, so an unreachable one stops pytest at once,
                                 saying why, before any test runs.
                                 A session on a device other than the host holds the device's lock
                                 (testbed.devices.private, the one testbed nightly takes) from start
                                 to end; if another session or a night holds it, pytest stops at once,
                                 naming the holder.
  @pytest.mark.requires("cap")   skip unless the device's profile lists that capability
  a missing tool                 on a device other than the host, a test stopped by a tool this host lacks
                                 (testbed.errors.ToolMissing: zig without the cross extra, a cross gcc)
                                 is a skip naming the tool and how to get it, not an error
  results_dir fixture            a per-session results store, so tests never write into results/
  judge(outcome)                 a run's verdicts as a device test reads them (testbed.verdicts): a fail or an
                                 error fails the test, naming the first records; a run whose every verdict
                                 is not supported or not judged is a skip saying why, never a pass
  network guard                  (ini `network_guard`, or --network-guard=loopback|off; the project's
                                 pytest config turns it on) no test may send a packet outside loopback:
                                 a connect, sendto or name lookup off this machine, in the test's
                                 process or any Python process it starts, is refused and fails the test
                                 (testbed/netguard); outside scripts/test.sh's network namespace, the
                                 session ends naming the programs that are not Python it could not see
"""

from __future__ import annotations

import pytest

import os
import sys
from contextlib import ExitStack

from testbed.config import choices
from testbed.devices import connect, load_profile
from testbed.devices.private import DeviceBusy, device_lock
from testbed.errors import DeviceUnreachable, ToolMissing, UsageError, did_you_mean
from testbed.report.tables import printable
from testbed.verdicts import FAILING, LABEL, UNJUDGED, Tally

# The real peers the device tests talk to (loopback adbd, sshd) and their fixtures.
pytest_plugins = ["testbed.peers.fixtures"]


def pytest_addoption(parser):
    parser.addoption("--device", default="host",
                     help=f"device profile to run on (devices/*.yaml): one of {', '.join(choices('device'))}")
    parser.addoption("--network-guard", choices=("loopback", "off"), default=None,
                     help="loopback: fail a test that sends anything outside loopback (default: ini network_guard)")
    parser.addini("network_guard", "loopback: fail a test that sends anything outside loopback; off: no guard",
                  default="off")


def _network_guard_on(config) -> bool:
    return (config.getoption("--network-guard") or config.getini("network_guard")) == "loopback"


def _start_network_guard(config) -> None:
    """The guard in this process, and (through PYTHONPATH's sitecustomize) in every Python process the
    tests start, reporting to a log file this session reads after each test."""
    import tempfile

    from testbed import netguard

    netguard.install()
    log = os.environ.get(netguard.ENV_LOG)
    if not (log and os.path.isfile(log)):  # else a session that started this one reads the same log
        fd, log = tempfile.mkstemp(prefix="testbed-netguard-", suffix=".log")
        os.close(fd)
        os.environ[netguard.ENV_LOG] = log
        config._testbed_netguard_made = log
    config._testbed_netguard = (log, os.path.getsize(log))
    if os.environ.get("TESTBED_NETWORK") != "namespace":  # what the guard cannot see, named at the end
        unpoliced = os.environ.get(netguard.ENV_UNPOLICED)
        if not (unpoliced and os.path.isfile(unpoliced)):
            fd, unpoliced = tempfile.mkstemp(prefix="testbed-netguard-unpoliced-", suffix=".log")
            os.close(fd)
            os.environ[netguard.ENV_UNPOLICED] = unpoliced
            config._testbed_unpoliced_made = unpoliced
        config._testbed_unpoliced = (unpoliced, os.path.getsize(unpoliced))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(netguard.SITE_DIR) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(netguard.SITE_DIR), *paths) if p)


def pytest_unconfigure(config):
    from testbed import netguard

    for attribute, variable in (("_testbed_netguard_made", netguard.ENV_LOG),
                                ("_testbed_unpoliced_made", netguard.ENV_UNPOLICED)):
        made = getattr(config, attribute, None)
        if made:
            os.environ.pop(variable, None)
            os.unlink(made)


def pytest_terminal_summary(terminalreporter, config):
    """Outside scripts/test.sh's network namespace, the guard saw only Python: say which other programs
    the tests started through testbed (testbed.children), beyond its sight."""
    unpoliced = getattr(config, "_testbed_unpoliced", None)
    if unpoliced is None:
        return
    path, offset = unpoliced
    try:
        with open(path) as f:
            f.seek(offset)
            names = f.read().splitlines()
    except OSError:
        return
    if names:
        counts = {name: names.count(name) for name in sorted(set(names))}
        terminalreporter.write_line(printable(
            f"network guard: in-process only (this session is not in scripts/test.sh's network namespace): it sees "
            f"what Python sends, not what these {len(counts)} programs the tests started did: "
            + ", ".join(f"{name} ({n})" for name, n in counts.items())
            + "; scripts/test.sh runs the suite where no program can reach past loopback"), yellow=True)


def network_guard_findings(config) -> list[str]:
    """What was refused since the last call: in this process, and in the processes the tests started."""
    from testbed import netguard

    log, offset = config._testbed_netguard
    netguard.take()  # this process logs its own refusals too
    with open(log) as f:
        f.seek(offset)
        logged = f.read()
        config._testbed_netguard = (log, f.tell())
    return logged.splitlines()


@pytest.fixture(autouse=True)
def _network_guard(request):
    """Fails the test during which anything was sent, or tried to be sent, outside loopback."""
    config = request.config
    if getattr(config, "_testbed_netguard", None) is None:
        yield
        return
    network_guard_findings(config)  # what earlier tests' processes did after they ended is not this test's
    yield
    found = network_guard_findings(config)
    if found:
        pytest.fail(f"the test tried to reach outside loopback ({len(found)} times; first: {found[0]}); the "
                    f"suite talks to loopback only (network_guard)", pytrace=False)


def pytest_configure(config):
    name = config.getoption("--device")
    if name not in choices("device"):
        raise pytest.UsageError(f"--device={name!r} is not a device profile{did_you_mean(name, choices('device'))}; "
                                f"accepted: {', '.join(choices('device'))}")
    try:
        config._testbed_profile = load_profile(name)
    except UsageError as e:
        raise pytest.UsageError(str(e)) from None
    if _network_guard_on(config):
        _start_network_guard(config)


def pytest_report_header(config):
    p = config._testbed_profile
    return f"testbed device: {p.name} ({p.transport}, {p.abi}; capabilities: {', '.join(p.capabilities)})"


def pytest_collection_modifyitems(config, items):
    profile = config._testbed_profile
    for item in items:
        for mark in item.iter_markers("requires"):
            missing = [c for c in mark.args if not profile.has(c)]
            if missing:
                item.add_marker(pytest.mark.skip(
                    reason=f"device {profile.name!r} lacks capability {', '.join(missing)}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A device session on a host without an optional tool (the plain bootstrap has no cross extra):
    the tests that need it are skipped, saying which tool and how to get it. On the host they fail:
    the host's tools are the project's own requirements."""
    outcome = yield
    report = outcome.get_result()
    profile = item.config._testbed_profile
    if call.excinfo is not None and call.excinfo.errisinstance(ToolMissing) and profile.transport != "local":
        report.outcome = "skipped"
        report.longrepr = (str(item.path), (item.location[1] or 0) + 1,
                           f"Skipped: this host lacks a tool for device {profile.name!r}: {call.excinfo.value}")


@pytest.fixture(scope="session")
def device_profile(pytestconfig):
    return pytestconfig._testbed_profile


def _connect(config):
    if getattr(config, "_testbed_device", None) is None:
        profile = config._testbed_profile
        try:
            config._testbed_device = connect(profile)
        except DeviceUnreachable as e:
            pytest.exit(f"device {profile.name!r} is unreachable: {e}", returncode=3)
    return config._testbed_device


def pytest_sessionstart(session):
    profile = session.config._testbed_profile
    if profile.transport == "local":
        return
    held = ExitStack()
    try:
        held.enter_context(device_lock(profile.name, 0, f"pytest session ({' '.join(sys.argv)}) in {os.getcwd()}"))
    except (DeviceBusy, UsageError) as e:
        pytest.exit(f"cannot take device {profile.name!r}: {e}", returncode=3)
    session.config._testbed_lock = held
    _connect(session.config)


def pytest_sessionfinish(session):
    device = getattr(session.config, "_testbed_device", None)
    if device is not None:
        device.close()
        session.config._testbed_device = None
    lock = getattr(session.config, "_testbed_lock", None)
    if lock is not None:
        lock.close()
        session.config._testbed_lock = None


@pytest.fixture(scope="session")
def device(pytestconfig):
    return _connect(pytestconfig)


@pytest.fixture(scope="session")
def seed_fixtures():
    """The measured figures and real tool outputs of the seeds (config key fixtures_dir). Missing
    fixtures fail the tests that need them: they are inputs, not optional extras."""
    from testbed.config import load, project_path

    path = project_path(load([]).cfg.fixtures_dir).resolve()
    if not path.is_dir():
        pytest.fail(f"seed fixtures not found at {path} (config key fixtures_dir)")
    return path


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    path = tmp_path / "results"
    monkeypatch.setenv("TESTBED_RESULTS", str(path))
    return path


def judge(outcome, named: int = 3) -> Tally:
    """A run's verdicts as a device test reads them: fail the test when any verdict fails or errs (naming the
    first `named` records), skip it when nothing was judged (every verdict not supported or not judged: a
    refusal is never a pass); the tally otherwise."""
    rows = [r for r in outcome.rows if r["kind"] == "oracle"]
    tally = Tally.of_records(rows)
    if tally.failed:
        first = [f"{r['case']}: {r['verdict']}: {r['detail']}" for r in rows if r["verdict"] in FAILING][:named]
        pytest.fail(f"{outcome.info.experiment} on {outcome.info.device} ({outcome.info.backend}): "
                    f"{tally.phrase()}; " + "; ".join(first), pytrace=False)
    if not tally.judged and tally.total:
        first = next(r for r in rows if r["verdict"] in UNJUDGED)
        pytest.skip(f"{outcome.info.experiment} on {outcome.info.device}: nothing judged ({tally.phrase()}); "
                    f"{LABEL[first['verdict']]} {first['case']}: {first['detail']}")
    return tally
