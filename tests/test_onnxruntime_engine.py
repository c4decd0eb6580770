"""engine=onnxruntime (engines/onnxruntime: torch.onnx export with past key/values, run by onnxruntime's CPU
execution provider) under testbed's oracles, on a Gemma 3 checkpoint transformers makes here:

- the token at position P+n-1 passes with the token transformers gives there (model.expected_token) and
  fails with another; logits, cache (the present K/V it returns) and the float64 model pass alike;
- faults planted in a copy of the adapter (a lab's engine: a position offset in the utterance's second
  call; the call's first row's logits for the row asked) fail the oracles that must catch them;
- the padded tail with its pad rows removed equals the unpadded append byte for byte, and attention sinks
  are refused in the engine's words ("not supported");
- the seed's case (P=800, n=52, C=64 -> position 851) on a FunctionGemma-shaped tiny checkpoint: opt-in
  (-m slow_build: an 18-layer export);
- the exporter machinery (testbed.backends.engine.export) on small exporters written here: one export per
  content and key value, a heartbeat while it runs, a failing exporter one line quoting its first error
  (exit 4) that leaves nothing behind, a missing module exit 3 naming the extra, a bad export section one
  line naming the key.

Each model is exported once per content (.cache/exports/): a cold run exports the 4-layer checkpoint and
the tail's 2-layer model (about 30 s of CPU each); warm runs reuse them."""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
pytest.importorskip("onnxruntime", reason="the onnx extra: pip install 'testbed[onnx]'", exc_type=ImportError)
pytest.importorskip("onnxscript", reason="the onnx extra: pip install 'testbed[onnx]'", exc_type=ImportError)
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

from testbed.backends.engine.spec import PROJECT_ENGINES  # noqa: E402
from tests.test_engine_contract import cli  # noqa: E402

ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, query_pre_attn_scalar=16, sliding_window=16, num_hidden_layers=4,
             layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
PAST, TOKENS, CHUNK = 40, 13, 8   # the past beyond the window; the utterance in two calls, the second partial


class Made:
    def __init__(self, folder: Path, prompt: Path, token: int, vocab: int):
        self.folder, self.prompt, self.token, self.vocab = folder, prompt, token, vocab


def make_gemma3(folder: Path, shape: dict, past: int, tokens: int, seed: int = 1) -> Made:
    """A Gemma 3 checkpoint transformers makes and saves (norm weights drawn, not 0), a prompt of ids, and
    transformers' own token at position past + tokens - 1."""
    folder.mkdir(parents=True)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**shape, rope_parameters=json.loads(json.dumps(ROPE)),
                                               attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    ids = np.random.default_rng(seed).integers(0, shape["vocab_size"], past + tokens).astype(np.int64)
    np.save(folder.parent / "prompt.npy", ids)
    with torch.no_grad():
        logits = model(torch.tensor(ids)[None]).logits[0, -1]
    return Made(folder, folder.parent / "prompt.npy", int(torch.argmax(logits)), shape["vocab_size"])


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Made:
    return make_gemma3(tmp_path_factory.mktemp("onnx-hf") / "gemma3", SHAPE, PAST, TOKENS)


def oracle_run(made: Made, engine: str, expected: int, results: Path, *extra, past=PAST, tokens=TOKENS, chunk=CHUNK,
               env=None):
    done = cli("run", "chunk_prefill", "backend=engine", f"engine={engine}", "mode=oracle",
               f"model.checkpoint={made.folder}", f"model.prompt={made.prompt}", f"model.expected_token={expected}",
               f"cases=[{{past: {past}, tokens: {tokens}}}]", f"chunk={chunk}", *extra,
               env={"TESTBED_RESULTS": str(results), **(env or {})})
    records = [json.loads(line) for line in (results / "records.jsonl").read_text().splitlines()] \
        if (results / "records.jsonl").is_file() else []
    verdicts = {r["oracle"]: r["verdict"] for r in records if r.get("kind") == "oracle"}
    return done, verdicts, records


def test_the_token_transformers_gives_passes_and_another_fails(gemma3, tmp_path):
    done, verdicts, records = oracle_run(gemma3, "onnxruntime", gemma3.token, tmp_path / "right")
    assert done.returncode == 0, done.stdout + done.stderr
    assert verdicts == {"token": "pass", "logits": "pass", "cache": "pass", "naive": "pass"}, done.stdout
    evidence = next(r for r in records if r.get("oracle") == "token")["evidence"][0]["detail"]
    # what ran: the export (its size, its key) and the engine process's peak memory
    assert evidence["export_bytes"] > 0 and evidence["exporter_versions"]["onnxruntime"].startswith("onnxruntime==")
    assert evidence["peak_rss_bytes"] > 10 << 20, evidence  # a Python process with onnxruntime loaded
    wrong = (gemma3.token + 1) % gemma3.vocab
    done, verdicts, _ = oracle_run(gemma3, "onnxruntime", wrong, tmp_path / "wrong")
    assert done.returncode == 1 and verdicts["token"] == "fail", done.stdout + done.stderr


def faulty_engine(lab: Path, name: str, replace: tuple[str, str]) -> None:
    """lab/engines/NAME.yaml: engines/onnxruntime with its adapter patched (a bug in the adapter; the
    exporter is the project's, so the export is shared with engine=onnxruntime)."""
    source = lab / f"{name}-src"
    shutil.copytree(PROJECT_ENGINES / "onnxruntime", source, ignore=shutil.ignore_patterns("__pycache__"))
    adapter = source / "adapter.py"
    text = adapter.read_text()
    assert text.count(replace[0]) == 1, replace[0]
    adapter.write_text(text.replace(*replace))
    yaml = (PROJECT_ENGINES / "onnxruntime.yaml").read_text()
    yaml = yaml.replace("name: onnxruntime", f"name: {name}").replace("source: onnxruntime", f"source: ../{name}-src")
    (lab / "engines").mkdir(exist_ok=True)
    (lab / "engines" / f"{name}.yaml").write_text(yaml)


FAULTS = {
    # the utterance's second call rotated one position too far (RoPE), its mask and cache rows unchanged
    "second-call-position": (("position = s ", f"position = s + (s == past + chunk) "), ("logits", "cache")),
    # the call's first row's logits handed back for the row asked (the select vector ignored)
    "first-row-logits": (("rows = [p - s for p in at]", "rows = [0 for p in at]"), ("logits", "naive")),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_planted_adapter_faults_fail(gemma3, tmp_path, fault):
    lab = tmp_path / "lab"
    lab.mkdir()
    replace, failing = FAULTS[fault]
    faulty_engine(lab, "onnx-faulty", replace)
    done, verdicts, _ = oracle_run(gemma3, "onnx-faulty", gemma3.token, tmp_path / "results",
                                   env={"TESTBED_LAB": str(lab)})
    assert done.returncode == 1, done.stdout + done.stderr
    for oracle in failing:
        assert verdicts[oracle] == "fail", (oracle, verdicts, done.stdout)
    table = cli("table", "chunk_prefill", "--format", "json", env={"TESTBED_RESULTS": str(tmp_path / "results")})
    [row] = json.loads(table.stdout)["engines"]  # the engines table says it too
    assert row["engine"] == "onnx-faulty" and row["verdict"] == "fail", row


def test_padded_tail_rolls_back_byte_for_byte_and_sinks_are_refused(tmp_path):
    results = tmp_path / "results"
    done = cli("run", "tail", "backend=engine", "engine=onnxruntime", "mode=oracle", "chunk=8", "tail=[3]",
               "shape.hidden=64", "shape.layers=2", "shape.heads=2", "shape.kv_heads=1", "shape.head_dim=32",
               "shape.mlp=128", "shape.vocab=256", "shape.window=16", "oracle.grid_windows=[16]",
               env={"TESTBED_RESULTS": str(results)})
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (results / "records.jsonl").read_text().splitlines()]
    oracles = [r for r in records if r.get("kind") == "oracle"]
    by_sink = {}
    for r in oracles:
        if r["oracle"] == "state_bytes":
            by_sink.setdefault(r["params"]["sink"], set()).add(r["verdict"])
    assert by_sink == {0: {"pass"}, 3: {"not supported"}}, by_sink
    refused = next(r for r in oracles if r["verdict"] == "not supported")
    assert "no attention sinks" in refused["detail"]
    assert {r["verdict"] for r in oracles if r["oracle"] == "first_token"} == {"pass"}


@pytest.mark.slow_build
def test_the_seed_case_at_position_851_on_a_functiongemma_shaped_checkpoint(tmp_path):
    """FunctionGemma's layout (18 layers: 5 local then 1 global, three times; 4 heads, 1 KV head, window
    512, RoPE bases 10k and 1M) at a small width; the seed's case P=800, n=52, C=64 -> position 851."""
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
                 head_dim=32, query_pre_attn_scalar=32, sliding_window=512, num_hidden_layers=18,
                 layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(18)])
    made = make_gemma3(tmp_path / "functiongemma-tiny", shape, 800, 52)
    done, verdicts, records = oracle_run(made, "onnxruntime", made.token, tmp_path / "results", past=800, tokens=52,
                                         chunk=64)
    assert done.returncode == 0 and set(verdicts.values()) == {"pass"}, done.stdout + done.stderr
    token = next(r for r in records if r.get("oracle") == "token")
    assert token["params"]["position"] == 851


# --- the exporter machinery (testbed.backends.engine.export), on small exporters written here -----------


def lab_exporter(lab: Path, name: str, script: str, modules=("json",), keys=()) -> Path:
    """lab/engines/NAME.yaml whose exporter is `script` (Python) and whose program is never run."""
    source = lab / f"{name}-src"
    source.mkdir(parents=True)
    (source / "export.py").write_text(textwrap.dedent(script))
    (source / "adapter.py").write_text("#!/bin/sh\nexit 0\n")
    command = ["{python}", "{source}/export.py", "{model}", "{out}", *(f"--{k}={{{k}}}" for k in keys)]
    (lab / "engines").mkdir(exist_ok=True)
    (lab / "engines" / f"{name}.yaml").write_text(textwrap.dedent(f"""\
        name: {name}
        contract: 1
        source: ../{name}-src
        export: {{command: {json.dumps(command)}, extra: onnx, modules: {json.dumps(list(modules))},
                 keys: {json.dumps(list(keys))}}}
        build: {{prebuilt: {{host: ../{name}-src/adapter.py}}}}
        program: adapter.py
        abis: [host]
        supports: {{techniques: [chunk_prefill], model_formats: [hf]}}
        invoke: ["{{program}}", "{{request}}", "{{response}}"]
        """))
    return lab / "engines" / f"{name}.yaml"


COUNTING = """\
    import os, pathlib, sys, time
    model, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    with open(os.environ["RUNS"], "a") as runs:  # outside the exporter's source, which keys its exports
        runs.write(" ".join(sys.argv[3:]) + "\\n")
    time.sleep(float(os.environ.get("SLEEP", "0")))
    (out / "graph.bin").write_bytes((model / "config.json").read_bytes() + b" ".join(a.encode() for a in sys.argv[3:]))
    """


@pytest.fixture
def hf_folder(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gemma3_text"}\n')
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


@pytest.fixture
def exports(tmp_path, monkeypatch):
    from testbed.backends.engine import export

    monkeypatch.setattr(export, "CACHE_DIR", tmp_path / "exports")
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    return export


def test_an_export_is_made_once_per_content_and_per_key_value(lab_dir, hf_folder, exports, tmp_path):
    from testbed.backends.engine import spec

    lab_exporter(lab_dir, "counted", COUNTING, keys=("chunk",))
    engine = spec.load("counted")
    said = []
    first = exports.exported(engine, hf_folder, {"chunk": 32}, said.append)
    again = exports.exported(engine, hf_folder, {"chunk": 32}, said.append)
    other = exports.exported(engine, hf_folder, {"chunk": 64}, said.append)
    runs = (tmp_path / "runs").read_text().splitlines()
    assert runs == ["--chunk=32", "--chunk=64"] and not first.cached and again.cached and not other.cached
    assert again.folder == first.folder != other.folder
    assert first.size_bytes == len((first.folder / "graph.bin").read_bytes())
    (hf_folder / "model.safetensors").write_bytes(b"other weights")  # new content: a new export
    assert not exports.exported(engine, hf_folder, {"chunk": 32}, said.append).cached
    assert any(line.startswith("exporting counted") for line in said)


def test_a_long_export_says_it_is_alive(lab_dir, hf_folder, exports, monkeypatch):
    from testbed.backends.engine import spec

    monkeypatch.setenv("TESTBED_HEARTBEAT_S", "0.2")
    monkeypatch.setenv("SLEEP", "1.0")
    lab_exporter(lab_dir, "slow", COUNTING)
    said = []
    exports.exported(spec.load("slow"), hf_folder, {}, said.append)
    assert any(re.fullmatch(r"still exporting slow \(\d+ s\)", line) for line in said), said


BROKEN = {
    "raises": ("""\
        import sys
        def lower(layer):
            raise ValueError(f"unsupported op aten::frobnicate in layer {layer}")
        try:
            lower(3)
        except ValueError as e:
            raise RuntimeError("lowering failed") from e
        """, "ValueError: unsupported op aten::frobnicate in layer 3"),
    "writes nothing": ("import sys\n", "wrote nothing"),
    "writes a link": ("import os, sys\nos.symlink('/etc/passwd', os.path.join(sys.argv[2], 'graph.bin'))\n",
                      "wrote a link 'graph.bin'"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_failing_exporter_is_one_line_exit_4_and_leaves_nothing(lab_dir, hf_folder, exports, case):
    from testbed.backends.engine import spec

    script, quoted = BROKEN[case]
    lab_exporter(lab_dir, "broken", script)
    with pytest.raises(exports.ExportFailed) as e:
        exports.exported(spec.load("broken"), hf_folder, {}, lambda m: None)
    assert e.value.exit_status == 4 and quoted in str(e.value) and "\n" not in str(e.value)
    assert not [p for p in exports.CACHE_DIR.iterdir() if p.is_dir()]  # no export left that reads as made


def test_a_missing_exporter_module_is_exit_3_naming_the_extra(lab_dir, hf_folder, exports):
    from testbed.backends.engine import spec
    from testbed.errors import ToolMissing

    lab_exporter(lab_dir, "unready", COUNTING, modules=("json", "no_such_exporter_module.lowering"))
    with pytest.raises(ToolMissing) as e:
        exports.exported(spec.load("unready"), hf_folder, {}, lambda m: None)
    assert e.value.exit_status == 3 and "'no_such_exporter_module.lowering'" in str(e.value)
    assert "pip install 'testbed[onnx]'" in str(e.value)


@pytest.fixture
def lab_dir(tmp_path, monkeypatch):
    folder = tmp_path / "lab"
    folder.mkdir()
    monkeypatch.setenv("TESTBED_LAB", str(folder))
    return folder


BAD_EXPORT_SECTIONS = {
    "an unknown placeholder": ('"{out}"]', '"{out}", "--c={chunk}"]', "export.command names {chunk}"),
    "no {out}": ('"{model}", "{out}"]', '"{model}"]', "must name {model} and {out}"),
    "no extra": ("extra: onnx, ", "", "export.extra is missing"),
    "a key the request has not": ('keys: []', 'keys: [tokens]', "export.keys[0]='tokens'"),
    "a folder format": ("model_formats: [hf]", "model_formats: [safetensors]", "export needs supports.model_formats"),
}


@pytest.mark.parametrize("case", BAD_EXPORT_SECTIONS)
def test_a_bad_export_section_is_one_line_naming_the_key(lab_dir, case):
    from testbed.backends.engine import spec
    from testbed.errors import UsageError

    yaml = lab_exporter(lab_dir, "bad", COUNTING)
    old, new, said = BAD_EXPORT_SECTIONS[case]
    assert old in yaml.read_text(), old
    yaml.write_text(yaml.read_text().replace(old, new))
    with pytest.raises(UsageError) as e:
        spec.load("bad")
    assert said in str(e.value) and str(yaml) in str(e.value) and "\n" not in str(e.value)
