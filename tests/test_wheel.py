"""`pip install testbed` (a wheel, not editable) carries its configuration: experiments, models, suites
and device profiles are package data, and results go where it is run. It carries the kernel sources and
the QEMU plugin's source too, so it builds and runs native programs (issue 24, item 14)."""

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from testbed import PROJECT_ROOT


def borrow_dependencies(python):
    """The new venv imports this interpreter's dependencies (after its own site-packages, so the testbed
    it imports is the wheel's). Its site-packages folders, wherever they are: system_site_packages
    would give the base interpreter's, which inside a virtualenv lacks what the virtualenv installed.
    As plain paths, whose .pth files are not run: no editable testbed comes along."""
    own = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                         text=True, check=True).stdout.strip()
    ours = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    (Path(own) / "testbed-test-borrowed.pth").write_text("".join(f"{p}\n" for p in ours))


def wheel_environment():
    """This environment without what would hide the wheel: the checkout on PYTHONPATH (the network
    guard's folder stays), TESTBED_RESULTS (records go where the wheel is run)."""
    checkout = PROJECT_ROOT.resolve()
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != checkout]
    env = {k: v for k, v in os.environ.items() if k != "TESTBED_RESULTS"}
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def test_an_installed_wheel_runs_an_experiment_from_another_folder(tmp_path):
    wheels, env_dir, elsewhere = tmp_path / "wheels", tmp_path / "venv", tmp_path / "elsewhere"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(PROJECT_ROOT),
                    "-w", str(wheels)], check=True, timeout=600, capture_output=True)
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    borrow_dependencies(python)
    # --ignore-installed: the borrowed folders hold a testbed too (an editable one), which must not count
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed",
                    *wheels.glob("testbed-*.whl")], check=True, timeout=600, capture_output=True)
    elsewhere.mkdir()
    env = wheel_environment()
    run = subprocess.run([env_dir / "bin" / "testbed", "run", "gdn", "mode=oracle", "matrix=awkward"], cwd=elsewhere,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "gdn on host (refimpl): oracles 48 pass" in run.stdout
    where = subprocess.run([python, "-c", "import testbed; print(testbed.__file__)"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(env_dir))
    assert (elsewhere / "results" / "records.jsonl").exists()
    # native code: the programs built from the wheel's own kernel sources, where it is run
    native = subprocess.run([env_dir / "bin" / "testbed", "run", "gdn", "backend=native", "mode=oracle",
                             "matrix=awkward"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900)
    assert native.returncode == 0, native.stdout + native.stderr
    assert "gdn on host (native): oracles 48 pass" in native.stdout
    assert list((elsewhere / ".cache" / "kernels").glob("host-*/tb_gdn_bench"))
    plugin = subprocess.run([python, "-c", "from testbed.measure.counts import PLUGIN_SOURCE; "
                                           "print(PLUGIN_SOURCE.is_file())"],
                            cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout
    assert plugin.strip() == "True"


@pytest.mark.quick
def test_setup_py_loads_the_build_rules_without_the_package(tmp_path):
    """setup.py loads testbed/backends/native/build.py by path while pip builds the package (build isolation:
    neither testbed nor its dependencies importable); an import of the package at its top stops `pip install`
    before anything is built. Run as pip's isolated build runs it: no site-packages, no PYTHONPATH."""
    build_py = PROJECT_ROOT / "testbed" / "backends" / "native" / "build.py"
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('kernel_build', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(len(m.library_extension_args()))")
    p = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(build_py)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and int(p.stdout) >= 1, p.stderr
