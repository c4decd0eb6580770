"""Figures from emulated devices never reach a speed table (testbed.measure.emulation): `testbed table` leaves
them out and lists them apart (issue 24, item 7)."""

from __future__ import annotations

import copy
import json
import uuid

from testbed import config, runner
from testbed.cli import main
from testbed.results import ResultsStore
from tests.store_support import as_runs

BENCH = ["mode=bench", "bench.tokens=[64]", "bench.reps=2", "bench.heads=2", "bench.head_size=16"]


def test_table_leaves_emulated_figures_out_and_lists_them_apart(results_dir, capsys):
    runner.execute(config.load(BENCH, experiment="gdn"))
    store = ResultsStore(results_dir)
    host = [r for r in store.records() if r["kind"] == "measure"]
    run_id = uuid.uuid4().hex[:12]
    emulated = [{**copy.deepcopy(r), "device": "qemu-aarch64", "emulated": True, "run_id": run_id,
                 "record_id": uuid.uuid4().hex} for r in host]  # as a qemu-user run stores them
    store.append(as_runs(emulated))
    capsys.readouterr()
    assert main(["table", "gdn", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert {row["device"] for row in json.loads(out)["rows"]} == {"host"}
    assert f"left out: {len(emulated)} figure(s) computed under emulation" in err and "qemu-aarch64" in err
    assert main(["table", "gdn"]) == 0
    assert "qemu-aarch64" not in capsys.readouterr().out
