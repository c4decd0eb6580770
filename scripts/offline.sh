#!/usr/bin/env sh
# Runs a command where nothing it starts can send a packet off this machine: in a network namespace of
# its own (`unshare -n`, which needs root) with only loopback, brought up inside (the tests talk to
# loopback servers: sshd, adbd, Ray, Chromium). That holds for every program, Python or not (a ctypes
# connect, bash's /dev/tcp), which pytest's in-process network guard cannot see.
# Where no namespace can be made (not root, no unshare or ip), says so in one line and runs the
# command as it is: pytest's in-process guard still refuses what Python sends.
# The command sees TESTBED_NETWORK=namespace or TESTBED_NETWORK=host (which one it got).
#   scripts/offline.sh COMMAND [ARG...]
set -eu
if [ "$#" -eq 0 ]; then
  echo "offline.sh: no command given; usage: scripts/offline.sh COMMAND [ARG...]" >&2
  exit 2
fi
if command -v unshare >/dev/null 2>&1 && command -v ip >/dev/null 2>&1 \
   && unshare -n ip link set lo up 2>/dev/null; then
  TESTBED_NETWORK=namespace exec unshare -n sh -c 'ip link set lo up && exec "$@"' offline.sh "$@"
fi
echo "offline.sh: cannot make a network namespace (needs root, unshare from util-linux and ip from" \
     "iproute2); running with pytest's in-process network guard only" >&2
TESTBED_NETWORK=host exec "$@"
