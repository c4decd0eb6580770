"""Exact instruction counts (testbed.measure.counts): the same program on the same inputs gives the same count
on every emulated device, run after run; the count is the kernel's (between the harness's marks, apart
from the harness); a planted slowdown moves it; anything the counter wrote that cannot be trusted is
refused, never stored as a count."""

import json
import shutil

import pytest

from refimpl import gdn as ref
from testbed.backends.native import build as kernel_build
from testbed.backends.native.device import NativeJob, run_native
from testbed.devices import connect, load_profile
from testbed.devices.profile import Profile
from testbed.measure import counts
from tests.native_support import slowed_chunkwise

NAMES = ("q", "k", "v", "g", "beta", "state")
TARGETS = {"qemu-arm32": "arm32", "qemu-aarch64": "aarch64", "qemu-hexagon": "hexagon"}
PHONES = {"arm32": "armeabi-v7a", "hexagon": "hexagon"}  # behind the loopback adbd: its exec shim's emulators


def programs(target, **kw):
    """The device programs for `target`; a test of the Hexagon ones is skipped without zig."""
    try:
        return kernel_build.build_programs(target, **kw)
    except kernel_build.BuildError as e:
        pytest.skip(str(e))


def gdn_run(device, program, x, form="chunkwise", reps=2, count=False):
    args = ["{inputs}", ".", f"form={form}", "chunk=16", "head_map=tiled", "warmup=1", f"reps={reps}"]
    return run_native(device, NativeJob(program, dict(zip(NAMES, x.arrays())), ["out", "state"], args,
                                        measured=False, count=count))


@pytest.fixture(scope="module")
def x():
    return ref.draw_inputs(1, 48, 2, 32, kda=False, seed=3)


@pytest.mark.parametrize("name", list(TARGETS))
def test_counts_are_identical_across_runs_and_calls_on_qemu(name, x):
    program = programs(TARGETS[name]) / "tb_gdn_bench"
    device = connect(load_profile(name))
    runs = [gdn_run(device, program, x).counts for _ in range(3)]
    assert all(c is not None and c.counter == "qemu-tcg-plugin" and c.exact for c in runs)
    assert len({c.regions for c in runs}) == 1, [c.regions for c in runs]
    assert len(set(runs[0].regions)) == 1  # every timed call of one run: the same instructions
    # the whole process differs from run to run (environment, paths); the marked region does not
    assert runs[0].per_call < runs[0].total


@pytest.mark.parametrize("target", list(PHONES))
def test_counts_behind_the_loopback_adbd_match_qemu_directly(loopback_adbd, adb_key, x, target):
    """The loopback phone's emulator counts too (its exec shim runs qemu-arm or qemu-hexagon under the
    plugin): the same program and inputs give the count qemu-user gives directly, three times over ADB."""
    program = programs(target) / "tb_gdn_bench"
    profile = Profile(name="loopback-counts", transport="adb", abi=PHONES[target],
                      capabilities=["cpu", "native", "adb", "emulated", "counts"], work_dir="/data/local/tmp/testbed")
    device = connect(profile, {"host": loopback_adbd.host, "port": loopback_adbd.port, "key": str(adb_key)})
    try:
        over_adb = [gdn_run(device, program, x).counts.regions for _ in range(3)]
    finally:
        device.close()
    direct = gdn_run(connect(load_profile(f"qemu-{target}")), program, x).counts.regions
    assert over_adb == [direct] * 3


def test_the_count_is_the_kernels_and_scales_with_its_work():
    """Twice the tokens, about twice the serial kernel's instructions; the harness (input loading,
    output writing) is outside the marks, so the count does not carry its fixed cost."""
    device = connect(load_profile("qemu-aarch64"))
    program = kernel_build.build_programs("aarch64") / "tb_gdn_bench"
    short, long = (gdn_run(device, program, ref.draw_inputs(1, t, 2, 32, kda=False, seed=1), form="serial",
                           reps=1).counts.per_call for t in (32, 64))
    assert 1.9 < long / short < 2.1, (short, long)


@pytest.mark.parametrize("name", ["qemu-aarch64", "qemu-hexagon"])
def test_a_planted_slowdown_moves_the_count_and_not_the_output(x, name):
    target = TARGETS[name]
    clean_program = programs(target) / "tb_gdn_bench"
    device = connect(load_profile(name))
    clean = gdn_run(device, clean_program, x)
    slowed_tree = slowed_chunkwise(500)
    slowed = gdn_run(device, programs(target, kernels_dir=slowed_tree) / "tb_gdn_bench", x)
    assert all((clean.outputs[k] == slowed.outputs[k]).all() for k in clean.outputs)
    # 2 heads x 3 chunks x 500 turns: at least one instruction a turn
    assert slowed.counts.per_call - clean.counts.per_call >= 2 * 3 * 500


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_host_counts_under_valgrind_are_identical_and_match_the_planted_change(x):
    device = connect(load_profile("host"))
    program = kernel_build.build_programs("host", avx512=False) / "tb_gdn_bench"
    a, b = (gdn_run(device, program, x, count=True).counts for _ in range(2))
    assert a.counter == "valgrind-callgrind" and a.regions == b.regions and len(a.regions) == 2
    slowed = kernel_build.build_programs("host", kernels_dir=slowed_chunkwise(500), avx512=False) / "tb_gdn_bench"
    assert gdn_run(device, slowed, x, count=True).counts.per_call - a.per_call >= 2 * 3 * 500


# --- what the counter wrote is checked before it is believed ------------------------------------------


def plugin_output(**changes):
    data = {"counter": "qemu-tcg-plugin", "total": 1000, "vcpus": 1, "exact": True, "unmatched_markers": 0,
            "regions_dropped": 0, "regions": [100, 100]}
    return json.dumps({**data, **changes})


def test_plugin_output_is_read_when_whole():
    c = counts.parse_plugin_output(plugin_output(), expected_regions=2)
    assert c.regions == (100, 100) and c.per_call == 100 and c.exact


@pytest.mark.parametrize("bad, why", [
    (plugin_output(regions=[]), "no marked region"),
    (plugin_output(regions=[100]), "1 marked regions"),
    (plugin_output(unmatched_markers=1), "unmatched"),
    (plugin_output(regions_dropped=3), "dropped"),
    ('{"total": 5}', "not what it writes"),
    ("", "not what it writes"),
])
def test_plugin_output_that_cannot_be_trusted_is_refused(bad, why):
    with pytest.raises(counts.CountError, match=why):
        counts.parse_plugin_output(bad, expected_regions=2)


def dump(mark, instructions=42):
    return f"desc: Trigger: --dump-before={mark}\nevents: Ir\nsummary: {instructions}\n"


def test_callgrind_dumps_are_read_in_pairs_and_refused_without_a_summary():
    assert counts.parse_callgrind_dumps([dump("tb_count_begin", 7), dump("tb_count_end", 42)], 1).regions == (42,)
    with pytest.raises(counts.CountError, match="no summary"):
        counts.parse_callgrind_dumps([dump("tb_count_begin"), "desc: Trigger: --dump-before=tb_count_end\n"], 1)


@pytest.mark.parametrize("marks", [("tb_count_begin", "tb_count_end", "tb_count_end"),   # an end doubled
                                   ("tb_count_begin", "tb_count_begin", "tb_count_end"),  # a begin doubled
                                   ("tb_count_end",)])
def test_callgrind_dumps_of_unmatched_marks_are_refused(marks):
    with pytest.raises(counts.CountError, match="unmatched marks"):
        counts.parse_callgrind_dumps([dump(m) for m in marks], 1)


def test_a_program_without_the_marks_gives_no_count(tmp_path):
    """A program built without the harness's marks runs under the plugin, but its output has no
    region: the count is refused rather than read as zero."""
    source = tmp_path / "plain.c"
    source.write_text("int main(void) { volatile int s = 0; for (int i = 0; i < 1000; i++) s += i; return 0; }\n")
    if shutil.which("aarch64-linux-gnu-gcc") is None:
        pytest.skip("aarch64-linux-gnu-gcc is not installed")
    import subprocess

    subprocess.run(["aarch64-linux-gnu-gcc", "-O1", "-static", "-o", str(tmp_path / "plain"), str(source)], check=True)
    subprocess.run(["qemu-aarch64", *counts.qemu_plugin_args(), str(tmp_path / "plain")], cwd=tmp_path, check=True)
    text = (tmp_path / counts.COUNTS_FILE).read_text()
    assert json.loads(text)["total"] > 1000
    with pytest.raises(counts.CountError, match="no marked region"):
        counts.parse_plugin_output(text)


def test_an_unmarked_program_on_a_counting_device_says_it_was_not_counted(tmp_path):
    """A count is due for every program on a counting device; one whose program marks no timed region
    comes back saying "not counted: ..." in the result and in its evidence, never silently nothing."""
    if shutil.which("aarch64-linux-gnu-gcc") is None:
        pytest.skip("aarch64-linux-gnu-gcc is not installed")
    import subprocess

    import numpy as np

    source = tmp_path / "unmarked.c"
    source.write_text('#include <stdio.h>\nint main(void) { FILE *f = fopen("timings.json", "w"); '
                      'fputs("{\\"seconds\\": [0.001]}", f); return fclose(f) != 0; }\n')
    program = tmp_path / "unmarked"
    subprocess.run(["aarch64-linux-gnu-gcc", "-O1", "-static", "-o", str(program), str(source)], check=True)
    device = connect(load_profile("qemu-aarch64"))
    result = run_native(device, NativeJob(program, {"x": np.zeros(1, np.float32)}, [], [], measured=False))
    assert result.counts is None
    assert result.uncounted.startswith("not counted: unmarked marks no timed region")
    assert result.evidence.detail["instructions"] == result.uncounted
