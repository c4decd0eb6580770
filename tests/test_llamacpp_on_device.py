"""`pytest --device=hexagon`: llama.cpp's own GATED_DELTA_NET oracle on the phone's backend (seed 002's
gate: every case OK, the tool's tally agreeing, the run finished). Skipped on devices without
llama.cpp's tools (capability `llamacpp`)."""

import pytest

from testbed.backends.llamacpp import runner as llamacpp


@pytest.mark.requires("llamacpp")
def test_gated_delta_net_passes_test_backend_ops_on_the_device(device):
    backend = device.profile.accelerators.get("backend", "CPU")
    report, problems = llamacpp.test_backend_ops(device, "GATED_DELTA_NET", backend)
    assert problems == [], f"{report.tally()} on {device.name} -b {backend}: " + "; ".join(problems)
