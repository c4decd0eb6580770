"""`pytest --device=hexagon`: llama.cpp's own GATED_DELTA_NET oracle on the phone's backend (seed 002's
gate: every case OK, the tool's tally agreeing, the run finished). Skipped on devices without
llama.cpp's tools (capability `llamacpp`). A device whose profile names no tools (qemu-aarch64: the
same flow on an emulated arm64 CPU) gets them built from source; there ggml's op is also judged by
testbed's float64 reference, the oracle `-b CPU` lacks."""

import pytest

from testbed.backends.llamacpp import ggml_gdn
from testbed.backends.llamacpp import runner as llamacpp
from testbed.experiments.gdn import AWKWARD_CASES, TBO_CASES

pytestmark = pytest.mark.device


@pytest.fixture(scope="module")
def tools(device):
    return llamacpp.resolve_tools(device, "auto", "", ("test-backend-ops", "tb_ggml_gdn"))


@pytest.mark.requires("llamacpp")
def test_gated_delta_net_passes_test_backend_ops_on_the_device(device, tools):
    backend = device.profile.accelerators.get("backend", "CPU")
    report, problems = llamacpp.test_backend_ops(device, "GATED_DELTA_NET", backend, tools)
    assert problems == [], f"{report.tally()} on {device.name} -b {backend}: " + "; ".join(problems)


@pytest.mark.requires("llamacpp")
def test_ggmls_gated_delta_net_on_the_device_matches_testbeds_reference(device, tools):
    if tools.built is None:
        pytest.skip(f"{device.name}'s llama.cpp tools are its profile's; tb_ggml_gdn is only built with them")
    records = list(ggml_gdn.oracle_records("llamacpp", device, tools.built.program("tb_ggml_gdn"),
                                           TBO_CASES + AWKWARD_CASES))
    failed = [f"{r.case}: {r.detail}" for r in records if r.verdict != "pass"]
    assert len(records) == 48 and not failed, failed
