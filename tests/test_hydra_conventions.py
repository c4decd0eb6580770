"""Hydra's conventions on `testbed run` and `testbed sweep` (issue 26): --cfg job, --help listing the config
groups and an experiment's keys, -m as the sweep, hydra.* overrides refused, "did you mean" for typos."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from omegaconf import OmegaConf

from testbed import PROJECT_ROOT, config
from testbed.lab import nightly
from testbed.cli import main
from testbed.results import ResultsStore


def command(*argv, results):
    """The real command in its own process, its store at `results`."""
    env = {**os.environ, "TESTBED_RESULTS": str(results), "PYTHONPATH": str(PROJECT_ROOT)}
    return subprocess.run([sys.executable, "-m", "testbed", *argv], env=env, cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cfg_job_prints_the_composed_config_and_runs_nothing(tmp_path):
    results = tmp_path / "results"
    # an override after the option is one more override, as Hydra takes it
    done = command("run", "gdn", "bench.reps=2", "--cfg", "job", "chunk=32", results=results)
    assert done.returncode == 0, done.stderr
    composed = yaml.safe_load(done.stdout)
    assert composed["chunk"] == 32 and composed["bench"]["reps"] == 2 and composed["device"]["name"] == "host"
    assert composed["backend"].startswith("${default_backend:")  # as Hydra prints it: unresolved
    assert not results.exists()

    resolved = command("run", "gdn", "--cfg", "job", "--resolve", "-p", "bench", results=results)
    assert resolved.returncode == 0, resolved.stderr
    assert resolved.stdout.startswith("# @package bench\n")
    assert yaml.safe_load(resolved.stdout) == OmegaConf.to_container(
        OmegaConf.load(PROJECT_ROOT / "experiments/experiment/gdn.yaml").bench)
    assert not results.exists()


def test_sweep_and_multirun_cfg_job_print_each_job(results_dir, capsys):
    assert main(["sweep", "experiment=gdn", "chunk=16,32", "mode=oracle", "--cfg", "job"]) == 0
    swept = capsys.readouterr().out
    jobs = list(yaml.safe_load_all(swept))
    assert [(j["chunk"], j["mode"]) for j in jobs] == [(16, "oracle"), (32, "oracle")]
    assert main(["run", "gdn", "-m", "chunk=16,32", "mode=oracle", "--cfg", "job"]) == 0
    assert capsys.readouterr().out == swept
    assert not results_dir.exists()


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_lists_each_group_with_its_options_and_default(results_dir, capsys):
    text = _help(["run", "--help"], capsys)
    assert "usage: testbed run" in text and "--cfg" in text and "--multirun" in text
    primary = OmegaConf.load(PROJECT_ROOT / "experiments/config.yaml")
    defaults = {k: v for d in primary.defaults if not isinstance(d, str) for k, v in d.items()}
    # the default experiment's groups: the primary config's, and the model its experiment file names
    for group in ("experiment", "device", "model"):
        line = next(x for x in text.splitlines() if x.startswith(f"{group}: "))
        assert line.startswith(f"{group}: {', '.join(config.choices(group))} (default: ")
        if group in defaults:
            assert line.endswith(f"(default: {defaults[group]})")
    assert "model: functiongemma, tiny (default: tiny)" in text
    assert "== Config of" not in text  # no experiment named: no keys
    assert not results_dir.exists()


def test_help_of_a_named_experiment_lists_its_keys_and_its_own_groups(results_dir, capsys):
    text = _help(["run", "gdn", "--help"], capsys)
    lines = text.splitlines()
    assert any(x.startswith("experiment: ") and x.endswith("(chosen: gdn)") for x in lines)
    assert any(x.startswith("device: ") and x.endswith("(default: host)") for x in lines)
    assert not any(x.startswith("model: ") for x in lines)  # gdn composes no model: model=... is refused
    own = OmegaConf.load(PROJECT_ROOT / "experiments/experiment/gdn.yaml")
    for key in ("chunk", "mode", "matrix", "threshold", "bench.heads", "bench.reps"):
        assert f"{key}={OmegaConf.select(own, key)}" in lines
    assert "bench.tokens=[64,512,2048]" in lines and "backend=refimpl" in lines  # resolved for the host
    assert not any(x.startswith("device.") for x in lines)
    # the sweep names its experiment as an override
    assert "chunk=64" in _help(["sweep", "experiment=gdn", "--help"], capsys).splitlines()
    assert not results_dir.exists()


def _jobs_and_records(results):
    records = ResultsStore(results).records("transport")
    # results_dir says where the records went: each side's own store
    return sorted((json.dumps({k: v for k, v in r["config"].items() if k != "results_dir"}, sort_keys=True), r["case"],
                   r["kind"]) for r in records)


def test_multirun_is_the_sweep(tmp_path):
    """`run transport -m ...` and `sweep experiment=transport ...`: the same jobs, the same records."""
    small = ["size_mb=1", "reps=1,2"]
    multirun = command("run", "transport", "-m", *small, results=tmp_path / "multirun")
    sweep = command("sweep", "experiment=transport", *small, results=tmp_path / "sweep")
    assert multirun.returncode == sweep.returncode == 0, multirun.stderr + sweep.stderr

    def jobs(out):  # the table's job columns, and the closing line
        rows = [line.split("|")[1:4] for line in out.splitlines() if line.startswith("| transport")]
        return sorted(rows), out.strip().splitlines()[-1].split(";")[0]

    assert jobs(multirun.stdout) == jobs(sweep.stdout)
    assert sorted(jobs(multirun.stdout)[0]) == [[" transport  ", " 1       ", " 1    "],
                                                [" transport  ", " 1       ", " 2    "]]
    assert _jobs_and_records(tmp_path / "multirun") == _jobs_and_records(tmp_path / "sweep") != []
    assert len({r["run_id"] for r in ResultsStore(tmp_path / "multirun").records("transport")}) == 2


@pytest.mark.parametrize("argv, says", [
    (["run", "gdn", "hydra.run.dir={elsewhere}"], "TESTBED_RESULTS=DIR"),
    (["sweep", "experiment=gdn", "chunk=16,32", "hydra.sweep.dir={elsewhere}"], "TESTBED_RESULTS=DIR"),
    (["run", "gdn", "-m", "chunk=16,32", "hydra.sweep.subdir=x"], "TESTBED_RESULTS=DIR"),
    (["run", "gdn", "hydra.job.chdir=true"], "TESTBED_RESULTS=DIR"),
    (["run", "gdn", "hydra.searchpath=[file:///tmp]"], "TESTBED_LAB=DIR"),
    (["run", "gdn", "hydra/launcher=joblib"], "farm=HEAD:PORT"),
    (["run", "gdn", "hydra.verbose=true"], "testbed reads no hydra.* setting"),
    (["run", "gdn", "--cfg", "job", "hydra.run.dir={elsewhere}"], "TESTBED_RESULTS=DIR"),
])
def test_hydra_settings_are_refused_in_one_line(argv, says, results_dir, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    argv = [a.format(elsewhere=elsewhere) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    bad = next(a for a in argv if a.startswith("hydra"))
    assert err.startswith(f"testbed: error: {bad!r} is not supported") and says in err and "\n" not in err
    assert captured.out == "" and not results_dir.exists() and not elsewhere.exists()


@pytest.mark.parametrize("argv, suggested", [
    (["run", "gdm"], "unknown experiment 'gdm' (did you mean 'gdn'?); accepted: "),
    (["run", "gdm", "--help"], "unknown experiment 'gdm' (did you mean 'gdn'?)"),
    (["sweep", "experiment=gdn,hybird", "chunk=16"], "unknown experiment 'hybird' (did you mean 'hybrid'?)"),
    (["run", "gdn", "device=pixle"], "unknown device 'pixle' (did you mean 'pixel'?); accepted: "),
    (["run", "chunk_prefill", "model=tinyy"], "unknown model 'tinyy' (did you mean 'tiny'?)"),
    (["run", "gdn", "chunck=32"], "unknown key 'chunck' (did you mean 'chunk'?); accepted keys: "),
    (["run", "gdn", "bench.rep=2"], "unknown key 'bench.rep' (did you mean 'bench.reps'?)"),
    (["run", "gdn", "+bench.rep=2"], "unknown key 'bench.rep' (did you mean 'bench.reps'?)"),
    (["run", "gdn", "benh.reps=2"], "unknown key 'benh.reps' (did you mean 'bench.reps'?)"),
])
def test_a_typo_gets_the_closest_name(argv, suggested, results_dir, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("testbed: error: ") and suggested in err and "\n" not in err
    assert not results_dir.exists()


@pytest.mark.parametrize("argv, refused", [
    (["run", "nosuch"], "unknown experiment 'nosuch'; accepted: "),
    (["run", "gdn", "device=zzzz"], "unknown device 'zzzz'; accepted: "),
    (["run", "gdn", "qqqqq=1"], "unknown key 'qqqqq'; accepted keys: "),
    # sharing `model.` with every model key is no likeness
    (["run", "chunk_prefill", "+model.foo=1"], "unknown key 'model.foo' ('+model.foo=1' adds a key"),
])
def test_a_far_off_name_gets_no_suggestion(argv, refused, results_dir, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert refused in err and "did you mean" not in err


def test_a_suite_with_a_mistyped_device_gets_the_closest_name(tmp_path):
    (tmp_path / "typo.yaml").write_text("devices: [hots]\nruns:\n  gdn: {experiment: gdn}\n")
    with pytest.raises(config.UsageError, match=r"unknown device 'hots' \(did you mean 'host'\?\); accepted: "):
        nightly.load_suite(["suite=typo"], suite_dir=tmp_path)


def test_an_unknown_option_is_still_refused(results_dir, capsys):
    with pytest.raises(SystemExit) as done:
        main(["run", "gdn", "--frob"])
    assert done.value.code == 2 and "unrecognized arguments: --frob" in capsys.readouterr().err
    assert not results_dir.exists()


def test_cfg_job_says_where_records_really_go(results_dir, tmp_path, capsys):
    """TESTBED_RESULTS (here the test's store) wins over results_dir: `--cfg job --resolve` printed
    `results_dir: results` while the records went to the store the environment named."""
    from testbed import runner

    for argv in (["run", "gdn", "--cfg", "job", "--resolve"], ["run", "gdn", "--cfg", "job", "results_dir=elsewhere"]):
        assert main(argv) == 0
        printed = yaml.safe_load(capsys.readouterr().out)["results_dir"]
        assert printed == str(results_dir), argv
    assert main(["run", "gdn", "mode=oracle", "matrix=awkward", "max_tokens=1"]) == 0
    capsys.readouterr()
    assert [p.name for p in results_dir.iterdir()] and not (PROJECT_ROOT / "elsewhere").exists()
    assert ResultsStore(results_dir).records("gdn")
