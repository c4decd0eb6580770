"""llama-bench's three documented output formats describe one run identically (tests/data/llama-bench)."""

from pathlib import Path

import pytest

from testbed import llama_bench
from testbed.errors import DeviceError

DATA = Path(__file__).parent / "data" / "llama-bench"


@pytest.mark.parametrize("fmt", ["md", "csv", "json"])
def test_every_format_gives_pp512(fmt):
    rows = llama_bench.parse((DATA / f"pp512.{fmt}").read_text())
    assert [r.test for r in rows] == ["pp512"]
    assert rows[0].tokens_per_s == pytest.approx(93.21) and rows[0].stddev == pytest.approx(1.06)
    assert rows[0].threads == 8


def test_json_samples_give_a_real_figure():
    row = llama_bench.parse((DATA / "pp512.json").read_text())[0]
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
    assert [r.test for r in llama_bench.parse(text)] == ["pp512", "pp512@d512"]


@pytest.mark.parametrize("text", ["", "llama_model_load: error loading model\n", "[\n  {\n    \"build_commit\": \"5a"])
def test_a_run_without_results_is_an_error(text):
    with pytest.raises(DeviceError):
        llama_bench.parse(text)
