"""The ARM and Hexagon builds of tb_gdn_bench over ADB to the loopback phone (qemu-user behind its adbd)
against the same program run by qemu-user directly: the transport must not change a bit. It needs no
selected device, so it runs in the host session only (the device sessions would each repeat it)."""

import numpy as np
import pytest

from tests.test_native_on_device import CASES, NAMES, TARGET_FOR_ABI, gdn_on, programs_for


@pytest.mark.parametrize("abi", ["armeabi-v7a", "arm64-v8a", "hexagon"])
def test_arm_builds_over_adb_are_bitexact_with_qemu_direct(loopback_adbd, adb_key, abi):
    """The same ARM (or Hexagon) program through ADB and run directly: the transport must not change a
    bit. Behind the loopback adbd a Hexagon ELF runs under qemu-hexagon by its exec shim."""
    from testbed.backends.native import programs as native_programs
    from testbed.peers.fixtures import adb_connect

    program = programs_for(abi)
    x = CASES[3].inputs(seed=1)
    adb_device = adb_connect(loopback_adbd, adb_key, abi=abi)  # the phone of that ABI (a program must fit it)
    try:
        over_adb = gdn_on(adb_device, program, x, "chunkwise").outputs
    finally:
        adb_device.close()
    direct, _ = native_programs.run_program(program.parent, TARGET_FOR_ABI[abi], "tb_gdn_bench",
                                            dict(zip(NAMES, x.arrays())),
                                            {"form": "chunkwise", "chunk": 16, "head_map": "tiled",
                                             "warmup": 0, "reps": 1})
    for name in ("out", "state"):
        assert np.array_equal(over_adb[name].view(np.uint32), direct[name].view(np.uint32))
