"""The nightly catches a slowdown of the C kernels on the first night it appears.

Real nights (testbed.lab.nightly.run_night) of a small suite with A/B runs on the host (counts by valgrind,
CPU time by the pairs) and on qemu-aarch64 (counts by the plugin), measuring a source tree this test
owns. Night 1 has no baseline (tonight against itself); then the tree gets a planted +25% of work in
the GDN chunkwise kernel (more instructions, the same output), is reverted, then gets +5%. Each
slowdown is flagged on its first night on both devices, once per device for the chunkwise kernel's
instructions; the untouched serial kernel is never flagged; the revert's night is clean."""

import shutil

import numpy as np
import pytest

from testbed.backends.native import build as kernel_build
from testbed.lab import nightly
from testbed.lab.nightly import Log
from testbed.results import ResultsStore
from tests.native_support import slowed_chunkwise

SHAPE = ["backend=native", "bench.tokens=[48]", "bench.heads=2", "bench.head_size=32"]
SUITE = """
devices: [host, qemu-aarch64]
runs:
  gdn_ab_host:
    experiment: gdn
    devices: [host]
    ab: true
    overrides: [{shape}, counts=true]
  gdn_ab_emulated:
    experiment: gdn
    devices: [qemu-aarch64]
    ab: true
    overrides: [{shape}]
ab_reps: 6
ab_tree: {tree}
lock_dir: {locks}
lock_wait_s: 60
report_out: {report}
"""


def calibrated(fraction: float, device: str = "qemu-aarch64") -> int:
    """The planted loop's turns per chunk step that add about `fraction` to chunkwise's instructions."""
    from refimpl import gdn as ref
    from testbed.backends.native.device import NativeJob, run_native
    from testbed.devices import connect, load_profile

    dev = connect(load_profile(device))
    x = ref.draw_inputs(1, 48, 2, 32, kda=False, seed=0)

    def count(tree):
        program = kernel_build.build_programs("aarch64", kernels_dir=tree) / "tb_gdn_bench"
        args = ["{inputs}", ".", "form=chunkwise", "chunk=64", "head_map=tiled", "warmup=0", "reps=1"]
        return run_native(dev, NativeJob(program, dict(zip(("q", "k", "v", "g", "beta", "state"), x.arrays())),
                                         ["out", "state"], args, measured=False)).counts.per_call

    base, probe = count(slowed_chunkwise(0)), count(slowed_chunkwise(1000))
    return int(np.ceil(fraction * base / ((probe - base) / 1000)))


@pytest.fixture(scope="module")
def turns():
    return {f: calibrated(f) for f in (0.05, 0.25)}


def night(tmp_path, store, tree, suite_text: str = SUITE):
    """One night of `suite_text` measuring `tree` (a kernels/ folder copied into the test's own tree
    folder)."""
    own = tmp_path / "tree" / "kernels"
    shutil.rmtree(own, ignore_errors=True)
    shutil.copytree(tree, own)
    suite_dir = tmp_path / "suite"
    suite_dir.mkdir(exist_ok=True)
    (suite_dir / "abnight.yaml").write_text(suite_text.format(
        shape=", ".join(f'"{o}"' for o in SHAPE), tree=tmp_path / "tree", locks=tmp_path / "locks",
        report=tmp_path / "report"))
    suite = nightly.load_suite(["suite=abnight"], suite_dir=suite_dir)
    status, text = nightly.run_night(suite, store, log=Log(open(tmp_path / "night.log", "a")))
    entry = nightly.report.night_log(store.root)[-1]
    return status, text, entry


def chunkwise_flags(entry, device):
    return [f for f in entry["flags"] if f["device"] == device and f["case"].endswith("/chunkwise")]


def test_a_planted_slowdown_is_flagged_on_its_first_night_and_cleared_by_the_revert(tmp_path, results_dir, turns):
    store = ResultsStore(results_dir)
    clean = slowed_chunkwise(0)

    status, text, first = night(tmp_path, store, clean)
    assert status == 0, text
    for fraction in (0.25, 0.05):
        status, text, slow = night(tmp_path, store, slowed_chunkwise(turns[fraction]))
        assert status == 1, text
        for device in ("qemu-aarch64", "host"):
            counted = [f for f in chunkwise_flags(slow, device) if f["kind"] == "instructions"]
            assert len(counted) == 1, (fraction, device, slow["flags"])
            rise = counted[0]["after_level"] / counted[0]["before_level"] - 1
            if device == "qemu-aarch64":  # calibrated on aarch64; x86's loop and kernel differ in size
                assert abs(rise - fraction) < 0.005
            else:
                assert rise >= fraction
        assert not [f for f in slow["flags"] if "/serial" in f["case"]], slow["flags"]
        assert "REGRESSION" in text

        status, text, reverted = night(tmp_path, store, clean)
        assert status == 0, text
        assert reverted["flags"] == []


HOST_SUITE = """
devices: [host]
runs:
  gdn_ab:
    experiment: gdn
    devices: [host]
    ab: true
    overrides: [{shape}]
ab_reps: 8
ab_tree: {tree}
lock_dir: {locks}
lock_wait_s: 60
report_out: {report}
"""
# Wasted loop turns per chunk step that make chunkwise many times slower at SHAPE: every one of the
# 8 pairs is slower whatever the load, so the A/B judge flags it (Holm over 2 calls: p 0.016)
MANY_TIMES_SLOWER = 3_000_000


def host_night(tmp_path, store, tree, commit, monkeypatch):
    """One A/B night on the host measuring `tree`, with the checkout at `commit`."""
    import testbed.results

    monkeypatch.setattr(testbed.results, "git_commit", lambda: commit)
    return night(tmp_path, store, tree, HOST_SUITE)


def test_a_slowdown_is_flagged_once_with_the_commits_around_it(tmp_path, results_dir, monkeypatch):
    """Issue 33: the A/B baseline was the last night that exited 0, so a slowdown that stays was flagged
    every night, and its flags named `kernels:..kernels:`. Now the baseline is the last measured night's
    build: the first slow night is flagged, with the two nights' commits; the next, with the same
    slowdown, is not."""
    from testbed.backends.native.build import KERNELS_DIR

    store = ResultsStore(results_dir)
    slow = slowed_chunkwise(MANY_TIMES_SLOWER)
    status, text, _ = host_night(tmp_path, store, KERNELS_DIR, "a" * 40, monkeypatch)
    assert status == 0, text

    status, text, first_slow = host_night(tmp_path, store, slow, "b" * 40, monkeypatch)
    assert status == 1, text
    (flag,) = [f for f in first_slow["flags"] if f["kind"] == "ab"]
    assert flag["case"].endswith("/chunkwise") and flag["what"] == "ab_ratio_cpu", flag
    assert flag["commit_range"] == "aaaaaaaa..bbbbbbbb" and "(aaaaaaaa..bbbbbbbb)" in flag["line"], flag["line"]

    status, text, second_slow = host_night(tmp_path, store, slow, "c" * 40, monkeypatch)
    assert status == 0, text
    assert second_slow["flags"] == [] and second_slow["ab_baseline"].endswith("(" + "b" * 40 + ")")


def test_the_baseline_is_the_last_night_that_measured_its_kernels():
    """Whatever that night's exit status (a flagged night's build is the next night's A side); a night
    stopped before its A/B jobs ended measured nothing, so the night before stays the baseline."""
    from testbed.backends.native.build import KERNELS_DIR
    from testbed.lab import ab

    def snapshotted(kernels) -> str:
        return ab.snapshot(ab.resolve_tree(str(kernels))).revision.split()[0].removeprefix("kernels:")

    flagged = {"night": "1", "kernels": snapshotted(KERNELS_DIR), "git_commit": "a" * 40, "exit_status": 1,
               "ab_measured": True}
    stopped = {"night": "2", "kernels": snapshotted(slowed_chunkwise(MANY_TIMES_SLOWER)), "git_commit": "b" * 40,
               "exit_status": 143}
    baseline = nightly.baseline_tree([flagged, stopped])
    assert baseline is not None and baseline.spec == f"kernels:{flagged['kernels']}"
    assert baseline.revision == "a" * 40
    assert nightly.baseline_tree([flagged, {**stopped, "ab_measured": True}]).revision == "b" * 40


def test_the_first_night_of_a_build_says_it_has_no_baseline(tmp_path, results_dir, monkeypatch):
    """Before any night measured its kernels, tonight's A/B job measures them against themselves: its
    verdicts say "no baseline: first night of this build", never a "no change" that compared nothing
    (they did), while a night with a baseline keeps the judge's verdict."""
    from testbed import PROJECT_ROOT
    from testbed.devices import connect, load_profile
    from testbed.lab import ab
    from testbed.results import Figure, Record

    def judged(cfg, ctx, module, experiment, trees, opts):
        ratio = Figure.of([1.2] * 6, "ratio")  # as noise may have it: the history would flag it
        ratio.ab = {"a_commit": "a", "b_commit": "b", "p": 0.001, "pairs": 6, "test": "wilcoxon", "verdict": "slower"}
        yield Record(experiment, "ab/H=2,hs=32,T=48,kda=0/chunkwise", "measure", figures={"ab_ratio_cpu": ratio},
                     metrics={"ab": {"verdict": "no change", "verdicts": {"cpu": "no change"}}})

    monkeypatch.setattr(ab, "measure", judged)
    suite_dir = tmp_path / "suite"
    suite_dir.mkdir()
    (suite_dir / "abnight.yaml").write_text(HOST_SUITE.format(
        shape=", ".join(f'"{o}"' for o in SHAPE), tree=PROJECT_ROOT, locks=tmp_path / "locks",
        report=tmp_path / "report"))
    suite = nightly.load_suite(["suite=abnight"], suite_dir=suite_dir)
    job, = suite.jobs["host"]
    host = connect(load_profile("host"))
    from types import SimpleNamespace

    tonight = SimpleNamespace(spec="kernels:tonight", revision="b" * 40)
    last_night = SimpleNamespace(spec="kernels:last-night", revision="a" * 40)
    nightly.execute_job(job, host, suite, (tonight, tonight), lambda msg: None)
    nightly.execute_job(job, host, suite, (last_night, tonight), lambda msg: None)
    first, second = [r for r in ResultsStore(results_dir).records() if r["kind"] == "measure"]
    assert first["metrics"]["ab"]["verdict"] == nightly.NO_BASELINE == "no baseline: first night of this build"
    assert first["figures"]["ab_ratio_cpu"]["ab"]["verdict"] == nightly.NO_BASELINE
    assert second["metrics"]["ab"]["verdict"] == "no change"
    assert second["figures"]["ab_ratio_cpu"]["ab"]["verdict"] == "slower"
    # the night's history flags the second night's slowdown, never the first night's same-build noise
    from testbed.measure import history

    judged = {j.record["run_id"]: j for j in history.ab_judgements([first, second])}
    assert judged[first["run_id"]].verdict == nightly.NO_BASELINE and not judged[first["run_id"]].regression
    assert judged[second["run_id"]].regression
