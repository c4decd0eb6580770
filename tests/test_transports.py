"""The transport interface on every kind of device, against real peers: the host, a loopback adbd
driven by adb-shell, the same kind of adbd through Debian's adb server, and a real sshd driven by
paramiko. Same tests, same expectations."""

import os

import numpy as np
import pytest

from testbed.devices import CommandTimeout
from testbed.devices.transport import confine

# File names that would break or hijack a carelessly built shell command.
AWKWARD_NAMES = ["plain.bin", "with space.bin", "quote'in\"it.bin", "$(touch pwned).bin", "semi;colon.bin"]


@pytest.fixture(params=["local", "adb", "adb_server", "ssh"])
def dev(request):
    return request.getfixturevalue(f"{request.param}_device")


def test_push_pull_round_trip_with_awkward_names(dev, tmp_path):
    payload = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    for name in AWKWARD_NAMES:
        src = tmp_path / "src.bin"
        src.write_bytes(payload + name.encode())
        dev.push(src, f"sub dir/{name}")
        back = tmp_path / "back.bin"
        dev.pull(f"sub dir/{name}", back)
        assert back.read_bytes() == payload + name.encode()
    listing = dev.run(["ls", "-A", "sub dir"]).stdout.splitlines()
    assert sorted(listing) == sorted(AWKWARD_NAMES)
    assert dev.run(["ls", "pwned"]).returncode != 0  # the $(...) in a name never ran
    dev.run(["rm", "-rf", "sub dir"])


def test_run_separates_exit_code_stdout_and_stderr(dev):
    r = dev.run(["sh", "-c", 'printf "out\\n"; printf "err\\n" >&2; exit 7'])
    assert (r.returncode, r.stdout, r.stderr) == (7, "out\n", "err\n")
    r = dev.run(["echo", "a; echo injected", "$(id)", "`id`"])
    assert r.stdout == "a; echo injected $(id) `id`\n" and r.returncode == 0


def test_run_happens_in_the_work_folder(dev):
    assert dev.run(["pwd"]).stdout.strip().endswith(str(dev.transport.work_dir).rstrip("/"))


def test_paths_outside_the_work_folder_are_refused(dev, tmp_path):
    (tmp_path / "f").write_text("x")
    for bad in ["/etc/passwd", "../escape", "a/../../escape", ""]:
        with pytest.raises(ValueError, match="outside the work folder"):
            dev.push(tmp_path / "f", bad)
    assert confine("a/./b/../c") == "a/c"


def test_a_hung_command_is_killed_at_its_timeout(dev):
    # 5 s, not 1: on a loaded machine a 1 s kill timer can fire before the shell has written its pid
    with pytest.raises(CommandTimeout, match="did not finish in 5 s"):
        dev.run(["sh", "-c", "echo $$ > hung.pid; exec sleep 60"], timeout=5)
    pid = dev.run(["cat", "hung.pid"]).stdout.strip()
    assert pid.isdigit()
    # gone, not orphaned (a zombie whose parent died counts as gone: some containers' init never reaps)
    gone = dev.run(["sh", "-c", 'test ! -e /proc/$1 || grep -q "^State:.*Z" /proc/$1/status', "sh", pid])
    assert gone.returncode == 0
    assert dev.run(["true"]).returncode == 0  # and the device still answers


def test_cleanup_empties_the_work_folder(dev, tmp_path):
    (tmp_path / "f").write_text("x")
    dev.push(tmp_path / "f", ".hidden/f")
    dev.push(tmp_path / "f", "visible")
    dev.transport.cleanup()
    # (over ADB the listing's own stderr capture file, .tb-stderr-NONCE, exists while it runs)
    left = [f for f in dev.run(["ls", "-A"]).stdout.split() if not f.startswith(".tb-stderr-")]
    assert left == []
    assert dev.run(["true"]).returncode == 0


def test_pull_of_a_missing_file_is_an_error_and_writes_nothing(dev, tmp_path):
    from testbed.devices import TransferError

    with pytest.raises(TransferError, match="no such file"):
        dev.pull("does-not-exist.npy", tmp_path / "out.npy")
    assert os.listdir(tmp_path) == []


def test_a_program_that_is_not_there_exits_127_as_a_shell_says_it(dev):
    """The host starts a program itself, the others through a shell: a missing one is exit 127 on each, never
    an exception (an engine yaml's program word may name one)."""
    r = dev.run(["./no-such-program;", "x"])
    assert r.returncode == 127 and "no-such-program" in r.stderr, r


def test_a_files_size_is_read_without_reading_the_file(dev):
    """remote_size: what a caller checks before pulling a file a program on the device wrote at a size of its
    choosing (a sparse terabyte here: hashing it, as remote_digest does, would read it all)."""
    dev.run(["sh", "-c", "truncate -s 1T sparse.bin || dd if=/dev/zero of=sparse.bin bs=1 count=0 seek=1T"])
    assert dev.transport.remote_size("sparse.bin") == 2**40
    assert dev.transport.remote_size("absent.bin") is None
    dev.run(["rm", "-f", "sparse.bin"])
