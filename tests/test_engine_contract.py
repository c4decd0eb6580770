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
           "bench/hybrid_load.c", "gdn.c", "attention.c", "sliding_cache.c", "tb_parallel.c", "model.c",
           "model_cache.c", "model_prefill.c", "hybrid.c", "gemm.c", "gemm_avx2.c", "gemm_avx512.c"]
SMALL = ["mode=oracle", "cases=[{past: 5, tokens: 7}]", "chunk=4"]
TAIL_SMALL = ["mode=oracle", "chunk=8", "tail=[3]", "shape.hidden=64", "shape.layers=2", "shape.heads=2",
              "shape.kv_heads=1", "shape.head_dim=32", "shape.mlp=128", "shape.vocab=256", "shape.window=32",
              "oracle.grid_windows=[16]", "oracle.grid_sinks=[0]"]


def lab_engine(lab: Path, name: str, defines: tuple[str, ...] = (), state_in: bool = False) -> Path:
    """lab/engines/NAME.yaml and its source: a copy of kernels/ built by a plain cc command (state_in: its
    yaml says it restores its own state.bin, as testbed-c's does)."""
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
          techniques: [chunk_prefill, tail, hybrid]
          cache: [float32, float16, int8]
          state_in: {str(state_in).lower()}
        invoke: ["{{program}}", "{{request}}", "{{response}}"]
        timeout_s: 300
        counts: marked
        """))
    return lab / "engines" / f"{name}.yaml"


def patched_lab_engine(lab: Path, name: str, file: str, find: str, replace: str, state_in: bool = False) -> Path:
    """lab_engine over a copy of kernels/ with `find` replaced by `replace` in FILE (exactly once): a planted
    fault in testbed-c's own code, built by the lab's command."""
    source = lab / f"{name}-src"
    shutil.copytree(kernel_build.KERNELS_DIR, source, ignore=shutil.ignore_patterns("build", "*.o", "*.so"))
    text = (source / file).read_text()
    assert text.count(find) == 1, f"the planted edit must match kernels/{file} exactly once: {find!r}"
    (source / file).write_text(text.replace(find, replace))
    return lab_engine(lab, name, state_in=state_in)


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
    pytest.param("TB_FAULT_STATE_NOT_CARRIED", {"token", "logits", "cache", "naive"}, marks=pytest.mark.quick),
])
def test_planted_engine_faults_fail_the_oracles(lab, results_dir, fault, failing):
    lab_engine(lab, "faulty", (fault,))
    df = run(["backend=engine", "engine=faulty", *SMALL]).frame()
    failed = set(df.loc[df["verdict"] == "fail", "oracle"])
    assert failing <= failed, df[["oracle", "verdict", "detail"]].to_string()


@pytest.mark.quick
def test_a_padded_tail_that_keeps_a_pad_row_fails_the_cache_oracle(lab, results_dir):
    """chunk_prefill's cases whose last call is partial are also asked with tail.mode=padded (that call padded
    to C, its pads dropped): an engine whose rollback drops one pad row too few (planted in its copy of
    kernels/bench/tb_model_engine.c, issue 44) fails the cache verdict, the kept row said; its logits are right."""
    patched_lab_engine(lab, "padfault", "bench/tb_model_engine.c", 'check(tb_engine_drop(e, C - real), "pad rollback")',
                       'check(tb_engine_drop(e, C - real - 1), "pad rollback")')
    df = run(["backend=engine", "engine=padfault", *SMALL]).frame().set_index("oracle")
    assert df.loc["cache", "verdict"] == "fail", df[["verdict", "detail"]].to_string()
    assert "with tail.mode=padded the cache holds 13 rows after the utterance, P + n = 12: 1 pad row(s) kept" in \
        df.loc["cache", "detail"]
    assert df.loc["token", "verdict"] == df.loc["logits", "verdict"] == "pass"
    assert df.loc["token", "metrics.tail_padded"] == "judged"


HYBRID_SMALL = ["mode=oracle", "chunk=16", "oracle.past=[20]", "oracle.tokens=[12]", "oracle.tails=[5]",
                "oracle.chunks=[8,16]", "oracle.prompt_tokens=40"]


def test_the_hybrid_through_a_lab_engine_fails_when_its_state_is_not_carried(lab, results_dir):
    """The hybrid through the contract (a lab's build of testbed-c, the same faulty build as above): honest, every
    oracle passes; with each utterance call started from an empty past (conv, recurrent state and KV caches
    dropped), the logits against the float64 model, the first token across C and after a padded tail fail (the
    token alone can survive: a tiny random model's next token leans on the last token)."""
    lab_engine(lab, "toy")
    honest = run(["backend=engine", "engine=toy", *HYBRID_SMALL], experiment="hybrid").frame()
    assert len(honest) and (honest["verdict"] == "pass").all(), honest[["case", "verdict", "detail"]].to_string()
    lab_engine(lab, "faulty", ("TB_FAULT_STATE_NOT_CARRIED",))
    df = run(["backend=engine", "engine=faulty", *HYBRID_SMALL], experiment="hybrid").frame()
    failed = set(df.loc[df["verdict"] == "fail", "oracle"])
    assert {"naive", "chunk_invariance", "first_token"} <= failed, \
        df[["case", "oracle", "verdict", "detail"]].to_string()


def wrapper_engine(lab: Path, name: str, damage: str, timeout: float = 300, real: Path | None = None,
                   supports: str = "{techniques: [chunk_prefill]}", more: str = "") -> None:
    """A host engine that runs testbed-c (or the program `real`) for real, then damages its response (python,
    `damage` given the response folder as `out`, the request's as `request`, the real program's path as `real`
    and numpy as `np`); `supports` and `more` (further yaml lines) say what its yaml declares."""
    real = real or kernel_build.build_programs("host") / "tb_model_engine"
    script = lab / f"{name}.py"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import json, subprocess, sys, time
        from pathlib import Path
        import numpy as np
        real = {str(real)!r}
        code = subprocess.run([real, sys.argv[1], sys.argv[2]]).returncode
        request, out = Path(sys.argv[1]), Path(sys.argv[2])
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
        supports: {supports}
        invoke: ["{{program}}", "{{request}}", "{{response}}"]
        timeout_s: {timeout}
        counts: process
        """) + textwrap.dedent(more))


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
    # a header claiming what no request allows: refused from the header, nothing allocated (was a MemoryError)
    "huge-header": ("a = np.load(out / 'logits.npy'); h = repr({'descr': '<f4', 'fortran_order': False, "
                    "'shape': (10**6, 10**6)}); h += ' ' * (-(len(h) + 11) % 64) + chr(10); "
                    "(out / 'logits.npy').write_bytes(b'\\x93NUMPY\\x01\\x00' + len(h).to_bytes(2, 'little') "
                    "+ h.encode() + a.tobytes())",
                    "response/logits.npy has shape (1000000, 1000000); the contract says (1, 256)"),
    "marks": ("t = json.loads((out / 'timings.json').read_text()); t['marks'] = 5; "
              "(out / 'timings.json').write_text(json.dumps(t))", "response/timings.json: marks=5 is not accepted"),
    "digits": ("(out / 'timings.json').write_text('{\"calls\": [{\"wall_s\": ' + '9' * 5000 + '}]}')",
               "response/timings.json is not JSON testbed reads: it holds an integer of more than 4300 digits"),
    "nested": ("(out / 'timings.json').write_text('[' * 5000 + ']' * 5000)",
               "response/timings.json is not JSON testbed reads: it nests deeper than"),
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


@pytest.mark.quick
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


def test_testbed_c_refuses_a_model_format_it_does_not_read(results_dir):
    """testbed's own engine answers a request it does not serve (a GGUF: it reads its safetensors file) with a
    refusal in its words, not a crash."""
    from refimpl import gemma
    from testbed import devices
    from testbed.backends.engine import build
    from testbed.backends.native.engine import export_weights
    from testbed.devices import load_profile

    cfg = gemma.tiny_config()
    spec = engine_spec.load("testbed-c")
    device = devices.connect(load_profile("host"))
    request = engine_runner.Request("hybrid", np.arange(8), export_weights(cfg, gemma.init_weights(cfg, 0)), "gguf",
                                    chunk=4, logits_at=[7])
    response = engine_runner.call(device, spec, request, engine_runner.Expect(cfg.vocab), build.program_for(spec, "host"))
    assert response.refused and "model.format=gguf" in response.reason


@pytest.mark.parametrize("text, said_", [
    ("name: x\ncontract: 2\n", "contract=2; accepted: 1"),
    ("name: x\ncontract: 1\nprogram: p\nabis: [host]\nsupports: {techniques: [chunk_prefil]}\ninvoke: ['{program}']\n"
     "build: {prebuilt: {host: p}}\n", "supports.techniques[0]='chunk_prefil' (did you mean 'chunk_prefill'?)"),
    ("name: x\ncontract: 1\nprogram: p\nabis: [host]\nsupports: {techniques: [tail]}\ninvoke: ['{program}']\n"
     "build: {prebuilt: {host: p}}\ntimeout: 3\n", "timeout is not a key (did you mean 'timeout_s'?)"),
    ("name: x\ncontract: [1\n", "is not YAML"),
    *[(f"name: x\ncontract: 1\nprogram: p\nabis: [host]\nsupports: {{techniques: [tail]}}\n{line}\n"
       "build: {prebuilt: {host: p}}\n", said) for line, said in (
        ("invoke: ['{program}', '{nosuch}']", "invoke[1]='{nosuch}' names {nosuch}; accepted: {program}, {request}, "
                                              "{response}"),
        ("invoke: ['{program}', 'a{b']", "invoke[1]='a{b' is not a template str.format reads"),
        ("invoke: ['{program};', '{request}']", "invoke[0]='{program};' is the program to start and holds ';'"),
        ("invoke: ['{program} x']", "invoke[0]='{program} x' is the program to start and holds ' '"),
        ("invoke: ['{{program}}']", "invoke=['{{program}}'] never names {program}"),
        ("invoke: ['{program}']\ntimeout_s: .inf", "timeout_s=inf; accepted: a finite number > 0 and <= 604800"),
        ("invoke: ['{program}']\nextra: &a [*a]", "repeats a value by an alias (*a)"))],
    ("name: x\ncontract: true\n", "contract=True; accepted: 1"),
    ("name: x\ncontract: 1.0\n", "contract=1.0; accepted: 1"),
    ("name: x\ncontract: 1\nprogram: p\nabis: [host]\nsupports: {techniques: [tail]}\ninvoke: ['{program}']\n"
     "source: .\nbuild: {command: [cc, '{nosuch}']}\n", "build.command[1]='{nosuch}' names {nosuch}; accepted: "
                                                        "{abi}, {out}, {source}, {jobs}, {python}"),
    ("name: x\ncontract: 1\nprogram: p\nabis: [host]\nsupports: {techniques: [tail]}\ninvoke: ['{program}']\n"
     "source: .\nbuild: {command: ['cc;', '{'] }\n", "build.command[0]='cc;' is the program to start"),
])
def test_a_bad_engine_yaml_is_one_line_naming_file_and_key(lab, text, said_):
    (lab / "engines").mkdir()
    (lab / "engines" / "x.yaml").write_text(text)
    with pytest.raises(UsageError, match="x.yaml") as e:
        engine_spec.load("x")
    assert said_ in str(e.value) and "\n" not in str(e.value)


BAD_ENGINE_FILES = {
    # a prebuilt file the device cannot start (was OSError: Exec format error, exit 1)
    "random prebuilt": ("build: {prebuilt: {host: ../prog}}", "build.prebuilt.host='../prog' begins"),
    # a link in the source tree a build command runs in (was a BuildError traceback)
    "link in source": ("source: ../src\nbuild: {command: [cc, -o, '{out}/prog', main.c]}",
                       "source='../src' holds a symbolic link"),
    # a lone brace in the build command (was ValueError from str.format)
    "lone brace": ("source: ../src\nbuild: {command: [cc, -o, '{out/prog', main.c]}",
                   "build.command[2]='{out/prog' is not a template str.format reads"),
}


@pytest.mark.parametrize("bad", list(BAD_ENGINE_FILES))
def test_a_bad_engine_yaml_exits_2_before_a_run_is_stored(lab, results_dir, bad):
    build, message = BAD_ENGINE_FILES[bad]
    (lab / "prog").write_bytes(bytes(range(256)) * 4)
    (lab / "src").mkdir()
    (lab / "src" / "main.c").write_text("int main(void) { return 0; }\n")
    (lab / "src" / "outside.h").symlink_to("/etc/hostname")
    (lab / "engines").mkdir()
    yaml = lab / "engines" / "x.yaml"
    yaml.write_text(f"name: x\ncontract: 1\nprogram: prog\nabis: [host]\nsupports: {{techniques: [chunk_prefill]}}\n"
                    f"invoke: ['{{program}}', '{{request}}', '{{response}}']\n{build}\n")
    p = cli("run", "chunk_prefill", "backend=engine", "engine=x", *SMALL,
            env={"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)})
    lines = said(p.stderr)
    assert p.returncode == 2 and len(lines) == 1 and message in lines[0] and str(yaml) in lines[0], p.stderr
    assert not (results_dir / "records.jsonl").exists()


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


def declining_engine(lab: Path, name: str, supports: str, abis: str = "[host]") -> None:
    """A lab's engine whose yaml declines what the case asks: testbed never runs it (its prebuilt program
    fails loudly if it ever does), since its yaml alone says no."""
    (lab / "engines").mkdir(parents=True, exist_ok=True)
    program = lab / "never-run"
    program.write_text("#!/bin/sh\necho this engine must never run >&2\nexit 99\n")
    program.chmod(0o755)
    (lab / "engines" / f"{name}.yaml").write_text(textwrap.dedent(f"""\
        name: {name}
        contract: 1
        build: {{prebuilt: {{host: ../never-run}}}}
        program: never-run
        abis: {abis}
        supports: {supports}
        invoke: ["{{program}}", "{{request}}", "{{response}}"]
        """))


DECLINED = {  # what the engine's yaml says, the run, the reason recorded
    "technique": ("{techniques: [tail]}", "[host]", ["chunk_prefill", *SMALL],
                  "does not support chunk_prefill (", "supports.techniques=['tail'])"),
    "tail": ("{techniques: [chunk_prefill]}", "[host]", ["tail", *TAIL_SMALL], "does not support tail (",
             "supports.techniques=['chunk_prefill'])"),
    "hybrid": ("{techniques: [chunk_prefill, tail]}", "[host]", ["hybrid", "mode=oracle"], "does not support hybrid (",
               "supports.techniques=['chunk_prefill', 'tail'])"),
    "abi": ("{techniques: [chunk_prefill, tail]}", "[host]", ["tail", *TAIL_SMALL, "device=qemu-aarch64"],
            "is not built for aarch64 (", "abis=['host']); device qemu-aarch64 runs aarch64 programs"),
    "weights": ("{techniques: [chunk_prefill], weights: [f32]}", "[host]",
                ["chunk_prefill", *SMALL, "native.weights=int8"], "does not take int8 weights (",
                "supports.weights=['f32'])"),
    "cache": ("{techniques: [tail], cache: [float32, float16]}", "[host]", ["tail", *TAIL_SMALL, "cache.dtype=int8"],
              "keeps no int8 cache (", "supports.cache=['float32', 'float16'])"),
}


@pytest.mark.parametrize("declined", list(DECLINED))
def test_what_an_engines_yaml_declines_is_not_supported_in_its_words_never_a_usage_or_device_error(lab, results_dir,
                                                                                                  declined):
    supports, abis, command, *said_ = DECLINED[declined]
    declining_engine(lab, "decliner", supports, abis)
    p = cli("run", *command, "backend=engine", "engine=decliner",
            env={"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)})
    assert p.returncode == 7, p.stderr  # nothing judged: neither a failure, a usage error nor a device error
    records = [json.loads(line) for line in (results_dir / "records.jsonl").read_text().splitlines()]
    oracles = [r for r in records if r.get("kind") == "oracle"]
    assert oracles and {r["verdict"] for r in oracles} == {"not supported"}
    for part in said_:
        assert all(part in r["detail"] for r in oracles), oracles[0]["detail"]
    assert all(r["detail"].startswith("engine=decliner ") and "decliner.yaml" in r["detail"] for r in oracles)


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


def test_ab_with_an_engine_its_yaml_does_not_build_for_the_device_is_not_supported_exit_7(lab, results_dir):
    declining_engine(lab, "hostonly", "{techniques: [chunk_prefill]}")
    p = cli("ab", "engine:testbed-c", "engine:hostonly", "experiment=chunk_prefill", "device=qemu-aarch64",
            env={"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)})
    assert p.returncode == 7, p.stderr  # nothing measured, nothing judged: neither "B is worse" nor an error
    assert "NOT SUPPORTED B (engine:hostonly) engine: engine=hostonly is not built for aarch64" in p.stdout, p.stdout
    assert "nothing measured" in p.stdout and "B is not worse" not in p.stdout


def test_a_build_tool_that_is_missing_exits_3(lab, results_dir):
    path = lab_engine(lab, "notool")
    path.write_text(path.read_text().replace('["cc", ', '["no-such-compiler-tb", '))
    p = cli("run", "chunk_prefill", "backend=engine", "engine=notool", *SMALL,
            env={"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)})
    assert p.returncode == 3 and "'no-such-compiler-tb' is not installed" in p.stderr, p.stderr



def test_a_kept_pad_row_in_the_tail_fails_the_state_bytes_oracle(lab, results_dir):
    """The padded tail's snapshot and rollback count one pad row too few, so one stays in the cache (a
    patched copy of kernels/model_prefill.c in the lab's engine source): state.bin differs from the
    unpadded append's, and the verdict says where."""
    patched_lab_engine(lab, "padkept", "model_prefill.c", "const int real = tail - 1, pads = chunk - real;",
                       "const int real = tail - 1, pads = chunk - real - 1;")
    df = run(["backend=engine", "engine=padkept", *TAIL_SMALL], experiment="tail").frame()
    state = df[df["oracle"] == "state_bytes"]
    assert len(state) and (state["verdict"] == "fail").any(), df[["case", "verdict", "detail"]].to_string()
    assert state.loc[state["verdict"] == "fail", "detail"].str.contains("state.bin").all()
    clean = run(["backend=engine", "engine=testbed-c", *TAIL_SMALL], experiment="tail").frame()
    assert (clean["verdict"] == "pass").all()


@pytest.mark.parametrize("delta, verdict", [(2e-3, "pass"), (5e-3, "fail")])
def test_chunk_prefill_judges_an_engine_within_the_precision_its_yaml_declares(lab, results_dir, delta, verdict):
    """An engine whose K/V differ from the reference by `delta` in one value (as another summation order does)
    and whose yaml declares tolerance.float32 = 3e-3: within it the cache oracle passes, past it fails; with
    engine_tolerance=false it is held to cache_atol (1e-3) and fails either way."""
    damage = f"""\
        if (out / "cache").is_dir():
            k = np.load(out / "cache" / "k_0.npy"); k[0, 1, 0] += {delta}; np.save(out / "cache" / "k_0.npy", k)
        """
    wrapper_engine(lab, "summed", damage, more="tolerance: {float32: 3.0e-3, measured: a planted 2e-3}\n")
    df = run(["backend=engine", "engine=summed", *SMALL]).frame()
    cache = df[df["oracle"] == "cache"]
    assert len(cache) and (cache["verdict"] == verdict).all(), df[["oracle", "verdict", "detail"]].to_string()
    assert (df.loc[df["oracle"] != "cache", "verdict"] == "pass").all()
    strict = run(["backend=engine", "engine=summed", "engine_tolerance=false", *SMALL]).frame()
    assert (strict.loc[strict["oracle"] == "cache", "verdict"] == "fail").all()


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


def test_the_schemas_request_and_timings_are_what_testbed_sends_and_testbed_c_writes(results_dir, monkeypatch):
    """engines/contract-v1.schema.json's $defs describe the contract whole: every request testbed makes (the three
    techniques, through the experiments) validates against $defs.request, whose objects admit no key they do not
    describe (a key testbed sends undocumented fails here), and testbed-c's timings.json against $defs.timings."""
    jsonschema = pytest.importorskip("jsonschema")
    from testbed.backends.engine import gemma as engine_gemma, hybrid as engine_hybrid, tail as engine_tail

    schema = engine_spec.schema()
    seen = []

    def recording(device, spec, request, expect, program, measured=False, say=None):
        response = engine_runner.call(device, spec, request, expect, program, measured, say)
        seen.append((json.loads(json.dumps(request.as_json())), response.timings))
        return response

    for module in (engine_gemma, engine_hybrid, engine_tail):
        monkeypatch.setattr(module, "call", recording)
    run(["backend=engine", "engine=testbed-c", *SMALL])
    run(["backend=engine", "engine=testbed-c", *TAIL_SMALL, "oracle.around_chunk=[[1,2]]"], experiment="tail")
    run(["backend=engine", "engine=testbed-c", "mode=oracle", "chunk=16", "oracle.past=[4]", "oracle.tokens=[12]",
         "oracle.tails=[5]", "oracle.chunks=[16]", "oracle.prompt_tokens=24"], experiment="hybrid")
    assert {request["technique"] for request, _ in seen} == {"chunk_prefill", "tail", "hybrid"}
    for request, timings in seen:
        jsonschema.validate(request, {**schema["$defs"]["request"], "$defs": schema["$defs"]})
        jsonschema.validate(timings, schema["$defs"]["timings"])


# --- where a failure is, and its replay ------------------------------------------------------------


def fail_lines(stdout: str) -> list[str]:
    """The FAIL lines, each rejoined from the terminal's width (its continuation lines start with two spaces)."""
    joined: list[str] = []
    inside = False
    for line in stdout.splitlines():
        if line.startswith("FAIL "):
            joined.append(line)
            inside = True
        elif inside and line.startswith("  "):
            joined[-1] += " " + line.strip()
        else:
            inside = False
    return joined


def replay_of(line: str) -> str:
    """The replay command a FAIL line (or an error line) names."""
    return line.split("replay: ", 1)[1].split(";")[0].strip()


@pytest.mark.parametrize("cache", [True, False], ids=["cache exposed", "no cache"])
def test_a_position_fault_after_the_first_call_is_located_and_its_request_replayed(lab, results_dir, cache):
    """The utterance's calls after its first get positions one too far (P=5, n=7, C=4: calls 0-3, 4, 5-8,
    9-11): the FAIL line names call 4 and its row 9, with cache/ the layer and head whose K first differs,
    and the command that replays the failing request, which the test runs as printed."""
    from testbed.backends.engine import build

    lab_engine(lab, "posfault", ("TB_FAULT_POSITION_AFTER_FIRST_CALL",))
    name = "posfault"
    if not cache:
        wrapper_engine(lab, "posfault-nocache", "import shutil; shutil.rmtree(out / 'cache', ignore_errors=True)",
                       real=build.program_for(engine_spec.load("posfault"), "host"))
        name = "posfault-nocache"
    env = {"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)}
    p = cli("run", "chunk_prefill", "backend=engine", f"engine={name}", *SMALL, env=env)
    assert p.returncode == 1, p.stderr
    failed = fail_lines(p.stdout)
    assert failed and all("where: chunk path (C=4) first differs at call 4 of 4 (rows 9-11), row 9 (position 9): "
                          in line for line in failed), p.stdout
    kv = "K/V first differ at row 9 (call 4), layer 0 head 0: K "
    assert all((kv in line) == cache for line in failed), p.stdout
    records = [json.loads(line) for line in (results_dir / "records.jsonl").read_text().splitlines()]
    [token] = [r for r in records if r.get("oracle") == "logits"]
    where = token["metrics"]["where"]
    assert where["paths"][0] | {"requests": 0} == {
        "path": "chunk", "chunk": 4, "calls": 4, "requests": 0, "call": 4, "call_rows": [9, 11], "row": 9,
        "token": where["paths"][0]["token"], "token_ref": where["paths"][0]["token_ref"],
        "max_abs_logit_diff": where["paths"][0]["max_abs_logit_diff"]}
    assert where["paths"][0]["max_abs_logit_diff"] > 1e-3
    kept = where["kept"][0]
    assert Path(kept["request_folder"], "request", "request.json").is_file()
    # the replay, as printed
    replayed = subprocess.run(replay_of(failed[0]), shell=True, capture_output=True, text=True, cwd=kernel_build.ROOT,
                              env={**os.environ, "PYTHONPATH": str(kernel_build.ROOT)})
    assert replayed.returncode == 0, replayed.stderr
    chunk_token = [r for r in records if r.get("oracle") == "token"][0]["metrics"]["token_chunk"]
    assert f"position 11: token {chunk_token} " in replayed.stdout, replayed.stdout
    # by hand, as the record says: the same logits
    by_hand = subprocess.run(kept["by_hand"], shell=True, capture_output=True, text=True)
    assert by_hand.returncode == 0, by_hand.stderr
    logits = np.load(Path(kept["request_folder"]) / "response" / "logits.npy")
    assert int(np.argmax(logits[0])) == chunk_token


def test_a_passing_run_asks_nothing_more_and_keeps_nothing(lab, results_dir):
    lab_engine(lab, "toy")
    df = run(["backend=engine", "engine=toy", *SMALL]).frame()
    assert (df["verdict"] == "pass").all()
    assert len(df["evidence"].iloc[0]) == 3  # the chunk path, its padded tail and the token-by-token path, nothing else
    assert not (results_dir / "engine-requests").exists()


def test_a_crashing_engine_keeps_its_request_and_evidence_and_is_replayed(lab, results_dir):
    wrapper_engine(lab, "crasher", "print('Segmentation fault (planted)', file=sys.stderr); code = 139")
    env = {"TESTBED_LAB": str(lab), "TESTBED_RESULTS": str(results_dir)}
    p = cli("run", "chunk_prefill", "backend=engine", "engine=crasher", *SMALL, env=env)
    assert p.returncode == 4, p.stderr
    [line] = [line for line in said(p.stderr) if "exited 139" in line]
    assert "request kept in " in line and "replay: python3 -m testbed engine replay" in line
    records = [json.loads(line) for line in (results_dir / "records.jsonl").read_text().splitlines()]
    [error] = [r for r in records if r.get("verdict") == "error"]
    [evidence] = error["evidence"]
    spec = engine_spec.load("crasher")
    assert evidence["ran"] == "crasher.py" and len(evidence["sha256"]) == 64 and "crasher.py" in evidence["command"]
    detail = evidence["detail"]
    assert detail["exit_status"] == 139 and detail["engine_yaml_sha256"] == spec.yaml_sha256
    folder = Path(detail["request_folder"])
    assert folder.name == detail["request_sha256"] and (folder / "request" / "tokens.npy").is_file()
    assert "Segmentation fault (planted)" in (folder / "stderr.txt").read_text()
    assert "gdb --args" in detail["under_gdb"] and detail["replay"] == replay_of(line)
    replayed = subprocess.run(replay_of(line), shell=True, capture_output=True, text=True, cwd=kernel_build.ROOT,
                              env={**os.environ, "PYTHONPATH": str(kernel_build.ROOT)})
    assert replayed.returncode == 4 and "the engine failed again" in replayed.stderr and "exited 139" in \
        replayed.stderr, replayed.stderr
    assert f"by hand:   cd {folder}" in replayed.stdout
    # a kept request that is not what ran is refused in one line, never run
    request = folder / "request" / "request.json"
    request.write_text(request.read_text().replace('"past": 5', '"past": 4'))
    edited = subprocess.run(replay_of(line), shell=True, capture_output=True, text=True, cwd=kernel_build.ROOT,
                            env={**os.environ, "PYTHONPATH": str(kernel_build.ROOT)})
    assert edited.returncode == 2 and f"not the {folder.name} it was kept as" in edited.stderr, edited.stderr


@pytest.mark.parametrize("args, message", [(["0123456789abcdef"], "names 0 kept requests"),
                                           (["xyz"], "is not a request's sha256"),
                                           (["nosuchrun", "1"], "kept no engine request")])
def test_replay_refuses_what_it_cannot_replay_in_one_line(results_dir, capsys, args, message):
    from testbed.cli import main

    assert main(["engine", "replay", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


# --- builds keyed by what they read ----------------------------------------------------------------


def readme_engine(lab: Path, kernels: Path) -> Path:
    """The README's yaml shape: the adapter in the lab's source folder, testbed's kernels compiled by
    absolute path from outside it (here a copy of kernels/)."""
    mine = lab / "mine"
    mine.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(kernels / "bench" / "tb_model_engine.c", mine / "adapter.c")
    outside = [str(kernels / s) for s in SOURCES if s != "bench/tb_model_engine.c"]
    command = ["cc", "-std=c11", "-O1", "-ffp-contract=off", "-fno-math-errno", "-I", str(kernels), "-I",
               str(kernels / "bench"), "-DTB_FUSED=0", '-DTB_SOURCE_HASH="mine"', "-o", "{out}/mine", "adapter.c",
               *outside, "-lm", "-pthread"]
    (lab / "engines").mkdir(exist_ok=True)
    (lab / "engines" / "mine.yaml").write_text(textwrap.dedent(f"""\
        name: mine
        contract: 1
        source: ../mine
        build:
          command: {json.dumps(command)}
        program: mine
        abis: [host]
        supports: {{techniques: [chunk_prefill], model_formats: [safetensors], weights: [f32]}}
        invoke: ["{{program}}", "{{request}}", "{{response}}"]
        timeout_s: 600
        counts: marked
        """))
    return lab / "engines" / "mine.yaml"


def test_editing_a_file_the_build_reads_outside_its_source_rebuilds(lab, results_dir, tmp_path):
    """A header outside `source`, named nowhere in the command, read by the compile: the compiler's
    dependency list keys the build, so a fault planted in it is built and fails the oracles."""
    from testbed.backends.engine import build

    kernels = tmp_path / "kernels"
    shutil.copytree(kernel_build.KERNELS_DIR, kernels, ignore=shutil.ignore_patterns("build", "*.o", "*.so"))
    readme_engine(lab, kernels)
    honest = run(["backend=engine", "engine=mine", *SMALL]).frame()
    assert (honest.loc[honest["oracle"] != "cache", "verdict"] == "pass").all(), honest[["oracle", "detail"]]
    program = build.program_for(engine_spec.load("mine"), "host")
    inputs = json.loads((program.parent / build.INPUTS_FILE).read_text())
    assert str((kernels / "tb_model.h").resolve()) in inputs["files"] and inputs["how"].startswith("the compiler's")
    assert build.program_for(engine_spec.load("mine"), "host") == program  # unchanged: reused
    header = kernels / "tb_model.h"
    header.write_text(header.read_text() + "\n#define TB_FAULT_CHUNK_OFF_BY_ONE 1\n")
    faulty = run(["backend=engine", "engine=mine", *SMALL]).frame()
    assert build.program_for(engine_spec.load("mine"), "host") != program
    assert {"logits", "naive"} <= set(faulty.loc[faulty["verdict"] == "fail", "oracle"]), faulty[["oracle", "detail"]]


def test_a_build_command_that_says_nothing_runs_at_every_use_and_one_that_lists_what_it_read_is_reused(lab):
    """A script reading a file outside `source` that it does not name: run again at every use, so the
    program follows the file; the same script leaving {out}/PROGRAM.d is reused until a listed file changes."""
    from testbed.backends.engine import build

    outside, runs = lab / "outside.txt", lab / "runs.txt"
    (lab / "src").mkdir()
    for name, depfile in (("says-nothing", ""), ("lists-inputs", f'echo "$1/prog: {outside}" > "$1/prog.d"')):
        outside.write_text("one\n")
        (lab / "src" / f"{name}.sh").write_text(f'cp {outside} "$1/prog"; echo run >> {runs}; {depfile}\n')
        (lab / "engines").mkdir(exist_ok=True)
        (lab / "engines" / f"{name}.yaml").write_text(textwrap.dedent(f"""\
            name: {name}
            contract: 1
            source: ../src
            build: {{command: [sh, {name}.sh, "{{out}}"]}}
            program: prog
            abis: [host]
            supports: {{techniques: [chunk_prefill]}}
            invoke: ["{{program}}", "{{request}}", "{{response}}"]
            """))
        runs.write_text("")
        first = build.program_for(engine_spec.load(name), "host")
        again = build.program_for(engine_spec.load(name), "host")
        assert first.read_text() == again.read_text() == "one\n"
        assert runs.read_text().count("run") == (2 if name == "says-nothing" else 1), name
        outside.write_text("two\n")
        assert build.program_for(engine_spec.load(name), "host").read_text() == "two\n", name
