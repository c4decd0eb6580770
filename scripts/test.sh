#!/usr/bin/env sh
# The test command.
#
# First the whole suite on the host: every test, the device tests included (on the host device),
# and the cross tests that run each target's programs under qemu-user and over the loopback adbd
# against the host build's bits.
#
# Then the suites that run the optimised path on a device (`-m device`), each on its device with the
# device-side evidence: the loopback ADB phone (arm32 behind adbd), qemu-aarch64, lavapipe (the IREE
# suite), qemu-hexagon and the Hexagon phone behind adbd. They leave out the tests marked heavy_emulation (minutes of emulated
# floating point per engine run: both seed cases through the experiment, the tail grids, quantised
# weights, the engine's planted bugs), which the host session runs.
#
# `scripts/test.sh --full` runs those on every device too, and adds qemu-arm32 and the arm64 phone
# behind adbd (whose programs the host session already runs under qemu-user and over ADB against the
# host build's bits). It costs about 15 more minutes per ARM device here, and more on Hexagon; the
# default is sized for CI (about 47 minutes on 2 cores from a clean clone in a fresh virtualenv at load
# about 4, measured: install 3, the host session 34 with its llama.cpp and IREE builds cold, the device
# sessions about 10; the bar is 60).
#
# Extra arguments go to every pytest run (e.g. -x, -k NAME). Every run has the network guard on
# (pyproject.toml: network_guard = "loopback"): a test that sends anything outside loopback fails.
# And every run is in a network namespace of its own with only loopback (scripts/offline.sh, as root),
# where no program, Python or not, can send a packet off this machine; elsewhere the in-process guard
# alone, with a warning line.
set -eu
cd "$(dirname "$0")/.."
[ -n "${TESTBED_NETWORK:-}" ] || exec scripts/offline.sh scripts/test.sh "$@"
selection="device and not heavy_emulation"
devices="adb-loopback qemu-aarch64"
if [ "${1:-}" = "--full" ]; then
  selection="device"
  devices="$devices qemu-arm32 adb-loopback-arm64"
  shift
fi
python3 -m pytest --device=host --durations=20 "$@"
for device in $devices; do
  echo "== pytest --device=$device -m '$selection'"
  python3 -m pytest --device="$device" -m "$selection" -q "$@"
done
# lavapipe (Vulkan on the CPU): IREE's modules compiled for it and run on it (its device suite is the
# IREE one; the native kernels have no Vulkan build).
echo "== pytest --device=lavapipe tests/test_iree_on_device.py"
python3 -m pytest --device=lavapipe -q tests/test_iree_on_device.py "$@"
# Hexagon (zig's builds under qemu-hexagon, whose floating point is about 4x slower than emulated
# AArch64's): llama.cpp's tools for Hexagon are opt-in, their cold build takes about half an hour here
# (`pytest -m slow_build tests/test_hexagon_llamacpp.py`); the hybrid engine's device suite runs on the
# ARM devices (on Hexagon with --full).
echo "== pytest --device=qemu-hexagon -m '$selection'"
hexagon_out="--deselect tests/test_llamacpp_on_device.py"
[ "$selection" = "device" ] || hexagon_out="$hexagon_out --deselect tests/device/test_hybrid_on_device.py"
# shellcheck disable=SC2086  # two options, split on purpose
python3 -m pytest --device=qemu-hexagon -m "$selection" -q $hexagon_out "$@"
# The same phone behind the loopback adbd: the Hexagon programs pushed and started over ADB (the GDN
# program's suite only). native_bench on Hexagon runs in the qemu-hexagon session above: the same
# programs on the same emulator (the phone's exec shim starts qemu-hexagon), and
# tests/test_native_over_adb.py (host session) shows ADB changes no bit of a Hexagon program's output.
echo "== pytest --device=adb-loopback-hexagon -m device tests/test_native_on_device.py"
python3 -m pytest --device=adb-loopback-hexagon -m device -q tests/test_native_on_device.py "$@"
