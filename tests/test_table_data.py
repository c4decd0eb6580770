"""`testbed table --format csv|json|jsonl` as data (issue 34, Output): machine column names, numbers as
numbers, every figure's samples in JSON, and a CSV any reader reads (no comment lines among the rows).
The store is written by real runs of the tail experiment: its seed's fixture (a breakeven) and one
small measured sweep (samples), whose rows each draw on two records (padded and scalar)."""

from __future__ import annotations

import io
import json
import re

import pandas as pd

from testbed.cli import main
from testbed.results import ResultsStore
from tests.test_tail_experiment import TINY

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")  # dotted: a flattened record's keys


def test_table_csv_and_json_are_data_with_every_figures_samples(results_dir, capsys):
    assert main(["run", "tail", "mode=fixture"]) == 0
    assert main(["run", "tail", *TINY, "prompt_tokens=[140,256]", "reps=2", "warmup=0"]) == 0
    capsys.readouterr()
    measured = [r for r in ResultsStore(results_dir).records("tail")
                if r["kind"] == "measure" and r["figures"]["tokens_per_s"].get("samples")]
    assert len(measured) == 4  # two prompt lengths, padded and scalar

    assert main(["table", "tail", "--format", "csv"]) == 0
    out, err = capsys.readouterr()
    table = pd.read_csv(io.StringIO(out))  # a plain reader: no comment= needed
    assert all(IDENTIFIER.fullmatch(c) for c in table.columns), list(table.columns)
    assert table["N"].dtype.kind == "i" and table["padded_tok_per_s"].dtype.kind == "f"
    assert not out.lstrip().startswith("#") and "\n#" not in out
    assert "breakeven (fixture:" in err  # the conclusion is said apart from the rows

    assert main(["table", "tail", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert all(IDENTIFIER.fullmatch(k) for row in data["rows"] for k in row)
    assert len(data["rows"]) == len(table) and data["breakevens"]
    by_record = {s["record_id"]: s["samples"] for s in data["samples"]}
    for r in measured:  # every repetition of every measured figure, as stored
        assert by_record[r["record_id"]]["tokens_per_s"] == r["figures"]["tokens_per_s"]["samples"]
        assert len(by_record[r["record_id"]]["tokens_per_s"]) == 2

    assert main(["table", "tail", "--format", "jsonl"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {line["samples"]["record_id"] for line in lines if "samples" in line} == {r["record_id"] for r in measured}
