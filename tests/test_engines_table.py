"""The engines table (testbed.experiments.chunk_prefill.engines): every engine under test side by side, from a
real sweep `testbed sweep experiment=chunk_prefill backend=engine engine=testbed-c,onnxruntime,refuser chunk=4,8`
(refuser: a lab's engine that refuses, in its own words). One row per engine and technique: the verdict over
its oracles (pass; not supported with the engine's reason, never a failure), the best C with its confidence,
prefill tokens/s and chunk-call CPU time with the 95% interval of each median, the engine process's peak RSS
and, for the exporter-based engine, its export's size; in the sweep's output, `testbed table chunk_prefill
--format json` (an `engines` list) and the report's "Engines under test". The planted adapter faults of
tests/test_onnxruntime_engine.py show the same table saying fail."""

from __future__ import annotations

import json
import textwrap

import pytest

pytest.importorskip("torch", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
pytest.importorskip("onnxruntime", reason="the onnx extra: pip install 'testbed[onnx]'", exc_type=ImportError)

from tests.test_engine_contract import cli  # noqa: E402

SMALL = ["cases=[{past: 21, tokens: 13}]", "bench.past=16", "bench.reps=5", "latency.utterance_tokens=[13]"]


def refusing_engine(lab):
    (lab / "refuser").mkdir(parents=True)
    program = lab / "refuser" / "refuse.sh"
    program.write_text(textwrap.dedent("""\
        #!/bin/sh
        printf '{"contract": 1, "status": "refused", "reason": "this lab engine serves no chunk prefill yet"}\\n' \\
            > "$2/status.json"
        """))
    program.chmod(0o755)
    (lab / "engines").mkdir()
    (lab / "engines" / "refuser.yaml").write_text(textwrap.dedent("""\
        name: refuser
        contract: 1
        build: {prebuilt: {host: ../refuser/refuse.sh}}
        program: refuse.sh
        abis: [host]
        supports: {techniques: [chunk_prefill]}
        invoke: ["{program}", "{request}", "{response}"]
        """))


def test_a_sweep_over_engines_gives_one_table(tmp_path):
    lab, results = tmp_path / "lab", tmp_path / "results"
    refusing_engine(lab)
    env = {"TESTBED_RESULTS": str(results), "TESTBED_LAB": str(lab)}
    swept = cli("sweep", "experiment=chunk_prefill", "backend=engine", "engine=testbed-c,onnxruntime,refuser",
                "chunk=4,8", *SMALL, env=env)
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert "\nengines:\n" in swept.stdout
    # on the terminal's 120 columns the figures come before the words: speed with its spread, CPU, memory
    header = next(line for line in swept.stdout.split("\nengines:\n", 1)[1].splitlines() if line.startswith("| "))
    assert all(f" {name} " in header for name in ("verdict", "prefill tok/s", "tok/s lo", "CPU ms", "peak RSS MB")), \
        header
    done = cli("table", "chunk_prefill", "--format", "json", env=env)
    assert done.returncode == 0, done.stderr
    rows = {r["engine"]: r for r in json.loads(done.stdout)["engines"]}
    assert set(rows) == {"testbed-c", "onnxruntime", "refuser"}
    for name in ("testbed-c", "onnxruntime"):
        row = rows[name]
        assert row["technique"] == "chunk_prefill" and row["verdict"] == "pass" and row["oracles"] == "8 pass", row
        # decisions.label: the best C alone when decided (with its confidence), else the candidates said as such
        assert (str(row["best_C"]) in ("4", "8") and "95% confidence" in row["best_C_says"]) or \
            (str(row["best_C"]).startswith("undecided: ") and "undecided" in row["best_C_says"]), row
        assert row["tok_per_s_lo"] <= row["prefill_tok_per_s"] <= row["tok_per_s_hi"], row
        assert row["CPU_ms_lo"] <= row["CPU_ms"] <= row["CPU_ms_hi"], row
        assert row["peak_RSS_MB"] > 1, row
    assert rows["onnxruntime"]["export_MB"] > 0 and rows["testbed-c"]["export_MB"] is None
    refused = rows["refuser"]
    assert refused["verdict"] == "not supported" and "serves no chunk prefill yet" in refused["reason"], refused
    assert refused["prefill_tok_per_s"] is None and "fail" not in refused["oracles"]
    report = cli("report", "--out", str(tmp_path / "report"), env=env)
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "report" / "report.md").read_text()
    section = page[page.index("## Engines under test"):]
    assert "| onnxruntime | chunk_prefill |" in section and "| refuser | chunk_prefill |" in section
