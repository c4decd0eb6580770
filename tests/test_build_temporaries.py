"""A build killed outright (SIGKILL) leaves its half-built OUT.tmpPID folder in .cache/kernels: the next
build removes those whose process is gone, and nothing else (testbed.backends.native.build)."""

import os
import shutil
import subprocess

from testbed.backends.native import build


def _dead_pid() -> int:
    """The id of a process that has ended (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_killed_builds_temporary_folder_is_removed_and_nothing_else(tmp_path):
    built = build.build_programs("host")  # the shared cache's (built once per machine)
    cache = tmp_path / "kernels"
    cache.mkdir()
    shutil.copytree(built, cache / built.name)
    stale = cache / f"{built.name}.tmp{_dead_pid()}"
    (stale / "obj").mkdir(parents=True)
    (stale / "obj" / "tb_gdn_bench.o").write_bytes(b"half")
    live = cache / f"aarch64-zig-fused-0123456789abcdef.tmp{os.getpid()}"  # a build running now
    live.mkdir()
    outside = tmp_path / "not-testbeds"
    outside.mkdir()
    (outside / "keep").write_text("a user's file")
    linked = cache / f"host-fedcba9876543210.tmp{_dead_pid()}"
    linked.symlink_to(outside, target_is_directory=True)  # named like one, but a link: never followed
    foreign = cache / f"host-mine.tmp{_dead_pid()}"  # not testbed's name
    foreign.mkdir()

    assert build.build_programs("host", cache_dir=cache) == cache / built.name
    assert not stale.exists()
    assert live.is_dir() and linked.is_symlink() and (outside / "keep").is_file() and foreign.is_dir()
