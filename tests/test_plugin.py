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
