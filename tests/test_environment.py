"""The suite does not depend on the caller's environment (issue 13, item 25)."""

import os
import subprocess
import sys

from testbed import PROJECT_ROOT


def test_report_tests_pass_with_testbed_results_set(tmp_path):
    """TESTBED_RESULTS wins over a results_dir override: fixtures that wrote through results_dir found
    an empty store and errored at setup whenever a developer had it set."""
    env = {**os.environ, "TESTBED_RESULTS": str(tmp_path / "developers-own-store")}
    p = subprocess.run([sys.executable, "-m", "pytest", "--device=host", "-q", "-p", "no:cacheprovider",
                        "tests/test_report.py", "-k", "tables_from_host_runs or flips_to_fail"],
                       cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:]
    assert not (tmp_path / "developers-own-store").exists()


def test_the_fixtures_the_project_uses_are_inside_the_repository():
    """Issue 24, item 20: fixtures_dir read ../shared/fixtures, a folder outside the repository, so a
    clone anywhere else failed test setup. The configured folder is the repository's own, tracked."""
    from testbed import config
    from testbed.measure import seed

    configured = config.load([]).cfg.fixtures_dir
    folder = seed.fixtures_dir(configured).resolve()
    assert folder.is_relative_to(PROJECT_ROOT.resolve()), folder
    used = ["chunk_prefill_functiongemma.csv", "tail_sweep_m4pro_gemma4_e2b.csv",
            *(f"test-backend-ops/{name}" for name in ("perf_b_CPU.stdout", "test_mode_b_CPU.csv",
                                                      "test_mode_b_CPU.stdout", "test_mode_default.stdout"))]
    assert all((folder / name).is_file() for name in used)
    tracked = subprocess.run(["git", "ls-files", str(folder)], cwd=PROJECT_ROOT, capture_output=True, text=True)
    if tracked.returncode == 0:  # a checkout (an sdist has no git)
        assert {f"{folder.relative_to(PROJECT_ROOT.resolve())}/{name}" for name in used} <= set(tracked.stdout.split())
