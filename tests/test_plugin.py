"""pytest --device: the device fixture and capability skips."""


def test_device_fixture_and_capability_skips(pytester):
    pytester.makepyfile(
        """
        import pytest

        def test_host(device):
            assert device.name == "host" and device.fingerprint()["cores"] >= 1

        @pytest.mark.requires("vulkan")
        def test_needs_a_gpu(device):
            raise AssertionError("must not run on a device without vulkan")
        """
    )
    result = pytester.runpytest("-p", "testbed.pytest_plugin", "--device=host", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*device 'host' lacks capability vulkan*"])


def test_the_suite_collects_without_the_hf_extra(tmp_path):
    """Issue 24, item 16: `pytest --device=X -m device` failed at collection without torch (a bare
    `import torch`); modules that need the hf extra skip instead. Issue 34: with pytest 9.2 four
    modules still failed (an importorskip without exc_type=ImportError)."""
    import os
    import subprocess
    import sys

    from testbed import PROJECT_ROOT

    for name in ("torch", "transformers"):  # stand-ins that cannot be imported, first on the path
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('no {name} here (a test of its absence)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}
    # pytest >= 9.1 no longer skips on an ImportError that is not ModuleNotFoundError unless told to
    # (importorskip's exc_type); older ones only warn: as an error here, so every pytest shows it. anyio's
    # plugin (a dependency's, not the suite's) imports a name pytest 9.3 deprecates: left out
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "device",
                        "-W", "error::pytest.PytestDeprecationWarning", "-p", "no:anyio", "tests"],
                       cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "error" not in p.stdout.lower().split("\n")[-2], p.stdout[-500:]


def test_the_network_guard_fails_a_test_that_dials_outside_loopback(pytester, request, monkeypatch):
    """Issue 24, item 19: with the project's pytest config the guard is on: a connect to 192.0.2.1 (in
    the test's process or in a Python process it starts) is refused before anything is sent, and the
    test fails even where the code under test swallows the error. Loopback stays open."""
    import socket
    import subprocess
    import sys

    import pytest

    from testbed import netguard
    from testbed.pytest_plugin import network_guard_findings

    assert request.config.getini("network_guard") == "loopback"  # pyproject.toml: on in every run, CI's too
    with pytest.raises(PermissionError, match="connect to 192.0.2.1:9"):
        socket.create_connection(("192.0.2.1", 9), timeout=1)
    child = subprocess.run([sys.executable, "-c", "import socket; socket.create_connection(('192.0.2.1', 9), 1)"],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode != 0 and "testbed network guard: connect to 192.0.2.1:9" in child.stderr
    with pytest.raises(PermissionError, match="name lookup of 'board.example'"):
        socket.getaddrinfo("board.example", 22)
    found = network_guard_findings(request.config)  # taken here, so this test itself does not fail
    assert len(found) == 3 and all("192.0.2.1:9" in f or "board.example" in f for f in found), found
    with socket.socket() as server:  # loopback is untouched
        server.bind(("127.0.0.1", 0))
        server.listen()
        socket.create_connection(server.getsockname(), timeout=5).close()
    assert not netguard.outside("127.0.0.1") and netguard.outside("192.0.2.1")

    import os

    from testbed import PROJECT_ROOT

    # the inner session imports this checkout's testbed (whatever else is installed)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")]))
    pytester.makeconftest("pytest_plugins = ['testbed.pytest_plugin']")
    pytester.makeini("[pytest]\nnetwork_guard = loopback\n")
    pytester.makepyfile(test_dials="""
        import socket

        def test_swallows_the_error():
            try:
                socket.create_connection(("192.0.2.1", 9), timeout=1)
            except OSError:
                pass
        """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*tried to reach outside loopback*connect to 192.0.2.1:9*"])
    network_guard_findings(request.config)  # the inner session's process reported to this session's log too
