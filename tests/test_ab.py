"""`testbed ab A B`: two trees' programs measured interleaved in one job and judged on the pairs.

The same tree twice says "no change" and exits 0; a planted slowdown in B (more instructions, the same
output) exits 1 naming the kernel and the exact instruction change, on an emulated device by its
counts and on the host by valgrind's; the untouched kernel is not named. The judges are plain
functions, shown here to fail on what they must catch and to pass what they must not."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from testbed.errors import UsageError
from testbed.lab import ab
from tests.native_support import slowed_chunkwise

# A small GDN bench: 2 heads of 32, 48 tokens, one chunk of 64: cheap under qemu.
SMALL = ["backend=native", "bench.tokens=[48]", "bench.heads=2", "bench.head_size=32"]


def run_ab(tmp_path, *args):
    env = {**os.environ, "TESTBED_RESULTS": str(tmp_path / "results")}
    return subprocess.run([sys.executable, "-m", "testbed", "ab", *args], capture_output=True, text=True, env=env,
                          timeout=1200)


def rows(tmp_path, *args):
    p = run_ab(tmp_path, *args, "--format", "json")
    return p.returncode, {r["call"]: r for r in json.loads(p.stdout)["rows"]}, p


def test_the_same_tree_twice_is_no_change_on_qemu(tmp_path):
    p = run_ab(tmp_path, "HEAD", "HEAD", "device=qemu-aarch64", *SMALL, "--reps", "2")
    assert p.returncode == 0, p.stderr + p.stdout
    assert "B is not worse than A on any call" in p.stdout
    assert p.stdout.count("| no change") == 2, p.stdout  # serial and chunkwise


@pytest.fixture(scope="module")
def chunkwise_count(tmp_path_factory):
    """The chunkwise call's instructions on qemu-aarch64 and what one planted turn adds: counts are exact
    and linear in the turns, so two counts calibrate every fraction (measured once for the module)."""
    folder = tmp_path_factory.mktemp("calibration")
    _, base, _ = rows(folder, "HEAD", str(slowed_chunkwise(0)), "device=qemu-aarch64", *SMALL, "--reps", "1")
    call = "H=2,hs=32,T=48,kda=0/chunkwise"
    _, probe, _ = rows(folder, "HEAD", str(slowed_chunkwise(1000)), "device=qemu-aarch64", *SMALL, "--reps", "1")
    a = base[call]["instructions_B"]
    return a, (probe[call]["instructions_B"] - a) / 1000


@pytest.mark.parametrize("fraction", [0.05, 0.25])
def test_a_planted_slowdown_in_b_exits_1_naming_the_kernel_and_the_change(tmp_path, fraction, chunkwise_count):
    """The planted loop's turns add `fraction` to the chunkwise call's instructions on qemu-aarch64."""
    a, per_turn = chunkwise_count
    slowed = slowed_chunkwise(int(np.ceil(fraction * a / per_turn)))
    rc, table, p = rows(tmp_path, "HEAD", str(slowed), "device=qemu-aarch64", *SMALL, "--reps", "2")
    assert rc == 1, p.stderr
    chunkwise, serial = table["H=2,hs=32,T=48,kda=0/chunkwise"], table["H=2,hs=32,T=48,kda=0/serial"]
    assert chunkwise["verdict"] == "slower" and chunkwise["kernel"] == "tb_gdn_chunkwise"
    change = chunkwise["instructions_B"] / chunkwise["instructions_A"] - 1
    assert abs(change - fraction) < 0.005
    assert serial["verdict"] == "no change" and serial["instructions_A"] == serial["instructions_B"]
    md = run_ab(tmp_path, "HEAD", str(slowed), "device=qemu-aarch64", *SMALL, "--reps", "2").stdout
    assert f"SLOWER tb_gdn_chunkwise H=2,hs=32,T=48,kda=0/chunkwise: instructions {chunkwise['instructions_A']} -> " \
           f"{chunkwise['instructions_B']}" in md


def test_the_threshold_given_to_the_command_decides_and_a_fall_is_not_a_rise(tmp_path, chunkwise_count):
    """The 5% rise above (its tree, built once): under --threshold 0.10 it is reported, not judged
    slower (exit 0); A and B swapped, it is a fall ("faster"), never "slower" or "no change"."""
    a, per_turn = chunkwise_count
    slowed = str(slowed_chunkwise(int(np.ceil(0.05 * a / per_turn))))
    rc, table, p = rows(tmp_path, "HEAD", slowed, "device=qemu-aarch64", *SMALL, "--reps", "1", "--threshold", "0.10")
    assert rc == 0, p.stderr
    assert table["H=2,hs=32,T=48,kda=0/chunkwise"]["verdict"] == "changed"
    rc, table, p = rows(tmp_path, slowed, "HEAD", "device=qemu-aarch64", *SMALL, "--reps", "1")
    assert rc == 0, p.stderr
    assert table["H=2,hs=32,T=48,kda=0/chunkwise"]["verdict"] == "faster"
    assert table["H=2,hs=32,T=48,kda=0/serial"]["verdict"] == "no change"


@pytest.fixture(scope="module")
def host_chunkwise_count(tmp_path_factory):
    """The chunkwise call's instructions on the host (valgrind, counted by default: no counts=true) and
    what one planted turn adds, from one job of A against B with 1000 turns."""
    rc, probe, p = rows(tmp_path_factory.mktemp("host"), "HEAD", str(slowed_chunkwise(1000)), "device=host", *SMALL,
                        "--reps", "1")
    chunkwise = probe["H=2,hs=32,T=48,kda=0/chunkwise"]
    assert chunkwise["instructions_A"], p.stderr
    return chunkwise["instructions_A"], (chunkwise["instructions_B"] - chunkwise["instructions_A"]) / 1000


def test_on_the_host_a_5_percent_instruction_change_is_counted_by_default_and_the_pairs_are_timed(
        tmp_path, host_chunkwise_count):
    a, per_turn = host_chunkwise_count
    slowed = slowed_chunkwise(int(np.ceil(0.05 * a / per_turn)))
    rc, table, p = rows(tmp_path, ".", str(slowed), "device=host", *SMALL, "--reps", "6")
    assert rc == 1, p.stderr
    chunkwise = table["H=2,hs=32,T=48,kda=0/chunkwise"]
    assert chunkwise["verdict"].startswith("slower")
    assert abs(chunkwise["instructions_B"] / chunkwise["instructions_A"] - 1.05) < 0.005
    assert chunkwise["pairs"] == 6 and chunkwise["cpu_B_per_A"] > 0 and chunkwise["p_cpu_Holm"] is not None
    assert table["H=2,hs=32,T=48,kda=0/serial"]["instructions_A"] == table["H=2,hs=32,T=48,kda=0/serial"]["instructions_B"]


def test_on_the_host_the_same_tree_twice_is_not_slower_with_the_adaptive_design(tmp_path):
    """No --reps: pairs in looks until decided or the (small) budget is spent; never "slower"."""
    p = run_ab(tmp_path, "HEAD", "HEAD", "device=host", *SMALL, "--budget", "15", "--seed", "1")
    assert p.returncode == 0, p.stderr + p.stdout
    assert "B is not worse than A on any call" in p.stdout and "SLOWER" not in p.stdout
    assert "design group-sequential: looks at 6, 12, 24" in p.stdout
    assert "look 1/" in p.stderr  # a progress line per look
    record = [json.loads(line) for line in (tmp_path / "results" / "records.jsonl").read_text().splitlines()
              if '"ab/' in line][0]
    block = record["metrics"]["ab"]
    assert block["looks"] >= 1 and block["pairs"] >= 6 and block["budget_cpu_s"] == 15
    assert block["stopped"] == "decided" or block["stopped"].startswith("budget spent: undecided, need about ")


def test_without_valgrind_the_host_says_not_counted(tmp_path):
    """PATH holding every tool of the usual PATH but valgrind: instructions "not counted: valgrind missing",
    never "no change" on what was not counted."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        if os.path.isdir(folder):
            for tool in os.listdir(folder):
                if tool != "valgrind" and not (tools / tool).exists():
                    (tools / tool).symlink_to(os.path.join(folder, tool))
    env = {**os.environ, "PATH": str(tools), "TESTBED_RESULTS": str(tmp_path / "results")}
    p = subprocess.run([sys.executable, "-m", "testbed", "ab", "HEAD", "HEAD", "device=host", *SMALL, "--reps", "1",
                        "--format", "json"], capture_output=True, text=True, env=env, timeout=1200)
    assert p.returncode == 0, p.stderr
    for row in json.loads(p.stdout)["rows"]:
        assert row["instr_change"] == "not counted: valgrind missing" and row["instructions_A"] is None
        assert "no change" not in row["verdict"]


def test_bad_trees_are_refused(tmp_path):
    with pytest.raises(UsageError, match="neither a folder nor a git revision"):
        ab.resolve_tree("no-such-revision-xyz")
    with pytest.raises(UsageError, match="without testbed's kernels"):
        ab.resolve_tree(str(tmp_path))
    p = run_ab(tmp_path, "HEAD", "no-such-revision-xyz", "device=qemu-aarch64")
    assert p.returncode == 2 and "no-such-revision-xyz" in p.stderr and not (tmp_path / "results").exists()
    p = run_ab(tmp_path, "HEAD", "HEAD", "backend=refimpl")
    assert p.returncode == 2 and "backend=native" in p.stderr


# --- the judges ---------------------------------------------------------------------------------------


def test_count_verdicts():
    assert ab.count_verdict(1000, 1000, 0.01) == "no change"
    assert ab.count_verdict(1000, 1005, 0.01) == "changed"   # reported, under the threshold
    assert ab.count_verdict(1000, 1011, 0.01) == "slower"
    assert ab.count_verdict(1000, 990, 0.01) == "fewer"
    assert ab.count_verdict(None, 990, 0.01) == "not counted"


def test_an_undecided_cpu_time_is_never_hidden_behind_an_instruction_change_under_the_threshold():
    """Issue 46: instructions +0.4% ("changed", under the 1% threshold) and CPU time undecided read
    "changed", and the last line said "B is not worse". The open CPU verdict is what the call says."""
    assert ab._overall({"instructions": "changed", "cpu": "undecided", "wall": "undecided"}) == "undecided"
    assert ab._overall({"instructions": "changed", "cpu": "no change", "wall": "no change"}) == "changed"
    assert ab._overall({"instructions": "no change", "cpu": "below floor", "wall": "no change"}) == "below floor"
    assert ab._overall({"instructions": "fewer", "cpu": "undecided", "wall": "undecided"}) == "faster"
