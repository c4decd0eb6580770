"""LiteRT as the engine under test (engines/litert.yaml): a transformers-made Gemma 3 exported by
engines/litert/export.py (litert-torch's generative export_hf: a prefill_C signature per chunk size, like seed
000's chunk graph, and a decode signature) and served by engines/litert/adapter.py through ai-edge-litert's
interpreter, judged against transformers and refimpl.

  token at position   P past positions and the utterance up to P + n - 1 in prefill_C calls (the partial ones
                      padded to C, as LiteRT-LM pads), then P + n - 1 through decode: transformers' argmax,
                      logits within TOLERANCE (NMSE) of both references
  cache               cache/ (the K/V the adapter holds between calls) equals transformers' K/V
  first token over C  C = 16, 32, 64, 128 (one export with four prefill signatures) give one token (opt-in:
                      the export takes minutes)
  refusals            tail, a chunk size the export has no signature for, ...: "refused" with the reason

Each oracle is shown failing on a fault planted in a copy of the adapter: the second utterance call's positions
one too far; the logits of the padded call's last row (a pad's) returned for the token, which is what the
export's own prefill logits (litert-torch's prefill_logits option: the last row) would give (seed 003: "the
chunk graph only emits the last row's logits (a pad's)").
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
pytest.importorskip("transformers", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
pytest.importorskip("litert_torch", reason="the litert extra: pip install 'testbed[litert]'", exc_type=ImportError)
pytest.importorskip("ai_edge_litert", reason="the litert extra: pip install 'testbed[litert]'", exc_type=ImportError)

from tests.exported_support import (ENGINES, NEEDS_EXPORT_MECHANISM, TOLERANCE, export, judge_token, make_gemma3,  # noqa: E402
                                    patched, prompt, serve, spec_of, transformers_token)
from testbed import cli  # noqa: E402
from testbed.devices import connect, load_profile  # noqa: E402
from testbed.oracles.numerical import nmse  # noqa: E402

PAST, TOKENS = 40, 52
ADAPTER = ENGINES / "litert" / "adapter.py"
CHUNKS = (16, 32, 64, 128)


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory):
    return make_gemma3(tmp_path_factory.mktemp("litert-hf") / "gemma3")


@pytest.fixture(scope="session")
def exported(gemma3):
    return export("litert", gemma3.folder, {"chunk": 16})


@pytest.fixture(scope="session")
def host():
    device = connect(load_profile("host"))
    yield device
    device.close()


@pytest.fixture(scope="session")
def spec():
    return spec_of("litert")


def token_at_position(gemma3, exported, host, spec, chunk, program=None):
    tokens = prompt(gemma3, PAST + TOKENS)
    response = serve(host, spec, exported, gemma3, tokens, past=PAST, chunk=chunk, program=program)
    assert response.status == "ok", response.reason
    return tokens, response


def test_the_export_has_a_prefill_signature_of_c_rows_and_a_decode_signature(exported):
    manifest = json.loads((exported / "manifest.json").read_text())
    assert manifest["prefill"] == {"16": "prefill_16"} and "decode" in manifest["signatures"]
    prefill = manifest["signatures"]["prefill_16"]
    assert {"tokens", "input_pos", "mask", "kv_cache_k_0", "kv_cache_v_5"} <= set(prefill["inputs"])
    assert "logits" not in prefill["outputs"] and "logits" in manifest["signatures"]["decode"]["outputs"]


@pytest.mark.parametrize("chunk", [16, 1])
def test_chunked_prefill_with_past_then_decode_gives_transformers_token(gemma3, exported, host, spec, chunk):
    tokens, response = token_at_position(gemma3, exported, host, spec, chunk=chunk)
    assert judge_token(response.logits[0], gemma3, tokens, PAST + TOKENS - 1) == []
    calls = [(c["name"], c["rows"]) for c in response.timings["calls"]]
    if chunk == 16:  # the past: 16 + 16 + 8 (padded); the utterance to P + n - 2: 16 * 3 + 3 (padded); decode
        assert calls == [("past", 16), ("past", 16), ("past", 8), ("chunk", 16), ("chunk", 16), ("chunk", 16),
                         ("chunk", 3), ("decode", 1)]
    else:
        assert calls == [("past", 1)] * PAST + [("chunk", 1)] * TOKENS


def test_the_cache_the_adapter_holds_is_transformers_cache(gemma3, exported, host, spec):
    tokens, response = token_at_position(gemma3, exported, host, spec, chunk=16)
    ks, vs = gemma3.transformers_cache(tokens)
    for layer, (k, v) in enumerate(zip(ks, vs)):
        rows = k.shape[1]
        assert response.cache_k[layer].shape[1] == PAST + TOKENS
        for theirs, ref in ((response.cache_k[layer][:, -rows:], k), (response.cache_v[layer][:, -rows:], v)):
            assert nmse(ref, theirs) < TOLERANCE, (layer, nmse(ref, theirs))


def test_a_position_offset_in_the_second_chunk_fails_the_token_oracle(gemma3, exported, host, spec, tmp_path):
    second = PAST + 16  # the utterance's second prefill call: its rows get positions one too far
    program = patched(ADAPTER, tmp_path, "positions = np.arange(call.start, call.start + call.rows, dtype=np.int32)",
                      "positions = np.arange(call.start, call.start + call.rows, dtype=np.int32) + "
                      f"int(call.name == 'chunk' and call.start == {second})")
    tokens, response = token_at_position(gemma3, exported, host, spec, chunk=16, program=program)
    problems = judge_token(response.logits[0], gemma3, tokens, PAST + TOKENS - 1)
    assert any("NMSE" in p for p in problems), problems


def test_the_last_prefill_row_instead_of_decode_fails_the_token_oracle(gemma3, exported, host, spec, tmp_path):
    """The fault the seed names: the token read from the chunk call's last row, which in a partial call is a pad's
    (planted as decode run at that pad row's position, with a pad token)."""
    program = patched(ADAPTER, tmp_path, "    return calls + [Call(\"decode\", \"decode\", end, 1, 1)]",
                      "    last = calls[-1]\n    return calls + [Call(\"decode\", \"decode\", last.start + last.rows - 1, 1, 1)]")
    tokens, response = token_at_position(gemma3, exported, host, spec, chunk=16, program=program)
    problems = judge_token(response.logits[0], gemma3, tokens, PAST + TOKENS - 1)
    assert any("NMSE" in p for p in problems), problems


@pytest.mark.slow_build  # an export with four prefill signatures: minutes
def test_the_first_token_is_the_same_for_every_chunk_size(gemma3, host, spec):
    exported = export("litert", gemma3.folder, {"chunk": ",".join(map(str, CHUNKS))})
    rows = {c: token_at_position(gemma3, exported, host, spec, chunk=c)[1].logits[0] for c in CHUNKS}
    assert len({int(np.argmax(r)) for r in rows.values()}) == 1, {c: int(np.argmax(r)) for c, r in rows.items()}
    for c in CHUNKS[1:]:
        assert nmse(rows[CHUNKS[0]][None], rows[c][None]) < TOLERANCE, c


REFUSED = [  # (request overrides, words the reason must hold)
    (dict(technique="tail", cache={"dtype": "float32", "window": 8, "sink": 0}), "technique=tail"),
    (dict(technique="hybrid"), "technique=hybrid"),
    (dict(chunk=32), "prefill signatures for C = 16"),
    (dict(weights="f16"), "weights=f16"),
    (dict(cache={"dtype": "int8", "window": 0, "sink": 0}), "cache.dtype=int8"),
    (dict(past=1000, chunk=16), "KV cache holds 1024 positions"),
    (dict(logits_at=[10, 19]), "one position, through decode"),
]


@pytest.mark.parametrize("overrides,words", REFUSED, ids=[w for _, w in REFUSED])
def test_what_the_export_cannot_do_is_refused_in_its_own_words(gemma3, exported, host, spec, overrides, words):
    n = overrides.get("past", 0) + 20
    response = serve(host, spec, exported, gemma3, prompt(gemma3, n), **overrides)
    assert response.refused and words in response.reason, response.reason


def test_the_exporter_refuses_a_bad_chunk_in_one_line(gemma3, tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, str(ENGINES / "litert" / "export.py"), str(gemma3.folder),
                             str(tmp_path / "out"), "--chunk=0"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--chunk=0" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


@NEEDS_EXPORT_MECHANISM
def test_testbed_run_passes_with_transformers_token_and_fails_with_a_wrong_one(gemma3, results_dir, capsys):
    args = ["device=host", "backend=engine", "engine=litert", "mode=oracle", f"model.checkpoint={gemma3.folder}",
            "chunk=16", f"cases=[{{past: {PAST}, tokens: {TOKENS}}}]"]
    token = transformers_token(gemma3, args, PAST + TOKENS)
    assert cli.main(["run", "chunk_prefill", *args, f"model.expected_token={token}"]) == 0, capsys.readouterr().out
    assert cli.main(["run", "chunk_prefill", *args, f"model.expected_token={(token + 1) % gemma3.vocab}"]) == 1

