"""Conventions a command-line user expects (issue 46, item 5): did-you-mean for a mistyped value as well as a
key, a usage error that names its subcommand's --help, the engines in `testbed run --help`, and `testbed table
-o FILE` written whole or not at all. Each through the real CLI (testbed.cli.main) and a real store."""

from __future__ import annotations

import textwrap

import pytest

from testbed.cli import main

MISTYPED = [  # the command, what its one line must suggest
    (["run", "gdn", "backend=nativ"], "backend='nativ' is not accepted (did you mean 'native'?)"),
    (["run", "gdn", "mode=benc"], "mode='benc' is not accepted (did you mean 'bench'?)"),
    (["run", "chunk_prefill", "backend=engine", "engine=testbed_c"], "(did you mean 'testbed-c'?)"),
    (["run", "gdn", "device=qemu-aarch46"], "unknown device 'qemu-aarch46' (did you mean 'qemu-aarch64'?)"),
    (["sweep", "experiment=gdn", "backend=nativ,native"], "(did you mean 'native'?)"),
]


@pytest.mark.parametrize("argv, suggests", MISTYPED)
def test_a_mistyped_value_gets_the_closest_and_the_subcommands_help(argv, suggests, results_dir, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and suggests in err, err
    assert err.strip().endswith(f"(usage: testbed {argv[0]} --help)"), err
    assert not results_dir.exists()  # nothing stored


def test_an_unknown_option_is_said_with_the_subcommands_own_usage(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["run", "gdn", "--bogus"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: testbed run ") and "testbed run: error: unrecognized arguments: --bogus" in err


def test_run_help_lists_the_engines_the_projects_and_the_labs(tmp_path, monkeypatch, capsys):
    lab = tmp_path / "lab"
    (lab / "engines").mkdir(parents=True)
    (lab / "engines" / "mine.yaml").write_text(textwrap.dedent("""\
        name: mine
        contract: 1
        build: {prebuilt: {host: ../prog}}
        program: prog
        abis: [host]
        supports: {techniques: [chunk_prefill]}
        invoke: ["{program}", "{request}", "{response}"]
        """))
    monkeypatch.setenv("TESTBED_LAB", str(lab))
    with pytest.raises(SystemExit) as stop:
        main(["run", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    engines = next(line for line in out.splitlines() if line.startswith("engine: "))
    assert "testbed-c" in engines and "llamacpp" in engines and "mine (the lab's" in engines
    assert "backend=engine engine=NAME" in out


def test_table_o_writes_the_table_whole_or_not_at_all(tmp_path, results_dir, capsys):
    out = tmp_path / "tail.md"
    assert main(["table", "tail", "--format", "md", "-o", str(out)]) == 1  # nothing stored yet
    assert not out.exists()
    assert main(["run", "tail", "mode=fixture"]) == 0  # the seed's sweep, loaded as records
    capsys.readouterr()
    assert main(["table", "tail", "--format", "md"]) == 0
    printed = capsys.readouterr().out
    out.write_text("an older table\n")
    assert main(["table", "tail", "--format", "md", "-o", str(out)]) == 0
    said = capsys.readouterr()
    assert said.out == "" and out.read_text() == printed and f"written to {out}" in said.err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    assert main(["table", "tail", "-o", str(tmp_path)]) == 2  # a folder: refused before anything is read
    assert "is a folder" in capsys.readouterr().err
