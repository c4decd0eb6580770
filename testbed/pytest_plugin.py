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
  results_dir fixture            a per-session results store, so tests never write into results/
"""

from __future__ import annotations

import pytest

import os
import sys
from contextlib import ExitStack

from testbed.config import choices
from testbed.devices import connect, load_profile
from testbed.devices.private import DeviceBusy, device_lock
from testbed.errors import DeviceUnreachable, UsageError

# The real peers the device tests talk to (loopback adbd, sshd) and their fixtures.
pytest_plugins = ["testbed.peers.fixtures"]


def pytest_addoption(parser):
    parser.addoption("--device", default="host", help="device profile to run on (devices/*.yaml)")


def pytest_configure(config):
    name = config.getoption("--device")
    if name not in choices("device"):
        raise pytest.UsageError(f"--device={name!r} is not a device profile; accepted: {', '.join(choices('device'))}")
    try:
        config._testbed_profile = load_profile(name)
    except UsageError as e:
        raise pytest.UsageError(str(e)) from None


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
