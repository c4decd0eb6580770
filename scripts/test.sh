#!/usr/bin/env sh
# The test command: the whole suite on the host, then the suites that run the optimised path on a
# device (`-m device`) on each emulated device this machine has (qemu-user, the loopback adbds,
# lavapipe): what runs on a device is checked there, with the device-side evidence, in every run.
# Extra arguments go to every pytest run (e.g. -x, -k NAME). Every run has the network guard on
# (pyproject.toml: network_guard = "loopback"): a test that sends anything outside loopback fails.
set -eu
cd "$(dirname "$0")/.."
python3 -m pytest --device=host --durations=20 "$@"
for device in qemu-arm32 qemu-aarch64 adb-loopback adb-loopback-arm64 lavapipe; do
  echo "== pytest --device=$device -m device"
  python3 -m pytest --device="$device" -m device -q "$@"
done
# Hexagon (zig's builds under qemu-hexagon): emulated Hexagon floating point is 10-20x slower than
# emulated ARM, so its suite leaves out the tests marked heavy_emulation (the other devices run them)
# and llama.cpp's tools, whose cold build for Hexagon takes about half an hour here (opt-in:
# `pytest -m slow_build tests/test_hexagon_llamacpp.py`). It keeps the GDN matrix, native_bench, the
# seed case at position 851 through the C engine, and the tail's byte-identical caches and first token.
echo "== pytest --device=qemu-hexagon -m 'device and not heavy_emulation'"
python3 -m pytest --device=qemu-hexagon -m "device and not heavy_emulation" -q \
  --deselect tests/test_llamacpp_on_device.py "$@"
# The same phone behind the loopback adbd: the Hexagon programs pushed and started over ADB.
echo "== pytest --device=adb-loopback-hexagon -m device tests/test_native_on_device.py"
python3 -m pytest --device=adb-loopback-hexagon -m device -q tests/test_native_on_device.py \
  "tests/device/test_gdn_on_device.py::test_native_bench_runs_on_the_device" "$@"
