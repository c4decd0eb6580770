"""`testbed ingest` refuses what is cut, damaged, not a file, not the device's or stored already, and
reads what it accepts right (issue 13, items 5, 16, 19 and the "not supported" pin of 24)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testbed import PROJECT_ROOT
from testbed.cli import main
from testbed.results import ResultsStore


@pytest.fixture
def tbo(seed_fixtures):
    return seed_fixtures / "test-backend-ops"


def refused(argv, capsys, says: str) -> None:
    assert main(["ingest", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("testbed: error: ") and says in err and "\n" not in err, err


@pytest.mark.parametrize("cut, says", [
    (lambda t: t[: t.rindex("\n") - 40], "does not end with a newline"),  # cut mid-row
    (lambda t: t.rstrip("\n"), "does not end with a newline"),  # cut right after a row
    (lambda t: t.rsplit("\n", 2)[0][:-30] + "\n", "fields, the header 7: a cut row"),  # a cut row, then a newline
    (lambda t: t.replace('"supported",', "", 1), "lacks column 'supported'"),
])
def test_a_cut_or_incomplete_csv_is_refused(cut, says, tbo, tmp_path, results_dir, capsys):
    text = (tbo / "test_mode_b_CPU.csv").read_text()
    (tmp_path / "cut.csv").write_text(cut(text))
    refused([str(tmp_path / "cut.csv")], capsys, says)
    assert not results_dir.exists()


def test_colour_codes_that_lost_their_escape_byte_still_read_as_ok(tbo, tmp_path, results_dir, capsys):
    (tmp_path / "noesc.stdout").write_text((tbo / "test_mode_b_CPU.stdout").read_text().replace("\x1b", ""))
    assert main(["ingest", str(tmp_path / "noesc.stdout")]) == 0
    assert "36/36 OK (pass)" in capsys.readouterr().out


def test_output_without_a_known_verdict_is_refused(tbo, tmp_path, results_dir, capsys):
    text = (tbo / "test_mode_b_CPU.stdout").read_text().replace("\x1b[1;32mOK\x1b[0m", "\x1b[1;32m??")
    (tmp_path / "garbled.stdout").write_text(text)
    refused([str(tmp_path / "garbled.stdout")], capsys, "no test-backend-ops case line with a verdict")


def test_output_of_another_backend_is_refused_unless_forced(tbo, results_dir, capsys):
    refused([str(tbo / "test_mode_b_CPU.stdout"), "--device", "hexagon"], capsys,
            "is output of backend CPU, but device hexagon's backend is HTP0")
    assert not results_dir.exists()
    assert main(["ingest", str(tbo / "test_mode_b_CPU.stdout"), "--device", "hexagon", "--force"]) == 0


def test_a_run_ingested_twice_counts_once(tbo, results_dir, capsys):
    assert main(["ingest", str(tbo / "test_mode_b_CPU.stdout")]) == 0
    refused([str(tbo / "test_mode_b_CPU.csv")], capsys, "this run is already stored")
    refused([str(tbo / "test_mode_b_CPU.stdout")], capsys, "this run is already stored")
    assert len(ResultsStore(results_dir).records()) == 37


def test_not_a_regular_file_is_refused_at_once(tmp_path, results_dir):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, says in ((fifo, "is not a regular file"), ("/dev/zero", "is not a regular file"),
                       (tmp_path, "is not a regular file"), (tmp_path / "nothing", "No such file")):
        p = subprocess.run([sys.executable, "-m", "testbed", "ingest", str(path)], cwd=PROJECT_ROOT,
                           env={**os.environ, "TESTBED_RESULTS": str(results_dir)}, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 2 and says in p.stderr and p.stderr.count("\n") == 1, p.stderr


def test_a_file_over_the_size_cap_is_refused(tmp_path, results_dir, capsys, monkeypatch):
    from testbed.lab import ingest

    monkeypatch.setattr(ingest, "MAX_BYTES", 1000)
    (tmp_path / "big.stdout").write_text("x" * 2000 + "\n")
    refused([str(tmp_path / "big.stdout")], capsys, "accepted: at most")


def test_only_experiments_of_test_backend_ops_take_its_output(tbo, results_dir, capsys):
    refused([str(tbo / "test_mode_b_CPU.stdout"), "--experiment", "tail"], capsys,
            "--experiment 'tail' does not take test-backend-ops output; accepted: gdn, llamacpp")


def test_not_supported_cases_are_neither_passed_nor_tested(tbo, tmp_path, results_dir, capsys):
    """Pinned: 2 of 36 cases not supported -> 34/34 OK, 2 unsupported; the tool's own summary agrees."""
    lines = (tbo / "test_mode_b_CPU.stdout").read_text().splitlines(keepends=True)
    cases = [i for i, line in enumerate(lines) if "GATED_DELTA_NET(" in line]
    for i in cases[:2]:
        lines[i] = lines[i].split("): ")[0] + "): not supported [CPU]\n"
    text = "".join(lines).replace("36/36 tests passed", "34/34 tests passed")
    (tmp_path / "unsupported.stdout").write_text(text)
    assert main(["ingest", str(tmp_path / "unsupported.stdout")]) == 0
    assert "34/34 OK (pass)" in capsys.readouterr().out
    (tally,) = [r for r in ResultsStore(results_dir).records() if r["case"].endswith("/tally")]
    assert tally["metrics"] == {"tally": "34/34 OK", "passed": 34, "tested": 34, "unsupported": 2}
    # counting them as OK would make the tool's summary disagree: that reads as a failure, never a pass
    (tmp_path / "miscount.stdout").write_text(text.replace("34/34 tests passed", "36/36 tests passed"))
    assert main(["ingest", str(tmp_path / "miscount.stdout"), "--force"]) == 1


def with_passed_column(text: str, cell=lambda n: "1") -> str:
    """The CSV as newer test-backend-ops write it: a `passed` column; `cell(n)` is row n's value."""
    lines = text.splitlines()
    return "\n".join([lines[0] + ',"passed"'] + [f'{line},"{cell(n)}"' for n, line in enumerate(lines[1:])]) + "\n"


def test_a_csv_row_without_a_verdict_is_refused_naming_its_line(tbo, tmp_path, results_dir, capsys):
    """Issue 24, item 3: an empty `passed` cell is no verdict; nor is a `supported` cell the tool never writes."""
    text = (tbo / "test_mode_b_CPU.csv").read_text()
    (tmp_path / "ok.csv").write_text(with_passed_column(text))
    assert main(["ingest", str(tmp_path / "ok.csv")]) == 0
    (tmp_path / "empty.csv").write_text(with_passed_column(text, lambda n: "" if n == 2 else "1"))
    refused([str(tmp_path / "empty.csv"), "--force"], capsys, "line 4 (")
    (tmp_path / "maybe.csv").write_text(text.replace('"test","1"', '"test","maybe"', 1))
    refused([str(tmp_path / "maybe.csv"), "--force"], capsys, "line 2 (")
    assert len(ResultsStore(results_dir).records()) == 37  # only the first file's


@pytest.mark.parametrize("bad", ["nan us/run", "inf us/run", "-5.00 us/run", "0.00 us/run"])
def test_a_perf_row_that_is_not_a_measurement_is_refused_naming_its_line(bad, tbo, tmp_path, results_dir, capsys):
    """Issue 24, item 3: nan/inf/negative times were dropped (12 lines -> 9 records, exit 0), and
    "0 runs, 0.00 us/run" stored as a real 0 us."""
    text = (tbo / "perf_b_CPU.stdout").read_text()
    line = next(n for n, ln in enumerate(text.splitlines(), 1) if "head_count=16,head_size=64," in ln)
    (tmp_path / "perf.stdout").write_text(text.replace("29.20 us/run", bad))
    refused([str(tmp_path / "perf.stdout")], capsys, f"line {line} (")
    (tmp_path / "none.stdout").write_text(text.replace("40950 runs -    29.20", "0 runs -    0.00"))
    refused([str(tmp_path / "none.stdout")], capsys, f"line {line} (")
    assert not results_dir.exists()
    assert main(["ingest", str(tbo / "perf_b_CPU.stdout")]) == 0
    assert len(ResultsStore(results_dir).records()) == 12


def test_a_csv_cut_at_a_row_boundary_is_refused_as_incomplete(tbo, tmp_path, results_dir, capsys):
    """Issue 24, item 4: a CSV has no summary line; cut right after a row it ends with a newline and every
    row is whole, so only the op's case list (or --cases, what the command ran) says it is not."""
    text = (tbo / "test_mode_b_CPU.csv").read_text()
    (tmp_path / "cut.csv").write_text("".join(text.splitlines(keepends=True)[:-3]))
    refused([str(tmp_path / "cut.csv")], capsys, "incomplete: 33 of the 36 GATED_DELTA_NET cases")
    refused([str(tmp_path / "cut.csv"), "--cases", "36"], capsys, "incomplete: 33 case rows, but the command ran 36")
    other = text.replace('"GATED_DELTA_NET"', '"SSM_SCAN"')
    (tmp_path / "other.csv").write_text(other)
    refused([str(tmp_path / "other.csv")], capsys, "testbed has no case list for SSM_SCAN")
    assert not results_dir.exists()
    assert main(["ingest", str(tmp_path / "other.csv"), "--cases", "36"]) == 0
    assert main(["ingest", str(tmp_path / "cut.csv"), "--cases", "33"]) == 0  # a run of 33 cases (-p)
