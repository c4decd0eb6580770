"""ExecuTorch as the engine under test (engines/executorch.yaml): a transformers-made Gemma 3 exported by
engines/executorch/export.py (transformers' static-cache recipe, torch.export, XNNPACK lowering) and served by
engines/executorch/adapter.py through executorch's Python runtime, judged against transformers and refimpl.

  token at position   the last row (P + n - 1) after P past positions and n utterance tokens, both in calls
                      of C rows: transformers' argmax, logits within TOLERANCE (NMSE) of both references
  first token over C  C = 16, 32, 64, 128 (one export: its method takes any row count) give one token
  cache               cache/ (read back from the runtime's buffers) equals transformers' K/V
  tail                a padded tail rolled back leaves state.bin byte-identical to the unpadded path's
  refusals            what the export cannot do is "refused" with the reason, never an error or a pass

Each oracle is shown failing on a fault planted in a copy of the adapter: the second utterance call's positions
one too far; the first row of a call's logits returned for every position in it.

One export of the tiny model (cached by content in .cache/engine-exports-tests/): minutes cold under load,
then seconds. The `testbed run` tests need the exporter-based engine kind (NEEDS_EXPORT_MECHANISM).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
pytest.importorskip("transformers", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
pytest.importorskip("executorch", reason="the executorch extra: pip install 'testbed[executorch]'", exc_type=ImportError)

from tests.exported_support import (ENGINES, NEEDS_EXPORT_MECHANISM, TOLERANCE, export, judge_token, make_gemma3,  # noqa: E402
                                    patched, prompt, serve, spec_of, transformers_token)
from testbed import cli  # noqa: E402
from testbed.devices import connect, load_profile  # noqa: E402
from testbed.oracles.numerical import nmse  # noqa: E402

PAST, TOKENS = 40, 52  # n = 52 as in the seed's case; the past longer than the window of 8
ADAPTER = ENGINES / "executorch" / "adapter.py"


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory):
    return make_gemma3(tmp_path_factory.mktemp("executorch-hf") / "gemma3")


@pytest.fixture(scope="session")
def exported(gemma3):
    return export("executorch", gemma3.folder)


@pytest.fixture(scope="session")
def host():
    device = connect(load_profile("host"))
    yield device
    device.close()


@pytest.fixture(scope="session")
def spec():
    return spec_of("executorch")


def token_at_position(gemma3, exported, host, spec, chunk, program=None, past=PAST, n=TOKENS):
    tokens = prompt(gemma3, past + n)
    response = serve(host, spec, exported, gemma3, tokens, past=past, chunk=chunk, program=program)
    assert response.status == "ok", response.reason
    return tokens, response


@pytest.fixture(scope="session")
def chunked(gemma3, exported, host, spec):
    """The seed's plan at tiny size, C = 16: (tokens, response), read by several oracles (each adapter run
    starts torch and executorch: seconds of CPU)."""
    return token_at_position(gemma3, exported, host, spec, chunk=16)


def test_the_export_is_xnnpack_delegated_with_a_named_static_cache(exported):
    manifest = json.loads((exported / "manifest.json").read_text())
    assert manifest["xnnpack_partitions"] >= 1, manifest  # XNNPACK took the matmuls; a portable-only .pte would not
    assert manifest["max_positions"] == 1024 and manifest["model"]["layers"] == 6
    assert (exported / "model.pte").stat().st_size == manifest["artifact_bytes"]


def test_chunked_prefill_with_past_gives_transformers_token(gemma3, exported, chunked):
    tokens, response = chunked
    assert judge_token(response.logits[0], gemma3, tokens, PAST + TOKENS - 1) == []
    # the plan as the contract says: the past in calls of 16 (40 = 16 + 16 + 8), then 52 = 16 * 3 + 4
    calls = [(c["name"], c["rows"]) for c in response.timings["calls"]]
    assert calls == [("past", 16), ("past", 16), ("past", 8), ("chunk", 16), ("chunk", 16), ("chunk", 16), ("chunk", 4)]
    assert response.timings["engine"]["name"] == "executorch"
    assert response.evidence.detail["engine_reported"]["source_hash"] == \
        json.loads((exported / "manifest.json").read_text())["artifact_sha256"]


def test_the_cache_read_back_from_the_runtime_is_transformers_cache(gemma3, chunked):
    tokens, response = chunked
    ks, vs = gemma3.transformers_cache(tokens)
    for layer, (k, v) in enumerate(zip(ks, vs)):
        rows = k.shape[1]  # transformers keeps a sliding layer's last window - 1 rows; the export keeps all
        assert response.cache_k[layer].shape[1] == PAST + TOKENS
        for theirs, ref in ((response.cache_k[layer][:, -rows:], k), (response.cache_v[layer][:, -rows:], v)):
            assert nmse(ref, theirs) < TOLERANCE, (layer, nmse(ref, theirs))


def test_the_first_token_is_the_same_for_every_chunk_size(gemma3, exported, host, spec, chunked):
    rows = {c: token_at_position(gemma3, exported, host, spec, chunk=c)[1].logits[0] for c in (32, 64, 128)}
    rows[16] = chunked[1].logits[0]
    assert len({int(np.argmax(r)) for r in rows.values()}) == 1, {c: int(np.argmax(r)) for c, r in rows.items()}
    for c in (32, 64, 128):
        assert nmse(rows[16][None], rows[c][None]) < TOLERANCE, c


# The planted faults: a copy of the adapter with one line changed, run through the same contract path.
PLANTED = {
    "the second utterance call's positions one too far": (
        "rows, wall, cpu = engine.run(tokens[call.start:call.start + call.real], call.start, call.rows)",
        "rows, wall, cpu = engine.run(tokens[call.start:call.start + call.real], call.start + "
        "(call.name == 'chunk' and call.start == past + chunk), call.rows)"),
    "the call's first row's logits for every position": (
        "logits[i] = rows[position - call.start]", "logits[i] = rows[0]"),
}


@pytest.mark.parametrize("fault", PLANTED)
def test_a_planted_fault_in_the_adapter_fails_the_token_oracle(gemma3, exported, host, spec, tmp_path, fault):
    program = patched(ADAPTER, tmp_path, *PLANTED[fault])
    tokens, response = token_at_position(gemma3, exported, host, spec, chunk=16, program=program)
    problems = judge_token(response.logits[0], gemma3, tokens, PAST + TOKENS - 1)
    assert any("NMSE" in p for p in problems), (fault, problems)


TAIL = dict(technique="tail", chunk=16, state=True, cache={"dtype": "float32", "window": 8, "sink": 0})


@pytest.fixture(scope="session")
def unpadded_tail(gemma3, exported, host, spec):
    tokens = prompt(gemma3, 52, seed=2)  # three calls of 16 and a tail of 4 (padded with 12 rows, or 4 steps)
    return tokens, serve(host, spec, exported, gemma3, tokens, tail="none", **TAIL)


@pytest.mark.parametrize("mode", ["padded", "scalar"])
def test_a_tail_rolled_back_leaves_the_state_byte_identical_to_the_unpadded_one(gemma3, exported, host, spec,
                                                                                 unpadded_tail, mode):
    tokens, exact = unpadded_tail
    other = serve(host, spec, exported, gemma3, tokens, tail=mode, **TAIL)
    assert exact.status == other.status == "ok", (exact.reason, other.reason)
    assert exact.state.size == 6 * 2 * 2 * 52 * 16 * 4  # layers, K and V, kv_heads, rows, head_dim, float32
    if mode == "padded":  # the same rows computed in a call of 16 rows instead of 4: XNNPACK's rows are independent
        a, b = exact.state.read_bytes(), other.state.read_bytes()
        assert a == b, f"{sum(x != y for x, y in zip(a, b))} bytes differ"
    assert judge_token(other.logits[0], gemma3, tokens, 51) == []
    assert [c["name"] for c in other.timings["calls"]][-1] == ("tail" if mode == "padded" else "decode")


REFUSED = [  # (request overrides, words the reason must hold)
    (dict(technique="hybrid"), "technique=hybrid"),
    (dict(weights="f16"), "weights=f16"),
    (dict(cache={"dtype": "float16", "window": 0, "sink": 0}), "cache.dtype=float16"),
    (dict(technique="tail", cache={"dtype": "float32", "window": 8, "sink": 4}), "cache.sink=4"),
    (dict(technique="tail", cache={"dtype": "float32", "window": 16, "sink": 0}), "cache.window=16"),
    (dict(past=1020, chunk=64), "static KV cache holds 1024 positions"),
]


@pytest.mark.parametrize("overrides,words", REFUSED, ids=[w for _, w in REFUSED])
def test_what_the_export_cannot_do_is_refused_in_its_own_words(gemma3, exported, host, spec, overrides, words):
    n = overrides.get("past", 0) + 20
    response = serve(host, spec, exported, gemma3, prompt(gemma3, n), **overrides)
    assert response.refused and words in response.reason, response.reason


def test_the_adapter_refuses_a_folder_that_is_no_export(gemma3, tmp_path):
    (tmp_path / "request").mkdir()
    (tmp_path / "request" / "request.json").write_text(json.dumps({"contract": 1, "technique": "chunk_prefill"}))
    (tmp_path / "request" / "model").symlink_to(gemma3.folder)
    result = subprocess.run([sys.executable, str(ADAPTER), str(tmp_path / "request"), str(tmp_path / "response")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "manifest.json" in result.stderr and "export.py" in result.stderr, result.stderr
    assert not (tmp_path / "response" / "status.json").exists()


@pytest.mark.parametrize("argv,code,words", [
    (["{missing}", "{out}"], 2, "holds no config.json"),
    (["{model}", "{out}", "--max-positions=1"], 2, "--max-positions=1"),
])
def test_the_exporter_refuses_bad_arguments_in_one_line(gemma3, tmp_path, argv, code, words):
    fill = {"missing": str(tmp_path / "nothing"), "out": str(tmp_path / "out"), "model": str(gemma3.folder)}
    result = subprocess.run([sys.executable, str(ENGINES / "executorch" / "export.py"),
                             *(a.format(**fill) for a in argv)], capture_output=True, text=True, timeout=300)
    assert result.returncode == code and words in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_the_exporter_names_the_extra_when_executorch_is_missing(gemma3, tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "executorch.py").write_text("raise ImportError('No module named executorch (hidden by the test)')\n")
    result = subprocess.run([sys.executable, str(ENGINES / "executorch" / "export.py"), str(gemma3.folder),
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "PYTHONPATH": str(hide)})
    assert result.returncode == 3 and "testbed[executorch]" in result.stderr, result.stderr


# --- through testbed run, once the exporter-based engine kind is merged -----------------------------------


@NEEDS_EXPORT_MECHANISM
def test_testbed_run_passes_with_transformers_token_and_fails_with_a_wrong_one(gemma3, results_dir, capsys):
    args = ["device=host", "backend=engine", "engine=executorch", "mode=oracle", f"model.checkpoint={gemma3.folder}",
            "chunk=16", f"cases=[{{past: {PAST}, tokens: {TOKENS}}}]"]
    token = transformers_token(gemma3, args, PAST + TOKENS)
    assert cli.main(["run", "chunk_prefill", *args, f"model.expected_token={token}"]) == 0, capsys.readouterr().out
    assert cli.main(["run", "chunk_prefill", *args, f"model.expected_token={(token + 1) % gemma3.vocab}"]) == 1
