"""The testbed command end to end: run, sweep, table, ingest, and every kind of bad input."""

import json
import os
import subprocess
import sys

import pytest

from testbed.cli import main
from testbed.results import ResultsStore
from tests.cli_support import table_rows

SMALL = ["matrix=awkward", "bench.tokens=[64]", "bench.heads=4", "bench.head_size=32", "bench.reps=2"]


def test_run_gdn_stores_records_and_prints_a_summary(results_dir, capsys):
    assert main(["run", "gdn", *SMALL]) == 0
    out = capsys.readouterr().out
    # the two forms' measurements and the run's machine probe (numpy's sgemm, stored once)
    assert "oracles 48 pass, 3 measurements" in out
    records = ResultsStore(results_dir).records("gdn")
    assert len(records) == 51
    measure = next(r for r in records if r["kind"] == "measure" and r["params"].get("role") != "machine_probe")
    time = measure["figures"]["time"]
    assert set(time) == {"median", "min", "max", "reps", "unit", "samples"}
    assert len(time["samples"]) == time["reps"] and min(time["samples"]) == time["min"]  # every repetition kept
    assert measure["work"]["flops"] > 0 and measure["fingerprint"]["cores"] >= 1
    assert measure["config"]["bench.tokens"] == [64]


def test_sweep_runs_the_product_and_prints_one_table(results_dir, capsys):
    assert main(["sweep", "experiment=gdn", "chunk=16,32", "mode=oracle,bench", *SMALL]) == 0
    out = capsys.readouterr().out
    # a row per job; its settings common to every job said once above the table where it would not fit
    assert len(table_rows(out)) == 4, out
    assert {r["config"]["chunk"] for r in ResultsStore(results_dir).records()} == {16, 32}


def test_table_formats_read_only_stored_records(results_dir, capsys):
    assert main(["table", "gdn"]) == 1  # nothing stored yet
    assert "no records for gdn" in capsys.readouterr().err
    main(["run", "gdn", "mode=oracle", "matrix=awkward"])
    capsys.readouterr()
    assert main(["table", "gdn", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 48 and {r["verdict"] for r in rows} == {"pass"}
    assert main(["table", "gdn", "--format", "csv"]) == 0
    assert capsys.readouterr().out.startswith("device,backend,chunk,case")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "nosuch"], "unknown experiment 'nosuch'; accepted: "),
        (["run", "gdn", "device=nosuch"], "unknown device 'nosuch'; accepted: "),
        (["run", "gdn", "foo=1"], "unknown key 'foo'; accepted keys: "),
        (["run", "gdn", "chunk=0"], "chunk=0 is out of range; accepted: integers from 1"),
        (["run", "gdn", "chunk=-3"], "chunk=-3 is out of range"),
        (["run", "gdn", "chunk=big"], "chunk='big' is not an integer"),
        (["run", "gdn", "mode=fast"], "mode='fast' is not accepted; accepted: oracle, bench, all"),
        (["run", "gdn", "bench.tokens=[64,0]"], "bench.tokens=0 is out of range"),
        (["run", "gdn", "chunk=32,64"], "is a sweep; use `testbed sweep`"),
        (["sweep", "experiment=gdn", "chunk=32,0"], "chunk=0 is out of range"),
        (["table", "nosuch"], "unknown experiment 'nosuch'"),
        (["run", "gdn", "threshold=nan"], "threshold=nan is not a finite number; accepted: numbers from 0.0 to 1.0"),
        (["run", "gdn", "threshold=inf"], "threshold=inf is not a finite number"),
        (["run", "gdn", "=5"], "override '=5' names no key; accepted: key=value"),
        (["sweep", "experiment=gdn", "chunk=glob(*)"], "glob() sweeps over config groups are not supported"),
        (["sweep", "experiment=gdn", "chunk=range(1,100000)"], "is 99999 runs; accepted: at most 500"),
        (["sweep", "experiment=gdn", "chunk=range(1,30)", "tail=range(0,30)"], "is 870 runs; accepted: at most 500"),
        (["sweep", "experiment=gdn", "chunk=range(5,1)"], "is a sweep of no values"),
        # Hydra's `+key` skips the unknown-key check: a key nothing reads is refused all the same
        (["run", "hybrid", "+model.foo=1"], "unknown key 'model.foo' ('+model.foo=1' adds a key no part of hybrid"),
        (["run", "chunk_prefill", "+model.foo=1"], "unknown key 'model.foo'"),
        (["run", "gdn", "++foo=1"], "unknown key 'foo'"),
        (["run", "hybrid", "+model.overrides.window=64"], "unknown key 'model.overrides.window'"),
        (["run", "gdn", "+device.foo=1"], "field 'foo' 1 is not a profile field"),
        (["sweep", "experiment=hybrid", "+model.foo=1,2"], "unknown key 'model.foo'"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(argv, message, results_dir, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("testbed: error: ") and message in err and "\n" not in err
    assert not results_dir.exists()


@pytest.mark.parametrize("name", ["test_mode_b_CPU.stdout", "test_mode_b_CPU.csv"])
def test_ingest_stores_a_phone_run_of_test_backend_ops(name, results_dir, seed_fixtures, capsys):
    path = seed_fixtures / "test-backend-ops" / name
    assert main(["ingest", str(path), "--backend", "ggml-cpu"]) == 0
    assert "GATED_DELTA_NET/CPU/tally: 36/36 OK (pass)" in capsys.readouterr().out
    stored = ResultsStore(results_dir).records("gdn")
    assert len(stored) == 37 and all(r["backend"] == "ggml-cpu" for r in stored)


def test_ingest_of_a_failing_csv_row_fails(results_dir, seed_fixtures, tmp_path, capsys):
    lines = (seed_fixtures / "test-backend-ops" / "test_mode_b_CPU.csv").read_text().splitlines()
    lines[5] = lines[5].replace(',"1","",""', ',"1","NMSE = 0.0123 > 1e-07",""')
    (tmp_path / "bad.csv").write_text("\n".join(lines) + "\n")
    assert main(["ingest", str(tmp_path / "bad.csv")]) == 1
    assert "35/36 OK (fail)" in capsys.readouterr().out


def test_ingest_of_perf_output_stores_measurements(results_dir, seed_fixtures):
    assert main(["ingest", str(seed_fixtures / "test-backend-ops" / "perf_b_CPU.stdout")]) == 0
    stored = ResultsStore(results_dir).records("gdn")
    assert len(stored) == 12 and {r["kind"] for r in stored} == {"measure"}
    assert stored[0]["figures"]["time"]["median"] == pytest.approx(165.48)


def test_ingest_of_a_skipped_backend_is_refused(results_dir, seed_fixtures, capsys):
    assert main(["ingest", str(seed_fixtures / "test-backend-ops" / "test_mode_default.stdout")]) == 2
    assert "no test-backend-ops case line with a verdict" in capsys.readouterr().err
    assert not results_dir.exists()


def test_pytest_with_an_unknown_device_is_a_usage_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pytest", "--device=nosuch", "-q", "--co"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 4  # pytest's usage-error status
    assert "--device='nosuch' is not a device profile; accepted: " in p.stderr and "host" in p.stderr


def test_a_figure_taken_on_a_loaded_host_says_so(results_dir, capsys, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * (os.cpu_count() or 1), 0.0, 0.0))
    assert main(["run", "native_bench", "attention.past=40", "attention.chunk=8", "attention.head_dim=32",
                 "cache.window=32", "cache.real=5", "bench.reps=1", "bench.warmup=0", "ratios.reps=0"]) == 0
    assert "WARNING: this host was loaded while measuring" in capsys.readouterr().out
    rows = ResultsStore(results_dir).records()
    assert rows and all(r["host_load"]["noisy"] for r in rows)

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert main(["run", "native_bench", "attention.past=40", "attention.chunk=8", "attention.head_dim=32",
                 "cache.window=32", "cache.real=5", "bench.reps=1", "bench.warmup=0", "ratios.reps=0"]) == 0
    assert "WARNING" not in capsys.readouterr().out


def test_table_as_jsonl_keeps_numbers_and_a_closed_pipe_is_quiet(results_dir):
    assert main(["run", "gdn", "mode=oracle", "matrix=awkward"]) == 0
    env = {**os.environ, "TESTBED_RESULTS": str(results_dir)}
    full = subprocess.run([sys.executable, "-m", "testbed", "table", "gdn", "--format", "jsonl"], env=env,
                          capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in full.stdout.splitlines()]
    assert len(rows) > 10 and all(r["verdict"] == "pass" for r in rows)
    assert all(isinstance(r["nmse"], float) for r in rows if r["oracle"] == "nmse")
    # `| head -1`: the reader closes the pipe after one line; testbed exits 0 without a traceback
    piped = subprocess.run(f"{sys.executable} -m testbed table gdn --format jsonl | head -1", shell=True, env=env,
                           capture_output=True, text=True)
    assert piped.returncode == 0 and piped.stdout.count("\n") == 1 and "Traceback" not in piped.stderr


def test_whole_numbers_print_as_integers_in_every_table_format():
    """Issue 24, item 26: a column of integers with a missing value is float in pandas, and tables
    printed `chunk 64.0`, `token 468.0`."""
    import json

    import pandas as pd

    from testbed.report import tables

    df = pd.json_normalize([{"chunk": 64, "metrics": {"token": 468}, "ms": 1.5},
                            {"chunk": None, "metrics": {"token": 12}, "ms": 2.25}], sep=".")
    md = tables.render(df, "md")
    assert "64.0" not in md and "468.0" not in md and "| 64 " in md and "| 468 " in md and "1.5" in md
    csv = tables.render(df, "csv")
    assert csv.splitlines() == ["chunk,ms,metrics.token", "64,1.5,468", ",2.25,12"]
    rows = json.loads(tables.render(df, "json"))["rows"]
    assert rows[0]["chunk"] == 64 and isinstance(rows[0]["chunk"], int) and rows[1]["chunk"] is None
    assert rows[0]["metrics.token"] == 468 and rows[1]["ms"] == 2.25


def test_version_and_the_device_option_say_what_they_are(capsys):
    """Issue 24, item 26: `testbed --version`, and `pytest --help` naming the device profiles."""
    import subprocess
    import sys

    import pytest

    from testbed import PROJECT_ROOT, __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"testbed {__version__}"
    helped = subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"], cwd=PROJECT_ROOT,
                            capture_output=True, text=True, timeout=120).stdout
    said = "".join(helped[helped.index("--device=DEVICE"):helped.index("--network-guard")].split())
    assert "oneofadb-loopback," in said and "qemu-arm32" in said and ",host," in said


def test_a_wide_table_fits_the_terminal_and_says_what_it_left_out():
    """Issue 46: terminal lines of 270-501 characters, margins with 16 digits. A table for the terminal
    fits 120 columns: what every row shares said once above it, long text cut only where that makes it
    fit, then the first columns that fit, the rest named with the command that prints them all; every
    number by one rule."""
    import pandas as pd

    from testbed.report import tables

    assert [tables.number(v) for v in (0.8660254037844386, 4280474.0, 3.1e-07, 123.456, -2.0)] == \
        ["0.866", "4280474", "3.1e-07", "123.5", "-2"]
    df = pd.DataFrame({"experiment": ["gdn"] * 2, "device": ["host"] * 2, "case": ["T=64/chunkwise", "T=64/serial"],
                       "margin": [0.8660254037844386, 6.5], **{f"figure {i}": [1.5, 2.5] for i in range(14)}})
    text = tables.for_terminal(df, "testbed table gdn --format md|csv|json")
    lines = text.splitlines()
    assert all(len(line) <= 120 for line in lines), text
    assert lines[0] == "experiment: gdn; device: host" and lines[1].startswith("| case ") and "| 0.866 " in text
    note = " ".join(" ".join(line.split()) for line in lines if not line.startswith("|"))  # wrapped
    assert "more column(s): " in note and "figure 13" in note
    assert note.endswith("all of them: testbed table gdn --format md|csv|json)")
    # a sweep's results are never said once, only its settings
    shown, once, _ = tables.fit(df, settings=["experiment"])
    assert once == {"experiment": "gdn"} and "device" in shown.columns
    # a sentence wraps, a table line never does
    assert all(len(line) <= 120 for line in tables.wrap("word " * 60).splitlines())
