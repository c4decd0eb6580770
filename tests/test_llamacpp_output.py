"""llama.cpp tool outputs -> verdicts and figures. test-backend-ops: real outputs (fixtures/)
and realistic breakage planted in them (a failing case, a run cut short, a lying summary).
llama-bench: its three documented formats describing one run (tests/data/llama-bench) must agree."""

import re
from pathlib import Path

import pytest

from testbed import PROJECT_ROOT
from testbed.backends.llamacpp import output as out
from testbed.errors import DeviceError


def fixtures() -> Path:
    from testbed import config
    from testbed.measure import seed

    return seed.fixtures_dir(config.load([]).cfg.fixtures_dir) / "test-backend-ops"


def read(name: str) -> str:
    return (fixtures() / name).read_text()


def test_the_real_test_mode_output_is_36_of_36_ok():
    report = out.parse_test(read("test_mode_b_CPU.stdout"))
    assert report.tally() == "36/36 OK" and report.summary == (36, 36)
    assert report.backends == {"CPU": "OK"} and report.final == "OK" and report.problems() == []
    first = report.cases[0]
    assert first.op == "GATED_DELTA_NET" and first.param("head_count") == "32" and first.param("K") == "1"


def test_csv_and_stdout_list_the_same_cases():
    from_csv = out.parse_csv(read("test_mode_b_CPU.csv"))
    from_stdout = out.parse_test(read("test_mode_b_CPU.stdout")).cases
    assert [c.name for c in from_csv] == [c.name for c in from_stdout]
    assert all(c.status == "OK" for c in from_csv)


def test_a_skipped_backend_is_not_a_pass():
    report = out.parse_test(read("test_mode_default.stdout"))
    assert report.final == "OK"  # the tool itself says OK...
    assert any("no case was tested" in p for p in report.problems())  # ...but nothing was tested


def test_a_failing_case_is_caught():
    text = read("test_mode_b_CPU.stdout")
    lines = text.splitlines()
    i = next(n for n, ln in enumerate(lines) if "n_seq_tokens=127,n_seqs=2" in ln)
    lines[i] = re.sub(r"\x1b\[1;32mOK\x1b\[0m$", "[GATED_DELTA_NET] NMSE = 0.000123456 > 0.000000100 \x1b[1;31mFAIL\x1b[0m",
                      lines[i])
    broken = "\n".join(lines).replace("36/36 tests passed", "35/36 tests passed").replace(
        "Backend CPU: \x1b[1;32mOK", "Backend CPU: \x1b[1;31mFAIL")
    report = out.parse_test(broken)
    assert report.tally() == "35/36 OK"
    bad = [c for c in report.cases if c.status == "FAIL"]
    assert len(bad) == 1 and bad[0].nmse == pytest.approx(1.23456e-4) and bad[0].threshold == 1e-7
    assert any("n_seq_tokens=127,n_seqs=2" in p for p in report.problems())


def test_a_run_cut_short_is_not_a_pass():
    text = read("test_mode_b_CPU.stdout")
    cut = text[: text.index("n_seq_tokens=64,n_seqs=1,v_repeat=1,permuted=0,kda=1")]  # the device died here
    report = out.parse_test(cut)
    assert report.passed == len(report.tested) == 25  # every line it printed said OK...
    assert "did not finish" in " ".join(report.problems())  # ...and still it did not pass


def test_a_summary_that_disagrees_with_the_lines_is_not_a_pass():
    report = out.parse_test(read("test_mode_b_CPU.stdout").replace("36/36 tests passed", "37/37 tests passed"))
    assert any("the tool says 37/37" in p for p in report.problems())


def test_perf_mode_gives_us_per_run_and_bandwidth():
    rows = out.parse_perf(read("perf_b_CPU.stdout"))
    assert len(rows) == 12
    t512 = next(r for r in rows if "head_count=32,head_size=128,n_seq_tokens=512," in r.params)
    assert (t512.runs, t512.us_per_run, t512.per_run, t512.gbps) == (227, 69787.23, 36992.0, 0.51)


# --- llama-bench ---------------------------------------------------------------------------------

DATA = Path(__file__).parent / "data" / "llama-bench"


@pytest.mark.parametrize("fmt", ["md", "csv", "json"])
def test_every_format_gives_pp512(fmt):
    rows = out.parse_bench((DATA / f"pp512.{fmt}").read_text())
    assert [r.test for r in rows] == ["pp512"]
    assert rows[0].tokens_per_s == pytest.approx(93.21) and rows[0].stddev == pytest.approx(1.06)
    assert rows[0].threads == 8


def test_json_samples_give_a_real_figure():
    row = out.parse_bench((DATA / "pp512.json").read_text())[0]
    f = row.figure()
    assert f.reps == 5 and f.unit == "tokens/s" and f.min == pytest.approx(92.055) and f.max == pytest.approx(94.465)
    # the samples are the tokens over the per-repetition times the same file gives
    import json

    obj = json.loads((DATA / "pp512.json").read_text())[0]
    assert [512 / (ns * 1e-9) for ns in obj["samples_ns"]] == pytest.approx(obj["samples_ts"], rel=1e-4)


def test_older_spelling_and_depth_tests():
    text = ("| model | size | params | backend | ngl | test | t/s |\n| --- | ---: | ---: | --- | --: | --- | ---: |\n"
            "| llama 7B | 3.56 GiB | 6.74 B | CUDA | -1 | pp 512 | 2368.80 ± 93.24 |\n"
            "| llama 7B | 3.56 GiB | 6.74 B | CUDA | -1 | pp512 @ d512 | 6425.91 ± 18.88 |\n")
    assert [r.test for r in out.parse_bench(text)] == ["pp512", "pp512@d512"]


@pytest.mark.parametrize("text", ["", "llama_model_load: error loading model\n", "[\n  {\n    \"build_commit\": \"5a"])
def test_a_run_without_results_is_an_error(text):
    with pytest.raises(DeviceError):
        out.parse_bench(text)
