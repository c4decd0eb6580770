"""The GDN kernels' benchmark-and-dump program (kernels/bench/tb_gdn_bench) on the selected device,
through its transport: `pytest --device=qemu-arm32 | qemu-aarch64 | qemu-hexagon | adb-loopback | host` runs the
same equivalence suite, the program built for the device's ABI, pushed with its .npy inputs, run,
its outputs pulled and judged against the float64 reference by NMSE (test-backend-ops' 1e-7).
(The ARM and Hexagon builds over ADB against qemu-user directly: tests/test_native_over_adb.py.)"""

import shutil

import numpy as np
import pytest

from testbed.backends.native import build as kernel_build
from testbed.backends.native.device import NativeJob, run_native
from testbed.experiments.gdn import TBO_CASES
from testbed.oracles.numerical import check_nmse
from tests.native_support import reference64

pytestmark = pytest.mark.device

TARGET_FOR_ABI = {"host": "host", "x86_64": "host", "armeabi-v7a": "arm32", "arm64-v8a": "aarch64", "hexagon": "hexagon"}
COMPILERS = {"arm32": "arm-linux-gnueabihf-gcc", "aarch64": "aarch64-linux-gnu-gcc", "host": "cc"}
# Cases across llama.cpp's matrix: scalar and vector gates, grouped value heads, several chunks.
CASES = [TBO_CASES[i] for i in (5, 7, 15, 19, 27)]
NAMES = ("q", "k", "v", "g", "beta", "state")


def programs_for(abi: str):
    target = TARGET_FOR_ABI[abi]
    if target == "hexagon":  # zig, from the ziglang package
        try:
            kernel_build.zig_binary()
        except kernel_build.BuildError as e:
            pytest.skip(str(e))
    elif shutil.which(COMPILERS[target]) is None:
        pytest.skip(f"{COMPILERS[target]} is not installed")
    return kernel_build.build_programs(target) / "tb_gdn_bench"


def gdn_on(device, program, x, form: str, chunk: int = 16, inputs=None):
    arrays = dict(zip(NAMES, inputs or x.arrays()))
    args = [".", ".", f"form={form}", f"chunk={chunk}", "head_map=tiled", "warmup=0", "reps=1"]
    return run_native(device, NativeJob(program, arrays, ["out", "state"], args, measured=False))


@pytest.mark.requires("native")
@pytest.mark.parametrize("form", ["serial", "chunkwise"])
def test_gdn_program_on_the_device_matches_the_reference(device, form):
    program = programs_for(device.profile.abi)
    for case in CASES:
        x = case.inputs(seed=0)
        result = gdn_on(device, program, x, form)
        verdict = check_nmse(reference64(x, "tiled"), result.outputs)
        assert verdict.passed, f"{case.name} {form} on {device.name}: {verdict.detail}"
        assert len(result.timings["seconds"]) == 1


@pytest.mark.requires("native")
def test_inputs_staged_in_the_wrong_order_are_caught(device):
    """A realistic runner bug: q and k swapped when staged. The program runs fine; the oracle fails."""
    program = programs_for(device.profile.abi)
    x = CASES[0].inputs(seed=0)
    q, k, *rest = x.arrays()
    result = gdn_on(device, program, x, "chunkwise", inputs=[k, q, *rest])
    assert not check_nmse(reference64(x, "tiled"), result.outputs).passed
