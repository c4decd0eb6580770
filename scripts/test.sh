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
