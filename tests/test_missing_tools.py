"""A tool testbed needs on this host and does not have (zig after the plain bootstrap, llama.cpp's source
offline, valgrind or a working C compiler for the counts) is said in one line saying how to get it, exit 3,
with nothing stored: never a traceback, never exit 1 (an oracle failed) or 4 (a device operation failed)."""

import sys
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.errors import ToolMissing


@pytest.mark.parametrize("experiment", ["gdn", "llamacpp"])
def test_a_run_that_needs_zig_without_the_cross_extra_is_one_line_exit_3(experiment, monkeypatch, capsys,
                                                                         results_dir):
    monkeypatch.setitem(sys.modules, "ziglang", None)  # `import ziglang` fails, as without the cross extra
    assert main(["run", experiment, "device=qemu-hexagon"]) == 3
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("testbed: missing tool: zig is not installed: pip install 'testbed[cross]'"), line
    assert not results_dir.exists()  # said before a run was stored


def test_llamacpps_source_offline_is_a_missing_tool_saying_how_to_get_it(tmp_path, monkeypatch):
    from testbed.backends.llamacpp.build import SDIST, sdist_source

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no package index reachable: offline
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(ToolMissing) as e:
        sdist_source(cache=tmp_path, progress=lambda msg: None)
    said = str(e.value)
    assert "\n" not in said and f"could not download {SDIST[0]}=={SDIST[1]} (offline?)" in said
    assert f"pip download --no-deps --no-binary :all: -d {tmp_path / 'sdist'}" in said and "llamacpp.source=DIR" in said


def test_counting_tools_missing_or_failing_say_what_failed(tmp_path, monkeypatch):
    from testbed.measure import counts

    monkeypatch.setenv("HOST_CC", "false")  # a compiler that fails saying nothing
    with pytest.raises(ToolMissing) as e:
        counts.plugin_path()
    assert "building the counting plugin failed: `false -shared -fPIC" in str(e.value)
    assert " exited 1: no output; counts need a working C compiler" in str(e.value)
    monkeypatch.setenv("HOST_CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(ToolMissing, match=r"^no C compiler '.*no-such-cc' to build the instruction-counting plugin"):
        counts.plugin_path()
    monkeypatch.setenv("PATH", str(tmp_path))  # no valgrind on it
    with pytest.raises(ToolMissing, match=r"^valgrind is not installed \(Debian: apt-get install valgrind\)"):
        counts.valgrind_argv(["true"])
    assert ToolMissing.exit_status == 3


def test_a_device_session_without_the_cross_extra_skips_naming_it(tmp_path):
    """`pytest --device=qemu-hexagon -m device` after the plain bootstrap (no zig): the tests that need zig
    ended in errors; they are skips naming the tool and how to get it."""
    import os
    import subprocess

    from testbed import PROJECT_ROOT

    shadow = tmp_path / "site" / "ziglang"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed: the plain bootstrap has no cross extra')\n")
    paths = [str(shadow.parent), str(PROJECT_ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    p = subprocess.run([sys.executable, "-m", "pytest", "--device=qemu-hexagon", "-m", "device", "-p", "no:cacheprovider",
                        "tests/device/test_gdn_on_device.py::test_gdn_oracle_matrix_passes_on_the_device"],
                       cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "1 skipped" in p.stdout, p.stdout[-2000:]
    assert "this host lacks a tool for device 'qemu-hexagon': zig is not installed: pip install 'testbed[cross]'" \
        in p.stdout


def test_host_counts_without_valgrind_are_refused_before_a_run_is_stored(tmp_path, monkeypatch, capsys, results_dir):
    """counts=true on the host runs the programs once more under valgrind: without it the run broke midway,
    exit 4 ("device error"); now one line before anything is stored, exit 3."""
    import shutil

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "cc").symlink_to(shutil.which("cc"))  # the compiler is here; valgrind is not
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert main(["run", "gdn", "backend=native", "counts=true", "mode=bench"]) == 3
    [line] = capsys.readouterr().err.splitlines()
    assert line == ("testbed: missing tool: valgrind is not installed (Debian: apt-get install valgrind); host "
                    "instruction counts need it")
    assert not results_dir.exists()
