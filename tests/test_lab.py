"""A lab's own devices, experiments and suites (TESTBED_LAB=DIR), and experiments from other packages
(the entry point group testbed.experiments): seen by every command, in other processes too."""

import os
import subprocess
import sys
import textwrap

import pytest

from testbed import PROJECT_ROOT, config


def cli(*args, env, cwd=PROJECT_ROOT):
    return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=cwd, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)


def test_a_lab_folder_adds_devices_and_suites(tmp_path):
    lab = tmp_path / "lab"
    (lab / "devices").mkdir(parents=True)
    (lab / "devices" / "bench9.yaml").write_text(
        f"name: bench9\ntransport: local\nabi: host\ncapabilities: [cpu, refimpl]\nwork_dir: {tmp_path / 'w'}\n")
    (lab / "suite").mkdir()
    (lab / "suite" / "tiny.yaml").write_text(textwrap.dedent("""\
        devices: [bench9]
        runs:
          gdn:
            experiment: gdn
            overrides: [mode=oracle, matrix=awkward]
        lock_dir: ""
        """))
    env = {"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(tmp_path / "results")}
    night = cli("nightly", "suite=tiny", f"lock_dir={tmp_path / 'locks'}", env=env)
    assert night.returncode == 0, night.stdout + night.stderr
    assert "  bench9         ok           1 runs, oracles 48 pass" in night.stdout


def test_a_lab_that_is_not_a_folder_is_one_line(tmp_path):
    r = cli("run", "gdn", env={"TESTBED_LAB": str(tmp_path / "nowhere")})
    assert r.returncode == 2
    assert r.stderr == (f"testbed: error: TESTBED_LAB='{tmp_path / 'nowhere'}' is not a folder; accepted: a folder "
                        "with any of experiment/, model/, devices/, suite/\n")


def test_another_package_adds_an_experiment_through_an_entry_point(tmp_path):
    package = tmp_path / "site" / "labexp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "hello.py").write_text(textwrap.dedent('''\
        """A lab's own experiment: one oracle that always holds."""
        from testbed.config import Int
        from testbed.results import Record

        PARAMS = {"greetings": Int(1, 10)}

        def run(cfg, ctx):
            for i in range(cfg.greetings):
                yield Record("hello", f"greeting {i}", "oracle", "equal", "pass", 0.0)

        def view(frame):
            return frame[["case", "verdict"]]
        '''))
    (package / "hello.yaml").write_text("greetings: 2\n")
    info = tmp_path / "site" / "labexp-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: labexp\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[testbed.experiments]\nhello = labexp.hello\n")
    env = {"PYTHONPATH": str(tmp_path / "site"), "TESTBED_RESULTS": str(tmp_path / "results")}
    r = cli("run", "hello", "greetings=3", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hello on host (refimpl): oracles 3 pass" in r.stdout
    assert "hello" not in config.choices("experiment")  # only where the package is installed


def test_a_broken_entry_point_is_one_line_and_the_rest_still_runs(tmp_path, monkeypatch, capsys, results_dir):
    """A stale or half-installed package declaring an experiment (its package gone, or its module failing to
    import) broke every `testbed run` with a traceback. Now: one line naming the entry point when that
    experiment is used, a warning where experiments are listed, and every other experiment runs."""
    from testbed.cli import main

    site = tmp_path / "site"
    (site / "halfpkg").mkdir(parents=True)
    (site / "halfpkg" / "__init__.py").write_text("")
    (site / "halfpkg" / "crash.py").write_text("import no_such_dependency_of_halfpkg\n")
    (site / "halfpkg" / "crash.yaml").write_text("x: 1\n")
    info = site / "halfpkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: halfpkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[testbed.experiments]\ngone = uninstalled_pkg.gone\ncrash = halfpkg.crash\n")
    monkeypatch.syspath_prepend(str(site))
    for name in ("gone", "crash"):
        assert main(["run", name]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(f"testbed: error: experiment {name!r}: entry point testbed.experiments {name} = "), line
        assert "reinstall or uninstall the package that declares it" in line
    assert main(["run", "gdn", "mode=oracle", "matrix=awkward", "max_tokens=1"]) == 0
    assert "gdn on host (refimpl): oracles 8 pass" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    # the package that is gone is left out of the listing, saying why (the other's module is imported on use only)
    [warned] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("testbed: warning: ")]
    assert warned.startswith("testbed: warning: experiment 'gone' is left out: entry point testbed.experiments gone = "
                             "uninstalled_pkg.gone does not import (ModuleNotFoundError"), warned


def test_a_labs_experiment_config_without_a_module_is_not_listed_and_run_says_what_it_needs(tmp_path, monkeypatch,
                                                                                             capsys, results_dir):
    """`--help` listed a lab's experiment/NAME.yaml that `run` then refused: the two agree now. A YAML
    alone runs nothing; using it says in one line what an experiment needs."""
    from testbed import experiments
    from testbed.cli import main

    (tmp_path / "lab" / "experiment").mkdir(parents=True)
    (tmp_path / "lab" / "experiment" / "gdn_small.yaml").write_text("backend: refimpl\nmode: oracle\n")
    monkeypatch.setenv("TESTBED_LAB", str(tmp_path / "lab"))
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "gdn_small" not in capsys.readouterr().out
    for argv in (["run", "gdn_small"], ["sweep", "experiment=gdn_small", "chunk=16,32"]):
        assert main(argv) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(f"testbed: error: experiment 'gdn_small' ({tmp_path / 'lab' / 'experiment' / 'gdn_small.yaml'}) "
                               "has a config but no module: an experiment is a module that runs it"), line
    assert not results_dir.exists()
    for name in config.choices("experiment"):  # every experiment listed is one `run` can load
        assert experiments.load(name).PARAMS is not None
