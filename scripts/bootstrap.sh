#!/usr/bin/env sh
# Installs what testbed needs on a fresh Debian machine, then the project itself (editable).
#   scripts/bootstrap.sh          the main job (`testbed nightly`'s default suite): a C compiler and
#                                 valgrind (the host's counts), qemu-user with the ARM cross compilers
#                                 and zig (the cross extra: the suite counts every kernel on qemu-aarch64,
#                                 qemu-arm32 and qemu-hexagon), and the Python package with its extras
#   scripts/bootstrap.sh --test   also what the test suites drive for real: Debian's adb client,
#                                 openssh-server, Mesa's software Vulkan
#                                 (lavapipe), Chromium for the report check, torch + transformers
#                                 for the cross-checks against Hugging Face (the `hf` extra), ONNX
#                                 Runtime and torch.onnx's exporter (the `onnx` extra: engine=onnxruntime), CMake,
#                                 Ninja, ccache and the aarch64 C++ compiler that build llama.cpp's tools,
#                                 Ray (the farm extra: the tests run a three-node cluster here), the
#                                 exported runtimes judged as engines (the executorch and litert
#                                 extras: engines/README.md; mnn, a recorded finding whose exporter
#                                 reports home, only with `pip install 'testbed[mnn]'`), and
#                                 iproute2 (scripts/offline.sh brings up loopback in the tests' own
#                                 network namespace)
# Where another apt-get holds the package lock (a shared machine), each apt-get waits its turn
# (scripts/wait-for-dpkg-lock.sh: a line naming the holder, then one at least every 30 s).
set -eu
cd "$(dirname "$0")/.."

HOST_PACKAGES="gcc make valgrind qemu-user gcc-arm-linux-gnueabihf gcc-aarch64-linux-gnu libc6-dev-armhf-cross
  libc6-dev-arm64-cross"
TEST_PACKAGES="adb openssh-server mesa-vulkan-drivers libvulkan1 chromium g++ g++-aarch64-linux-gnu cmake ninja-build ccache iproute2"

packages="$HOST_PACKAGES"
extras="full,cross"
if [ "${1:-}" = "--test" ]; then
  packages="$packages $TEST_PACKAGES"
  extras="full,hf,farm,cross,onnx,executorch,litert"
fi

missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "bootstrap: missing Debian packages:$missing (run as root, or install them)" >&2
    exit 1
  fi
  echo "bootstrap: installing Debian packages:$missing" >&2
  # On a shared machine another apt-get may hold the package lock: wait for it, saying so (apt-get alone
  # would exit 100); the lock timeout covers the instant between that wait and apt-get taking the lock.
  scripts/wait-for-dpkg-lock.sh
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  scripts/wait-for-dpkg-lock.sh
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
    $missing >/dev/null
fi

# Into the Python on PATH: an active virtualenv's, else this machine's. pip is quiet for minutes
# (downloads, the kernels' build): a line every 30 s says it still works.
echo "bootstrap: installing testbed[$extras] into $(python3 -c 'import sys; print(sys.prefix)')" >&2
(while sleep 30; do echo "bootstrap: pip still installing" >&2; done) &
heartbeat=$!
trap 'kill "$heartbeat" 2>/dev/null' EXIT
trap 'exit 130' INT TERM
python3 -m pip install -q --disable-pip-version-check -e ".[$extras]"
kill "$heartbeat"
trap - EXIT INT TERM

if [ "${1:-}" = "--test" ]; then
  # What the suites would otherwise fetch from the package index while they run, where their network
  # guard lets nothing out of loopback: the aarch64 IREE runtime tools and llama.cpp's sources (the
  # llama-cpp-python sdist), each fetched once into .cache/ and reused.
  python3 -c "from testbed.backends.iree.device import aarch64_tools_folder as iree; \
from testbed.backends.llamacpp.build import sdist_source as llama; iree(print); llama()"
fi
