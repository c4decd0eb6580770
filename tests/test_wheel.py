"""`pip install testbed` (a wheel, not editable) carries its configuration: experiments, models, suites
and device profiles are package data, and results go where it is run. It carries the kernel sources and
the QEMU plugin's source too, so it builds and runs native programs (issue 24, item 14)."""

import subprocess
import sys
import venv

from testbed import PROJECT_ROOT


def test_an_installed_wheel_runs_an_experiment_from_another_folder(tmp_path):
    wheels, env_dir, elsewhere = tmp_path / "wheels", tmp_path / "venv", tmp_path / "elsewhere"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(PROJECT_ROOT),
                    "-w", str(wheels)], check=True, timeout=600, capture_output=True)
    # the venv borrows this interpreter's dependencies; the testbed it imports is the wheel's
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", *wheels.glob("testbed-*.whl")],
                   check=True, timeout=600, capture_output=True)
    elsewhere.mkdir()
    run = subprocess.run([env_dir / "bin" / "testbed", "run", "gdn", "mode=oracle", "matrix=awkward"], cwd=elsewhere,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "gdn on host (refimpl): oracles 48/48 pass" in run.stdout
    where = subprocess.run([python, "-c", "import testbed; print(testbed.__file__)"], cwd=elsewhere,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(env_dir))
    assert (elsewhere / "results" / "records.jsonl").exists()
    # native code: the programs built from the wheel's own kernel sources, where it is run
    native = subprocess.run([env_dir / "bin" / "testbed", "run", "gdn", "backend=native", "mode=oracle",
                             "matrix=awkward"], cwd=elsewhere, capture_output=True, text=True, timeout=900)
    assert native.returncode == 0, native.stdout + native.stderr
    assert "gdn on host (native): oracles 48/48 pass" in native.stdout
    assert list((elsewhere / ".cache" / "kernels").glob("host-*/tb_gdn_bench"))
    plugin = subprocess.run([python, "-c", "from testbed.measure.counts import PLUGIN_SOURCE; print(PLUGIN_SOURCE.is_file())"],
                            cwd=elsewhere, capture_output=True, text=True, check=True).stdout
    assert plugin.strip() == "True"
