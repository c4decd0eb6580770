"""A device profile's `sizes` (the sizes a run takes on that device unless the command line names its
own: an emulated device's smaller matrix and shapes) and progress lines when stderr is not a terminal."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from testbed import PROJECT_ROOT, config, runner
from testbed.devices.profile import load_profile
from testbed.errors import UsageError

LAB_DEVICE = textwrap.dedent("""\
    name: small9
    transport: local
    abi: host
    capabilities: [cpu, refimpl]
    work_dir: ""
    sizes:
      gdn:
        matrix: awkward
        bench: {tokens: [64], reps: 2}
    """)


@pytest.fixture
def lab(tmp_path, monkeypatch):
    (tmp_path / "devices").mkdir()
    (tmp_path / "devices" / "small9.yaml").write_text(LAB_DEVICE)
    monkeypatch.setenv("TESTBED_LAB", str(tmp_path))
    return tmp_path


def test_a_profiles_sizes_apply_on_that_device_only(lab):
    on_device = config.load(["device=small9"], experiment="gdn").cfg
    assert (on_device.matrix, list(on_device.bench.tokens), on_device.bench.reps) == ("awkward", [64], 2)
    assert on_device.bench.heads == 16  # a key the profile does not name keeps the experiment's value
    on_host = config.load(["device=host"], experiment="gdn").cfg
    assert (on_host.matrix, list(on_host.bench.tokens), on_host.bench.reps) == ("all", [64, 512, 2048], 5)
    # another experiment on the same device: the profile names no sizes for it
    assert config.load(["device=small9"], experiment="tail").cfg.reps == 5


def test_the_command_line_wins_over_a_profiles_sizes(lab):
    cfg = config.load(["device=small9", "matrix=all", "bench.tokens=[128,256]"], experiment="gdn").cfg
    assert (cfg.matrix, list(cfg.bench.tokens), cfg.bench.reps) == ("all", [128, 256], 2)
    # a whole mapping named on the command line keeps every key of it the user's
    cfg = config.load(["device=small9", "bench={heads: 2, head_size: 8, tokens: [9], kda: false, warmup: 0, reps: 1}"],
                      experiment="gdn").cfg
    assert (list(cfg.bench.tokens), cfg.bench.reps, cfg.matrix) == ([9], 1, "awkward")


def test_an_unknown_key_in_a_profiles_sizes_is_one_line(lab):
    (lab / "devices" / "small9.yaml").write_text(LAB_DEVICE.replace("matrix: awkward", "matrx: awkward"))
    with pytest.raises(UsageError) as e:
        config.load(["device=small9"], experiment="gdn")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("devices/small9.yaml: sizes.gdn.matrx is not a key of experiment gdn; accepted keys: ")
    assert "matrix" in message and "bench.*" in message


def test_sizes_for_an_experiment_that_does_not_exist_are_refused(lab):
    (lab / "devices" / "small9.yaml").write_text(LAB_DEVICE.replace("  gdn:", "  gdm:"))
    with pytest.raises(UsageError, match=r"devices/small9.yaml: field 'sizes.gdm' names no experiment; accepted: "
                                         r"chunk_prefill, .*gdn"):
        load_profile("small9")


@pytest.mark.parametrize("name", sorted(p.stem for p in (PROJECT_ROOT / "devices").glob("*.yaml")))
def test_every_shipped_profiles_sizes_compose_and_pass_the_experiments_checks(name):
    profile = load_profile(name)
    if profile.has("emulated") and "native" in profile.capabilities:
        assert {"gdn", "native_bench", "chunk_prefill", "tail"} <= set(profile.sizes), name
    for experiment in profile.sizes:
        rc = config.load([f"device={name}"], experiment=experiment)
        runner.check(rc)


def test_progress_lines_with_the_time_left_when_stderr_is_a_pipe(lab, tmp_path):
    """`testbed run` in a log (stderr a pipe, not a terminal) says what it is doing, one line per case,
    with how many are done and an estimate of the time left; the stored records say which sizes ran."""
    env = {**os.environ, "TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(tmp_path / "results"),
           "PYTHONPATH": str(PROJECT_ROOT)}
    r = subprocess.run([sys.executable, "-m", "testbed", "run", "gdn", "device=small9", "mode=oracle"], cwd=PROJECT_ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    cases = [line for line in lines if re.fullmatch(r"\[\d+ s\] gdn oracle \d+/12 H=.*", line)]
    assert len(cases) == 12, lines  # matrix=awkward, from the profile: 12 cases, each announced
    # no estimate before the work done supports one: two cases of T=1 say nothing of what T=15 costs;
    # once cases of two sizes are done, each line says about how long the rest takes
    assert " gdn oracle 1/12 " in cases[0] and not any(line.endswith(" left)") for line in cases[:3]), cases
    assert all(re.search(r" \(about \d+ (s|min) left\)$", line) for line in cases[3:]), cases
    stored = [json.loads(line) for f in (tmp_path / "results").rglob("*.jsonl") for line in f.read_text().splitlines()]
    configs = {row["config"]["matrix"] for row in stored if row.get("kind") == "oracle"}
    assert configs == {"awkward"}


def test_max_tokens_keeps_the_matrixs_cases_up_to_that_length():
    from testbed.experiments import gdn

    short = gdn.selected_cases(config.load(["matrix=awkward", "max_tokens=65"], experiment="gdn").cfg)
    assert sorted({c.n_seq_tokens for c in short}) == [1, 15, 63, 65] and len(short) == 8
    assert gdn.selected_cases(config.load(["matrix=awkward"], experiment="gdn").cfg) == gdn.AWKWARD_CASES



@pytest.mark.parametrize("sizes, said", [
    # a profile moving where every run on the device stores its records (or reads its fixtures)
    ("results_dir: {moved}", "sizes.gdn.results_dir is not a size"),
    ("fixtures_dir: {moved}", "sizes.gdn.fixtures_dir is not a size"),
    ("bench: {{heads: '${{no_such_key}}'}}", "sizes.gdn.bench.heads: Interpolation key 'no_such_key' not found"),
    ("[1, 2]", "sizes.gdn is not a mapping"),
])
def test_a_profiles_sizes_set_only_the_experiments_own_keys(lab, tmp_path, monkeypatch, capsys, sizes, said):
    """Each refused in one line naming the profile's file and key, exit 2, before anything is stored, by
    `run` (and `--cfg job`); `devices --no-check` lists the profile as invalid instead of a traceback."""
    from testbed.cli import main

    monkeypatch.setenv("TESTBED_RESULTS", str(tmp_path / "results"))
    moved = tmp_path / "moved"
    body = sizes.format(moved=moved)
    text = LAB_DEVICE.split("  gdn:")[0] + ("  gdn: " + body if body.startswith("[") else "  gdn:\n    " + body) + "\n"
    (lab / "devices" / "small9.yaml").write_text(text)
    for argv in (["run", "gdn", "device=small9", "mode=oracle", "matrix=awkward"],
                 ["run", "gdn", "device=small9", "--cfg", "job", "--resolve"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        [line] = err.splitlines()
        assert out == "" and line.startswith(f"testbed: error: devices/small9.yaml: {said}"), line
    assert not moved.exists() and not (tmp_path / "results").exists()
    assert main(["devices", "--no-check"]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| small9 ")]
    assert "invalid: devices/small9.yaml: field 'sizes.gdn" in row


def test_a_bad_value_from_a_profiles_sizes_names_the_profiles_key(lab):
    """The experiment's check said `bench.heads=None is not an integer`, as if the command line had said so."""
    (lab / "devices" / "small9.yaml").write_text(LAB_DEVICE.replace("reps: 2}", "reps: 2, heads: null}"))
    with pytest.raises(UsageError) as e:
        runner.check(config.load(["device=small9"], experiment="gdn"))
    assert str(e.value).startswith("devices/small9.yaml: sizes.gdn.bench.heads: bench.heads=None is not an integer")
    # the same value from the command line is the command line's
    with pytest.raises(UsageError, match=r"^bench.heads=None is not an integer"):
        runner.check(config.load(["device=small9", "bench.heads=null"], experiment="gdn"))
