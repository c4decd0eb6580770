"""Engine contract v1 (backend=engine): a lab brings its own engine with one yaml and a program, without
touching the package, and gets verdicts, sweep rows and report rows; faults planted in an engine fail
the oracles through the contract; a refusal reads "not supported"; a response that breaks the contract
is one line naming the file and the value, exit 4, and no record that reads as passed.

The lab's engine is a copy of testbed's engine adapter (kernels/bench/tb_model_engine.c) in the lab's own
folder, built by the yaml's own command (cc); its faults are compile-time defines of that copy. The
bad-response engines wrap the real engine in a script that damages its response."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.cli_support import said, table_rows
from testbed import config, runner
from testbed.backends.engine import runner as engine_runner, spec as engine_spec
from testbed.backends.native import build as kernel_build
from testbed.errors import UsageError

SOURCES = ["bench/tb_model_engine.c", "bench/tb_engine.c", "bench/harness.c", "bench/safetensors.c", "bench/model_load.c",
           "gdn.c", "attention.c", "sliding_cache.c", "tb_parallel.c", "model.c", "model_cache.c", "model_prefill.c",
           "hybrid.c", "gemm.c", "gemm_avx2.c", "gemm_avx512.c"]
SMALL = ["mode=oracle", "cases=[{past: 5, tokens: 7}]", "chunk=4"]


def lab_engine(lab: Path, name: str, defines: tuple[str, ...] = ()) -> Path:
    """lab/engines/NAME.yaml and its source: a copy of kernels/ built by a plain cc command."""
    source = lab / f"{name}-src"
    if not source.is_dir():
        shutil.copytree(kernel_build.KERNELS_DIR, source, ignore=shutil.ignore_patterns("build", "*.o", "*.so"))
    command = ["cc", "-std=c11", "-O1", "-ffp-contract=off", "-fno-math-errno", "-I.", "-DTB_FUSED=0",
               '-DTB_SOURCE_HASH="lab"', *(f"-D{d}=1" for d in defines), "-o", "{out}/tb_model_engine", *SOURCES,
               "-lm", "-pthread"]
    (lab / "engines").mkdir(parents=True, exist_ok=True)
    (lab / "engines" / f"{name}.yaml").write_text(textwrap.dedent(f"""\
        name: {name}
        contract: 1
        description: a lab's engine{' with ' + ', '.join(defines) if defines else ''}
        source: ../{name}-src
        build:
          command: {json.dumps(command)}
        program: tb_model_engine
        abis: [host]
        supports:
          techniques: [chunk_prefill, tail]
          cache: [float32, float16, int8]
        invoke: ["{{program}}", "{{request}}", "{{response}}"]
        timeout_s: 300
        counts: marked
        """))
    return lab / "engines" / f"{name}.yaml"


@pytest.fixture
def lab(tmp_path, monkeypatch):
    folder = tmp_path / "lab"
    folder.mkdir()
    monkeypatch.setenv("TESTBED_LAB", str(folder))
    return folder


def run(overrides, experiment="chunk_prefill"):
    return runner.execute(config.load(overrides, experiment=experiment))


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "testbed", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(kernel_build.ROOT), **(env or {})})


def test_a_lab_engine_gets_verdicts_sweep_rows_and_report_rows(lab, results_dir, tmp_path):
    lab_engine(lab, "toy")
    outcome = run(["backend=engine", "engine=toy", *SMALL])
    df = outcome.frame()
    assert len(df) == 4 and (df["verdict"] == "pass").all() and (df["backend"] == "engine:toy").all()
    evidence = df["evidence"].iloc[0][0]["detail"]
    assert evidence["engine"] == "toy" and evidence["engine_yaml_sha256"] == engine_spec.load("toy").yaml_sha256
    assert evidence["counted"] in ("not counted", "per call (tb_engine.h marks)")
    env = {"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)}
    swept = cli("sweep", "experiment=chunk_prefill", "backend=engine", "engine=toy", "chunk=4,8", *SMALL[:2],
                        env=env)
    assert swept.returncode == 0, swept.stderr
    rows = table_rows(swept.stdout)  # the job's settings said once above its rows where they would not fit
    assert "backend: engine; engine: toy" in swept.stdout or all("| engine  | toy" in row for row in rows)
    assert len(rows) == 2 and all("4 pass" in row for row in rows), swept.stdout
    report = cli("report", f"--out={tmp_path / 'report'}", env=env)
    assert report.returncode == 0, report.stderr
    rows = [line for line in (tmp_path / "report" / "report.md").read_text().splitlines() if "engine:toy" in line]
    assert any("| host | engine:toy | tiny |" in row and "pass" in row for row in rows), rows


@pytest.mark.parametrize("fault, failing", [
    # each fault is one more build of the lab's engine (~10-20 s): one in the default run, all with -m slow_build
    pytest.param("TB_FAULT_CHUNK_OFF_BY_ONE", {"logits", "cache", "naive"}, marks=pytest.mark.slow_build),
    pytest.param("TB_FAULT_PAD_ROW_KEPT", {"cache"}, marks=pytest.mark.slow_build),
    ("TB_FAULT_STATE_NOT_CARRIED", {"token", "logits", "cache", "naive"}),
])
def test_planted_engine_faults_fail_the_oracles(lab, results_dir, fault, failing):
    lab_engine(lab, "faulty", (fault,))
    df = run(["backend=engine", "engine=faulty", *SMALL]).frame()
    failed = set(df.loc[df["verdict"] == "fail", "oracle"])
    assert failing <= failed, df[["oracle", "verdict", "detail"]].to_string()


def wrapper_engine(lab: Path, name: str, damage: str, timeout: float = 300) -> None:
    """A host engine that runs testbed-c for real, then damages its response (python, `damage` given the
    response folder as `out` and numpy as `np`)."""
    real = kernel_build.build_programs("host") / "tb_model_engine"
    script = lab / f"{name}.py"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import json, subprocess, sys, time
        from pathlib import Path
        import numpy as np
        code = subprocess.run([{str(real)!r}, sys.argv[1], sys.argv[2]]).returncode
        out = Path(sys.argv[2])
        """) + textwrap.dedent(damage) + "\nsys.exit(code)\n")
    script.chmod(0o755)
    (lab / "engines").mkdir(parents=True, exist_ok=True)
    (lab / "engines" / f"{name}.yaml").write_text(textwrap.dedent(f"""\
        name: {name}
        contract: 1
        build:
          prebuilt: {{host: ../{name}.py}}
        program: {name}.py
        abis: [host]
        supports: {{techniques: [chunk_prefill]}}
        invoke: ["{{program}}", "{{request}}", "{{response}}"]
        timeout_s: {timeout}
        counts: process
        """))


BAD_RESPONSES = {
    "missing": ("(out / 'logits.npy').unlink()", "response/logits.npy is missing"),
    "shape": ("a = np.load(out / 'logits.npy'); np.save(out / 'logits.npy', a[:, :-1])",
              "response/logits.npy has shape (1, 255)"),
    "dtype": ("a = np.load(out / 'logits.npy'); np.save(out / 'logits.npy', a.astype(np.float64))",
              "response/logits.npy has dtype float64"),
    "nan": ("a = np.load(out / 'logits.npy'); a[0, 7] = np.nan; np.save(out / 'logits.npy', a)",
            "response/logits.npy holds 1 non-finite value(s), the first nan at index (0, 7)"),
    "version": ("(out / 'status.json').write_text(json.dumps({'contract': 2, 'status': 'ok'}))",
                "response/status.json: contract=2"),
    "hang": ("time.sleep(600)", "did not answer within timeout_s=3"),
}


@pytest.mark.parametrize("bad", list(BAD_RESPONSES))
def test_a_response_that_breaks_the_contract_is_one_line_exit_4_and_never_a_pass(lab, results_dir, bad):
    damage, message = BAD_RESPONSES[bad]
    wrapper_engine(lab, f"bad-{bad}", damage, timeout=3 if bad == "hang" else 300)
    p = cli("run", "chunk_prefill", "backend=engine", f"engine=bad-{bad}", *SMALL,
                    env={"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)})
    lines = said(p.stderr)
    assert p.returncode == 4, p.stderr
    assert any(message in line for line in lines), lines
    assert not any("Traceback" in line for line in lines)
    records = [json.loads(line) for line in (results_dir / "records.jsonl").read_text().splitlines()]
    verdicts = [r.get("verdict") for r in records if r.get("kind") == "oracle"]
    assert "pass" not in verdicts and "error" in verdicts


def test_a_refusal_reads_not_supported(lab, results_dir):
    wrapper_engine(lab, "refuser", """\
        for f in out.iterdir():
            f.unlink() if f.is_file() else None
        (out / 'status.json').write_text(json.dumps({'contract': 1, 'status': 'refused',
                                                     'reason': 'no past beyond 4 rows'}))
        """)
    df = run(["backend=engine", "engine=refuser", *SMALL]).frame()
    assert set(df["verdict"]) == {"not supported"}
    assert df["detail"].str.contains("no past beyond 4 rows").all()


def test_testbed_c_refuses_hybrid(results_dir):
    """testbed's own engine answers a technique it does not serve with a refusal, not a crash."""
    from refimpl import gemma
    from testbed import devices
    from testbed.backends.engine import build
    from testbed.backends.native.engine import export_weights
    from testbed.devices import load_profile

    cfg = gemma.tiny_config()
    spec = engine_spec.load("testbed-c")
    device = devices.connect(load_profile("host"))
    request = engine_runner.Request("hybrid", np.arange(8), export_weights(cfg, gemma.init_weights(cfg, 0)),
                                    chunk=4, logits_at=[7])
    response = engine_runner.call(device, spec, request, engine_runner.Expect(cfg.vocab), build.program_for(spec, "host"))
    assert response.refused and "technique=hybrid" in response.reason


@pytest.mark.parametrize("text, said_", [
    ("name: x\ncontract: 2\n", "contract=2; accepted: 1"),
    ("name: x\ncontract: 1\nprogram: p\nabis: [host]\nsupports: {techniques: [chunk_prefil]}\ninvoke: ['{program}']\n"
     "build: {prebuilt: {host: p}}\n", "supports.techniques[0]='chunk_prefil' (did you mean 'chunk_prefill'?)"),
    ("name: x\ncontract: 1\nprogram: p\nabis: [host]\nsupports: {techniques: [tail]}\ninvoke: ['{program}']\n"
     "build: {prebuilt: {host: p}}\ntimeout: 3\n", "timeout is not a key (did you mean 'timeout_s'?)"),
    ("name: x\ncontract: [1\n", "is not YAML"),
])
def test_a_bad_engine_yaml_is_one_line_naming_file_and_key(lab, text, said_):
    (lab / "engines").mkdir()
    (lab / "engines" / "x.yaml").write_text(text)
    with pytest.raises(UsageError, match="x.yaml") as e:
        engine_spec.load("x")
    assert said_ in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_engine_names_the_closest(lab):
    with pytest.raises(UsageError, match="did you mean 'testbed-c'"):
        engine_spec.load("testbed_c")


def test_a_build_that_fails_quotes_the_first_error_and_exits_4(lab, results_dir):
    path = lab_engine(lab, "broken")
    engine_c = lab / "broken-src" / "bench" / "tb_model_engine.c"
    engine_c.write_text(engine_c.read_text().replace("static void check(int rc", "static void check(int rc int x", 1))
    p = cli("run", "chunk_prefill", "backend=engine", "engine=broken", *SMALL,
                    env={"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)})
    assert p.returncode == 4 and "tb_model_engine.c" in p.stderr and "error" in p.stderr, p.stderr
    assert str(path) in p.stderr


def test_the_schema_file_is_what_the_loader_enforces():
    schema = engine_spec.schema()
    assert schema["properties"]["contract"] == {"const": engine_spec.CONTRACT_VERSION}
    assert set(schema["required"]) <= set(schema["properties"])
    engine_spec.parse(engine_spec.PROJECT_ENGINES / "testbed-c.yaml")


def test_an_engine_without_a_cache_is_judged_by_its_logits_and_its_cache_is_not_supported(lab, results_dir):
    wrapper_engine(lab, "nocache", "import shutil; shutil.rmtree(out / 'cache')")
    df = run(["backend=engine", "engine=nocache", *SMALL]).frame()
    verdicts = dict(zip(df["oracle"], df["verdict"]))
    assert verdicts == {"token": "pass", "logits": "pass", "cache": "not supported", "naive": "pass"}


def test_the_hybrid_through_testbed_c_reads_not_supported(results_dir):
    df = run(["backend=engine", "engine=testbed-c", "mode=oracle"], experiment="hybrid").frame()
    assert set(df["verdict"]) == {"not supported"} and df["detail"].str.contains("does not list hybrid").all()


def test_ab_of_two_engines_judges_the_pairs(lab, results_dir):
    """`testbed ab engine:A engine:B`: a lab's build of the engine without the host's vector flags and at -O1
    against testbed-c, six pairs interleaved in one job; the verdict and both sides are recorded."""
    lab_engine(lab, "toy")
    p = cli("ab", "engine:testbed-c", "engine:toy", "experiment=chunk_prefill", "bench.past=16", "chunk=8", "--reps", "6",
            env={"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)})
    assert p.returncode in (0, 1), p.stderr
    assert "A = engine:testbed-c" in p.stdout and "B = engine:toy" in p.stdout
    records = [json.loads(line) for line in (results_dir / "records.jsonl").read_text().splitlines()]
    [ab] = [r["metrics"]["ab"] for r in records if r.get("kind") == "measure"]
    assert ab["pairs"] == 6 and ab["verdict"] in ("slower", "faster", "no change", "undecided")
    assert ab["a"] == "engine:testbed-c" and ab["b"] == "engine:toy"


def test_a_build_tool_that_is_missing_exits_3(lab, results_dir):
    path = lab_engine(lab, "notool")
    path.write_text(path.read_text().replace('["cc", ', '["no-such-compiler-tb", '))
    p = cli("run", "chunk_prefill", "backend=engine", "engine=notool", *SMALL,
            env={"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)})
    assert p.returncode == 3 and "'no-such-compiler-tb' is not installed" in p.stderr, p.stderr


TAIL_SMALL = ["mode=oracle", "chunk=8", "tail=[3]", "shape.hidden=64", "shape.layers=2", "shape.heads=2",
              "shape.kv_heads=1", "shape.head_dim=32", "shape.mlp=128", "shape.vocab=256", "shape.window=32",
              "oracle.grid_windows=[16]", "oracle.grid_sinks=[0]"]


def test_a_kept_pad_row_in_the_tail_fails_the_state_bytes_oracle(lab, results_dir):
    """The padded tail's snapshot and rollback count one pad row too few, so one stays in the cache (a
    patched copy of kernels/model_prefill.c in the lab's engine source): state.bin differs from the
    unpadded append's, and the verdict says where."""
    source = lab / "padkept-src"
    shutil.copytree(kernel_build.KERNELS_DIR, source, ignore=shutil.ignore_patterns("build", "*.o", "*.so"))
    prefill_c = source / "model_prefill.c"
    find = "const int real = tail - 1, pads = chunk - real;"
    assert prefill_c.read_text().count(find) == 1
    prefill_c.write_text(prefill_c.read_text().replace(find, "const int real = tail - 1, pads = chunk - real - 1;"))
    lab_engine(lab, "padkept")
    df = run(["backend=engine", "engine=padkept", *TAIL_SMALL], experiment="tail").frame()
    state = df[df["oracle"] == "state_bytes"]
    assert len(state) and (state["verdict"] == "fail").any(), df[["case", "verdict", "detail"]].to_string()
    assert state.loc[state["verdict"] == "fail", "detail"].str.contains("state.bin").all()
    clean = run(["backend=engine", "engine=testbed-c", *TAIL_SMALL], experiment="tail").frame()
    assert (clean["verdict"] == "pass").all()


def test_an_engine_that_reads_a_hugging_face_folder_is_handed_one(lab, results_dir):
    """model_formats: [hf] (an exporter's input): the request's model is a folder holding config.json and
    model.safetensors, written once per content from the run's model; the engine here only reads it and
    answers in its own words what it was given."""
    script = lab / "hf-reader.py"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""\
        import json, sys
        from pathlib import Path
        request, out = Path(sys.argv[1]), Path(sys.argv[2])
        model = request / json.loads((request / "request.json").read_text())["model"]["file"]
        config = json.loads((model / "config.json").read_text())
        said = f"{model.name}/ holds {', '.join(sorted(p.name for p in model.iterdir()))}; {config['model_type']}"
        (out / "status.json").write_text(json.dumps({"contract": 1, "status": "refused", "reason": said}))
        """))
    script.chmod(0o755)
    (lab / "engines").mkdir()
    (lab / "engines" / "hf-reader.yaml").write_text(textwrap.dedent("""\
        name: hf-reader
        contract: 1
        build: {prebuilt: {host: ../hf-reader.py}}
        program: hf-reader.py
        abis: [host]
        supports: {techniques: [chunk_prefill], model_formats: [hf]}
        invoke: ["{program}", "{request}", "{response}"]
        """))
    df = run(["backend=engine", "engine=hf-reader", *SMALL]).frame()
    assert set(df["verdict"]) == {"not supported"}
    assert df["detail"].str.contains("model/ holds config.json, model.safetensors; gemma3_text").all(), df["detail"][0]
