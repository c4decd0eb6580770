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
