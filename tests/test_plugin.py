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
    `import torch`); modules that need the hf extra skip instead."""
    import os
    import subprocess
    import sys

    from testbed import PROJECT_ROOT

    for name in ("torch", "transformers"):  # stand-ins that cannot be imported, first on the path
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('no {name} here (a test of its absence)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "device",
                        "tests"], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "error" not in p.stdout.lower().split("\n")[-2], p.stdout[-500:]
