"""llama.cpp as the engine under test (engines/llamacpp.yaml): testbed's adapter tb_llama_engine serves
engine contract v1 requests with libllama, and testbed's oracles judge what llama.cpp computes.

The model is a tiny Gemma 3 made by transformers and converted by llama.cpp's own converter
(test_llamacpp_models' recipe): 6 layers, sliding window 8, so every sequence here is longer than the
window and llama.cpp's sliding cache evicts. The oracles:

  token at position   the chunk's last row (P + n - 1) after the past P was decoded in calls of C rows:
                      its argmax equals testbed's reference reading the same GGUF (refimpl) and
                      transformers' on the Hugging Face folder, its logits within llama.cpp's
                      tolerance of refimpl's (NMSE; ggml's float16-table GELU and own reductions)
  first token over C  C = 16, 32, 64, 128 give the same token
  rollback            a padded tail (pad rows then removed with llama_memory_seq_rm) leaves the
                      sequence's state bytes (llama_state_seq_get_data) identical to the unpadded
                      path's, f32 and f16 caches, with eviction; the next token equal
  continuation        (through `testbed run tail`) that state restored with llama_state_seq_set_data in
                      a fresh process decodes the next tokens as refimpl does, within llama.cpp's
                      declared tolerance (engines/llamacpp.yaml)

Each oracle is shown failing on a planted fault: the adapter's chunk off by one, a llama.cpp tree whose
KV cache stores K wrong, a rollback that keeps one pad row, an adapter whose state.bin is llama.cpp's
sequence 1 (empty) or the state from before its last llama_decode.

The requests are written here as the contract says (request.args + request.json + tokens.npy) and run
through testbed's device transports, so the same adapter bytes run on the host and under qemu-user.
libllama is a heavy build (minutes per ABI, cached by content): by default, `testbed run chunk_prefill` and
`testbed run tail` with backend=llamacpp on the host, chunk_prefill on qemu-aarch64, the rollback and the
planted faults that build in seconds once libllama is built (the adapter's off by one, the kept pad row) and
the refusals; the rest is opt-in (`-m slow_build`): every C, f16, the KV-corrupting tree (a second libllama),
the seed's FunctionGemma-shaped case, the direct requests on qemu-aarch64, qemu-hexagon.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
spm = pytest.importorskip("sentencepiece", reason="the full extra: pip install 'testbed[full]'", exc_type=ImportError)
gguf = pytest.importorskip("gguf", reason="the full extra: pip install 'testbed[full]'", exc_type=ImportError)
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

from refimpl import gemma  # noqa: E402
from testbed.backends.llamacpp import build, models  # noqa: E402
from testbed.backends.native.device import check_machine, runner_prefix, stage_program  # noqa: E402
from testbed.devices import connect, load_profile  # noqa: E402
from testbed.models import checkpoints  # noqa: E402
from testbed.oracles.numerical import nmse  # noqa: E402
from tests.cli_support import table_rows  # noqa: E402
from tests.test_llamacpp_models import ROPE, SHAPE, tokenizer_model  # noqa: E402

LLAMACPP_TOLERANCE = 1e-5  # as test_llamacpp_models: llama.cpp against float32 references
PAST, CHUNK_TOKENS = 40, 52  # n = 52 as in the seed's case; the past longer than the window of 8
CHUNKS = (16, 32, 64, 128)
TAIL_PAST = 260  # past + chunk beyond llama.cpp's 256-cell sliding cache: cells are reused, not only masked

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="the llama.cpp tree comes with its build tools")
AARCH64 = pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None or shutil.which("qemu-aarch64") is None,
                             reason="g++-aarch64-linux-gnu and qemu-user (scripts/bootstrap.sh --test)")


# --- the model --------------------------------------------------------------------------------------


@dataclass
class Model:
    folder: Path
    gguf: Path
    hf: "Gemma3ForCausalLM"
    vocab: int

    def transformers_logits(self, tokens: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.hf(torch.tensor(np.asarray(tokens, np.int64))[None]).logits[0, -1].numpy()

    def refimpl_logits(self, tokens: np.ndarray, position: int) -> np.ndarray:
        cfg, w = checkpoints.load_checkpoint(self.gguf)  # testbed's reading of the same GGUF
        return gemma.redecode(w, cfg, np.asarray(tokens), position)


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory) -> Model:
    folder = tmp_path_factory.mktemp("engine-hf") / "gemma3"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(sp := tokenizer_model())
    vocab = spm.SentencePieceProcessor(model_proto=sp).get_piece_size()
    torch.manual_seed(1)
    cfg = Gemma3TextConfig(vocab_size=vocab, **SHAPE, rope_parameters=json.loads(json.dumps(ROPE)),
                           attn_implementation="eager")
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    gguf_path = models.convert(build.sdist_source(), folder, folder.parent / "gemma3-f32.gguf")
    return Model(folder, gguf_path, model, vocab)


def prompt(model: Model, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, model.vocab, n).astype(np.int32)


# --- requests and responses (engine contract v1) -------------------------------------------------------


def flatten(request: dict, prefix: str = "") -> list[str]:
    lines = []
    for key, value in request.items():
        if isinstance(value, dict):
            lines += flatten(value, f"{prefix}{key}.")
        elif isinstance(value, (list, tuple)):
            lines.append(f"{prefix}{key}={','.join(map(str, value))}")
        elif isinstance(value, bool):
            lines.append(f"{prefix}{key}={int(value)}")
        elif value is not None:
            lines.append(f"{prefix}{key}={value}")
    return lines


@dataclass
class Response:
    status: dict
    logits: np.ndarray | None
    state: bytes | None
    timings: dict | None
    returncode: int
    stderr: str


def serve(device, program: Path, gguf_path: Path, tokens: np.ndarray, *, technique: str = "chunk_prefill",
          past: int, chunk: int, logits_at: list[int], tail: str = "none", dtype: str = "float32", window: int = 0,
          state: bool = False, timeout: float = 1800) -> Response:
    """One request served by the adapter on `device`: pushed, run, pulled."""
    check_machine(device, program)
    prog = stage_program(device, program)
    model = stage_program(device, gguf_path)  # pushed once per content, like a program
    run_dir = f"runs/{secrets.token_hex(6)}"
    request = {"contract": 1, "technique": technique,
               "model": {"format": "gguf", "file": f"../../../{model}", "weights": "f32"},
               "tokens": "tokens.npy", "n_tokens": len(tokens), "past": past, "chunk": chunk, "logits_at": logits_at,
               "tail": {"mode": tail}, "cache": {"dtype": dtype, "window": window, "sink": 0}, "state": state,
               "threads": 1, "bench": None, "count": False}
    try:
        with tempfile.TemporaryDirectory(prefix="tb-llama-engine-") as tmp:
            tmp = Path(tmp)
            (tmp / "request.json").write_text(json.dumps(request))
            (tmp / "request.args").write_text("\n".join(flatten(request)) + "\n")
            np.save(tmp / "tokens.npy", np.asarray(tokens, np.int32))
            for name in ("request.json", "request.args", "tokens.npy"):
                device.push(tmp / name, f"{run_dir}/request/{name}")
            device.run(["mkdir", "-p", f"{run_dir}/response"], timeout=60)
            result = device.run([*runner_prefix(device), f"../../{prog}", "request", "response"], timeout=timeout,
                                cwd=run_dir)
            if result.returncode != 0:
                return Response({}, None, None, None, result.returncode, result.stderr)
            device.pull(f"{run_dir}/response/status.json", tmp / "status.json")
            status = json.loads((tmp / "status.json").read_text())
            if status["status"] != "ok":
                return Response(status, None, None, None, 0, result.stderr)
            device.pull(f"{run_dir}/response/logits.npy", tmp / "logits.npy")
            device.pull(f"{run_dir}/response/timings.json", tmp / "timings.json")
            if state:
                device.pull(f"{run_dir}/response/state.bin", tmp / "state.bin")
            return Response(status, np.load(tmp / "logits.npy"), (tmp / "state.bin").read_bytes() if state else None,
                            json.loads((tmp / "timings.json").read_text()), 0, result.stderr)
    finally:
        device.run(["rm", "-rf", run_dir], timeout=60)


@pytest.fixture(scope="session")
def host():
    device = connect(load_profile("host"))
    yield device
    device.close()


@pytest.fixture(scope="session")
def qemu_aarch64():
    device = connect(load_profile("qemu-aarch64"))
    yield device
    device.close()


def engine(target: str, program: str = build.ENGINE, source: str = "") -> Path:
    return build.build(target, source, programs=(program,)).program(program)


# --- the oracles --------------------------------------------------------------------------------------


def token_at_position(model: Model, device, program: Path, chunk: int, past: int = PAST, n: int = CHUNK_TOKENS):
    """llama.cpp's logits at P + n - 1 and the references' (refimpl on the GGUF, transformers)."""
    tokens = prompt(model, past + n)
    position = past + n - 1
    response = serve(device, program, model.gguf, tokens, past=past, chunk=chunk, logits_at=[position])
    assert response.returncode == 0 and response.status == {"contract": 1, "status": "ok"}, response
    return response, response.logits[0], model.refimpl_logits(tokens, position), model.transformers_logits(tokens)


def judge_token(theirs: np.ndarray, refimpl: np.ndarray, hf: np.ndarray) -> list[str]:
    """What is wrong with llama.cpp's row (nothing: [])."""
    problems = []
    if int(np.argmax(refimpl)) != int(np.argmax(hf)):
        problems.append(f"the references disagree: refimpl {np.argmax(refimpl)} transformers {np.argmax(hf)}")
    if int(np.argmax(theirs)) != int(np.argmax(refimpl)):
        problems.append(f"token {np.argmax(theirs)} != the reference's {np.argmax(refimpl)}")
    error = nmse(refimpl[None], theirs[None])
    if not error < LLAMACPP_TOLERANCE:
        problems.append(f"NMSE {error:.3g} against refimpl (tolerance {LLAMACPP_TOLERANCE:g})")
    return problems


@pytest.mark.slow_build  # the default run has it through `testbed run` (test_backend_llamacpp_passes_...)
def test_llamacpps_chunked_prefill_with_past_gives_the_references_token_on_the_host(gemma3, host):
    program = engine("host")
    response, theirs, refimpl, hf = token_at_position(gemma3, host, program, chunk=16)
    assert judge_token(theirs, refimpl, hf) == []
    calls = response.timings["calls"]
    # the plan as the contract says: the past in calls of 16 (40 = 16 + 16 + 8), then 52 = 16 * 3 + 4
    assert [(c["name"], c["rows"]) for c in calls] == [("past", 16), ("past", 16), ("past", 8), ("chunk", 16),
                                                       ("chunk", 16), ("chunk", 16), ("chunk", 4)]
    assert all(c["counted"] for c in calls) and response.timings["marks"] == [c["name"] for c in calls]
    assert response.timings["engine"]["source_hash"] == build.source_hash(build.sdist_source())


@pytest.mark.slow_build
def test_the_first_token_is_the_same_for_every_chunk_size(gemma3, host):
    program = engine("host")
    rows = {c: token_at_position(gemma3, host, program, chunk=c)[1] for c in CHUNKS}
    tokens = {c: int(np.argmax(r)) for c, r in rows.items()}
    assert len(set(tokens.values())) == 1, tokens
    for c in CHUNKS[1:]:
        assert nmse(rows[CHUNKS[0]][None], rows[c][None]) < LLAMACPP_TOLERANCE, c


def test_an_adapter_whose_chunk_is_off_by_one_fails_the_token_oracle(gemma3, host):
    program = engine("host", "tb_llama_engine_plant_chunk_off_by_one")
    _, theirs, refimpl, hf = token_at_position(gemma3, host, program, chunk=16)
    problems = judge_token(theirs, refimpl, hf)
    assert any("NMSE" in p for p in problems), problems


@pytest.fixture(scope="session")
def kv_corrupt_tree(tmp_path_factory) -> Path:
    """The sdist's llama.cpp with one bug planted in its KV cache: K rows are stored at half their value
    (as a double-applied scale would); everything else byte for byte the same, so ccache rebuilds one file."""
    tree = tmp_path_factory.mktemp("llama-kv-corrupt") / "llama.cpp"
    shutil.copytree(build.sdist_source(), tree, ignore=lambda d, names: [n for n in names if Path(d).name == "llama.cpp"
                                                                           and n in build.NOT_BUILT])
    source = tree / "src" / "llama-kv-cache.cpp"
    text = source.read_text()
    store = "    // store the current K values into the cache\n    return ggml_set_rows(ctx, k, k_cur, k_idxs);"
    assert text.count(store) == 1, "the tree's cpy_k changed: update the planted patch"
    source.write_text(text.replace(store, "    k_cur = ggml_scale(ctx, k_cur, 0.5f);  // planted\n" + store))
    return tree


@pytest.mark.slow_build
def test_a_llamacpp_tree_that_corrupts_its_kv_cache_fails_the_token_oracle(gemma3, host, kv_corrupt_tree):
    program = engine("host", source=str(kv_corrupt_tree))
    _, theirs, refimpl, hf = token_at_position(gemma3, host, program, chunk=16)
    problems = judge_token(theirs, refimpl, hf)
    assert any("NMSE" in p for p in problems), problems


@pytest.fixture(scope="session")
def functiongemma_shaped(tmp_path_factory) -> Model:
    """A transformers-made Gemma 3 of FunctionGemma's shape (18 layers, 15 local with window 512, hidden
    640, 4 heads, 1 KV head, head size 256) with the small tokenizer: the seed's shape without its vocabulary."""
    folder = tmp_path_factory.mktemp("engine-hf") / "functiongemma-shaped"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(sp := tokenizer_model())
    vocab = spm.SentencePieceProcessor(model_proto=sp).get_piece_size()
    torch.manual_seed(3)
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                           query_pre_attn_scalar=256, attn_implementation="eager")
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    gguf_path = models.convert(build.sdist_source(), folder, folder.parent / "functiongemma-shaped-f32.gguf")
    return Model(folder, gguf_path, model, vocab)


@pytest.mark.slow_build
def test_the_seeds_case_800_past_52_tokens_chunk_64_gives_the_token_at_851(functiongemma_shaped, host):
    response, theirs, refimpl, hf = token_at_position(functiongemma_shaped, host, engine("host"), chunk=64, past=800,
                                                      n=52)
    assert [c["rows"] for c in response.timings["calls"] if c["name"] == "chunk"] == [52]  # one partial call
    assert judge_token(theirs, refimpl, hf) == []


# --- padded tail with rollback ---------------------------------------------------------------------------


def tail_pair(model: Model, device, program: Path, dtype: str, chunk: int = 16, mode: str = "padded"):
    """The padded path (`mode`) and the unpadded one for the same request: past 260, chunk of 52 tokens
    (three calls of 16 and a tail of 4, padded with 12 rows), the model's own sliding window (8)."""
    tokens = prompt(model, TAIL_PAST + CHUNK_TOKENS, seed=2)
    last = len(tokens) - 1
    common = dict(technique="tail", past=TAIL_PAST, chunk=chunk, logits_at=[last], dtype=dtype, window=8, state=True)
    exact = serve(device, program, model.gguf, tokens, tail="none", **common)
    padded = serve(device, program, model.gguf, tokens, tail=mode, **common)
    for r in (exact, padded):
        assert r.returncode == 0 and r.status["status"] == "ok", r
    return exact, padded


@pytest.mark.parametrize("dtype", ["float32", pytest.param("float16", marks=pytest.mark.slow_build)])
def test_a_rolled_back_padded_tail_leaves_llamacpps_state_byte_identical(gemma3, host, dtype):
    exact, padded = tail_pair(gemma3, host, engine("host"), dtype)
    assert len(exact.state) > 0
    assert padded.state == exact.state, f"{sum(a != b for a, b in zip(padded.state, exact.state))} bytes differ"
    assert int(np.argmax(padded.logits[0])) == int(np.argmax(exact.logits[0]))  # the next token
    assert [c["name"] for c in padded.timings["calls"]][-1] == "tail"


def test_a_rollback_that_keeps_one_pad_row_fails_the_state_oracle(gemma3, host):
    exact, padded = tail_pair(gemma3, host, engine("host", "tb_llama_engine_plant_keep_pad_row"), "float32")
    assert padded.state != exact.state


# --- an emulated device --------------------------------------------------------------------------------


@AARCH64
@pytest.mark.slow_build  # the default run has it through `testbed run` (test_backend_llamacpp_passes_..._aarch64)
def test_llamacpp_on_qemu_aarch64_gives_the_references_token(gemma3, qemu_aarch64):
    program = engine("aarch64")
    _, theirs, refimpl, hf = token_at_position(gemma3, qemu_aarch64, program, chunk=32)
    assert judge_token(theirs, refimpl, hf) == []


@AARCH64
@pytest.mark.slow_build
def test_llamacpp_on_qemu_aarch64_rolls_a_padded_tail_back_byte_identically(gemma3, qemu_aarch64):
    exact, padded = tail_pair(gemma3, qemu_aarch64, engine("aarch64"), "float32")
    assert padded.state == exact.state


@AARCH64
@pytest.mark.slow_build
def test_the_planted_chunk_off_by_one_fails_on_qemu_aarch64_too(gemma3, qemu_aarch64):
    program = engine("aarch64", "tb_llama_engine_plant_chunk_off_by_one")
    _, theirs, refimpl, hf = token_at_position(gemma3, qemu_aarch64, program, chunk=32)
    assert any("NMSE" in p for p in judge_token(theirs, refimpl, hf))


# --- through the contract: `testbed run chunk_prefill backend=llamacpp` ------------------------------------


def run_chunk_prefill(gguf_path: Path, device: str, *overrides) -> "pd.DataFrame":
    from testbed import config, runner

    outcome = runner.execute(config.load(["experiment=chunk_prefill", f"device={device}", "backend=llamacpp",
                                          "mode=oracle", f"model.checkpoint={gguf_path}", "chunk=16",
                                          f"cases=[{{past: {PAST}, tokens: {CHUNK_TOKENS}}}]", *overrides]))
    return outcome.frame().query("kind == 'oracle'").set_index("oracle")


def planted_lab(tmp_path: Path, program: str) -> Path:
    """A lab folder whose engines/llamacpp-planted.yaml is llamacpp.yaml with the planted adapter."""
    lab = tmp_path / "lab"
    (lab / "engines").mkdir(parents=True)
    text = (Path(build.ROOT) / "engines" / "llamacpp.yaml").read_text()
    text = text.replace("name: llamacpp", "name: llamacpp-planted").replace("tb_llama_engine", program)
    text = text.replace("source: ../testbed/backends/llamacpp", f"source: {build.HERE}")
    (lab / "engines" / "llamacpp-planted.yaml").write_text(text)
    return lab


def test_backend_llamacpp_passes_chunk_prefill_through_the_contract_on_the_host(gemma3, results_dir):
    verdicts = run_chunk_prefill(gemma3.gguf, "host")
    assert verdicts.loc["token", "verdict"] == "pass" and verdicts.loc["logits", "verdict"] == "pass", verdicts
    assert verdicts.loc["token", "backend"] == "engine:llamacpp"
    evidence = verdicts.loc["token", "evidence"][0]
    assert evidence["detail"]["engine_reported"]["source_hash"] == build.source_hash(build.sdist_source())
    assert evidence["detail"]["elf_machine_name"] and len(evidence["sha256"]) == 64


def test_backend_llamacpp_fails_chunk_prefill_with_the_adapters_chunk_off_by_one(gemma3, results_dir, tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("TESTBED_LAB", str(planted_lab(tmp_path, "tb_llama_engine_plant_chunk_off_by_one")))
    verdicts = run_chunk_prefill(gemma3.gguf, "host", "backend=engine", "engine=llamacpp-planted")
    assert verdicts.loc["logits", "verdict"] == "fail", verdicts[["verdict", "detail"]]
    # where (testbed.oracles.where): every call after the plan's first reads its tokens one row early, so the
    # second call (the past's rows 16-31 at C=16) is the first wrong one, from its first row; llama.cpp gives
    # several rows of one call, so that call's rows are asked in one request
    detail = verdicts.loc["logits", "detail"]
    assert "chunk path (C=16) first differs at call 2 of 7 (rows 16-31), row 16 (position 16): " in detail, detail
    assert verdicts.loc["logits", "metrics.where.paths"][0]["requests"] == 2


@AARCH64
def test_backend_llamacpp_passes_chunk_prefill_on_qemu_aarch64(gemma3, results_dir):
    verdicts = run_chunk_prefill(gemma3.gguf, "qemu-aarch64")
    assert verdicts.loc["token", "verdict"] == "pass" and verdicts.loc["logits", "verdict"] == "pass", verdicts
    assert verdicts.loc["token", "evidence"][0]["detail"]["elf_machine_name"] == "AArch64"


@AARCH64
@pytest.mark.slow_build
def test_backend_llamacpp_fails_chunk_prefill_on_qemu_aarch64_with_the_chunk_off_by_one(gemma3, results_dir, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setenv("TESTBED_LAB", str(planted_lab(tmp_path, "tb_llama_engine_plant_chunk_off_by_one")))
    verdicts = run_chunk_prefill(gemma3.gguf, "qemu-aarch64", "backend=engine", "engine=llamacpp-planted")
    assert verdicts.loc["logits", "verdict"] == "fail", verdicts[["verdict", "detail"]]


TAIL_SHAPE = ["shape.vocab=256", "shape.hidden=64", "shape.heads=2", "shape.kv_heads=1", "shape.head_dim=32",
              "shape.mlp=128", "chunk=32", "tail=[0,4,8]", "oracle.grid_windows=[16]"]


def run_tail(*overrides) -> "pd.DataFrame":
    from testbed import config, runner

    outcome = runner.execute(config.load(["experiment=tail", "device=host", "backend=llamacpp", "mode=oracle",
                                          *TAIL_SHAPE, *overrides]))
    return outcome, outcome.frame().query("kind == 'oracle'")


def test_backend_llamacpp_tail_rolls_back_and_continues_through_the_contract(results_dir):
    """`testbed run tail backend=llamacpp`: testbed writes its seeded model as a GGUF (one per window), the
    engine grid's padded tails rolled back give the unpadded path's state bytes, and each padded state,
    restored with llama_state_seq_set_data in a fresh process, decodes 4 more tokens as refimpl does; sink rows
    are "not supported" (llama.cpp has none), and the first token agrees with refimpl. Logits are judged within
    llama.cpp's declared tolerance (engines/llamacpp.yaml: ggml's measured floor, above testbed-c's 1e-3)."""
    outcome, df = run_tail("oracle.grid_sinks=[0,3]")
    for oracle in ("state_bytes", "state_continuation"):
        state = df[df["oracle"] == oracle]
        sinks = state["case"].str.contains("sink=3")
        assert (state[~sinks]["verdict"] == "pass").all() and len(state[~sinks]) == 5, state[["case", "verdict", "detail"]]
        assert (state[sinks]["verdict"] == "not supported").all() and "no sink rows" in state[sinks]["detail"].iloc[0]
    continued = df[df["oracle"] == "state_continuation"].iloc[0]
    assert continued["metrics.atol"] == 3e-3 and "llamacpp.yaml: tolerance.float32" in continued["metrics.atol_from"]
    first = df[df["oracle"] == "first_token"]
    assert len(first) > 0 and (first["verdict"] == "pass").all(), first[["case", "verdict", "detail"]]
    assert outcome.tally.exit_status() == 0


@pytest.mark.parametrize("program, says", [
    # llama.cpp's sequence 1 holds nothing: restored, the sequence ends before the prompt does
    ("tb_llama_engine_plant_state_wrong_sequence", "the restored sequence 0 ends at position -1"),
    # the state from before the tail's llama_decode: it ends at the full chunks
    ("tb_llama_engine_plant_state_before_last_call", "the restored sequence 0 ends at position"),
])
def test_an_adapter_whose_state_is_not_the_prompts_fails_tail(results_dir, tmp_path, monkeypatch, program, says):
    """Such an adapter agrees with itself (its padded and unpadded states are equally wrong): continued from its
    state, it fails; its agreement is not judged, never a pass."""
    monkeypatch.setenv("TESTBED_LAB", str(planted_lab(tmp_path, program)))
    outcome, df = run_tail("backend=engine", "engine=llamacpp-planted", "oracle.grid_sinks=[0]")
    continued = df[df["oracle"] == "state_continuation"]
    assert len(continued) == 5 and (continued["verdict"] == "fail").all(), continued[["case", "verdict", "detail"]]
    assert continued["detail"].str.contains(says, regex=False).all(), continued["detail"].iloc[0]
    assert "pass" not in set(df.loc[df["oracle"] == "state_bytes", "verdict"])
    assert outcome.tally.exit_status() == 1


def test_testbed_run_tail_backend_llamacpp_passes_at_its_defaults_and_a_planted_fault_fails(results_dir, tmp_path):
    """The CLI, every key at its default but mode=oracle (the default shape, suite and grid: ~40 s here): the
    honest llama.cpp exits 0 within its declared tolerance; the adapter whose chunk is off by one exits 1."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(build.ROOT), "TESTBED_RESULTS": str(results_dir)}
    honest = subprocess.run([sys.executable, "-m", "testbed", "run", "tail", "backend=llamacpp", "mode=oracle"],
                            capture_output=True, text=True, env=env)
    assert honest.returncode == 0, honest.stdout[-3000:] + honest.stderr[-3000:]
    planted = subprocess.run([sys.executable, "-m", "testbed", "run", "tail", "backend=engine", "engine=llamacpp-planted",
                              "mode=oracle", *TAIL_SHAPE], capture_output=True, text=True,
                             env={**env, "TESTBED_LAB": str(planted_lab(tmp_path, "tb_llama_engine_plant_chunk_off_by_one"))})
    assert planted.returncode == 1, planted.stdout[-3000:] + planted.stderr[-3000:]
    assert "first_token" in planted.stdout and "fail" in planted.stdout


@AARCH64
def test_a_sweep_over_c_on_qemu_aarch64_names_llamacpps_best_c_by_instructions(gemma3, results_dir):
    """Issue 31 item 3: `testbed sweep experiment=chunk_prefill backend=llamacpp chunk=...` gives the per-C
    table and, on an emulated device, the best C by instructions (never by its times)."""
    import subprocess
    import sys

    swept = subprocess.run([sys.executable, "-m", "testbed", "sweep", "experiment=chunk_prefill", "backend=llamacpp",
                            "chunk=16,32", "device=qemu-aarch64", f"model.checkpoint={gemma3.gguf}", "mode=bench",
                            "bench.past=32", "bench.reps=3", "bench.warmup=0"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(build.ROOT), "TESTBED_RESULTS": str(results_dir)})
    assert swept.returncode == 0, swept.stderr
    out = swept.stdout
    assert "no best C by time: the device is emulated" in out and "best C by instructions: " in out, out
    rows = table_rows(out)  # the jobs' settings (backend, device) said once above the rows where they would not fit
    assert len(rows) == 2 and ("backend: llamacpp; device: qemu-aarch64" in out
                               or all("| llamacpp | qemu-aarch64 |" in row for row in rows)), out


HEXAGON = pytest.mark.skipif(shutil.which("qemu-hexagon") is None, reason="qemu-user with Hexagon (scripts/bootstrap.sh --test)")


@HEXAGON
@pytest.mark.slow_build  # libllama built by zig for Hexagon: the slowest build of all (cached by content)
def test_backend_llamacpp_passes_chunk_prefill_on_qemu_hexagon(gemma3, results_dir):
    verdicts = run_chunk_prefill(gemma3.gguf, "qemu-hexagon")
    assert verdicts.loc["token", "verdict"] == "pass" and verdicts.loc["logits", "verdict"] == "pass", verdicts
    assert verdicts.loc["token", "evidence"][0]["detail"]["elf_machine_name"] == "QUALCOMM DSP6"


# --- refusals and bad input -----------------------------------------------------------------------------


def rewrite_gguf(src: Path, dst: Path, arch: str = "gemma3", drop: tuple = ()) -> Path:
    """A copy of a GGUF under another architecture name, or without some metadata keys."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_an_architecture_the_tree_lacks_is_refused_in_llamacpps_words(gemma3, host, tmp_path):
    odd = rewrite_gguf(gemma3.gguf, tmp_path / "gemma9.gguf", arch="gemma9")
    r = serve(host, engine("host"), odd, prompt(gemma3, 20), past=4, chunk=16, logits_at=[19])
    assert r.status["status"] == "refused" and "unknown model architecture: 'gemma9'" in r.status["reason"], r


def test_a_field_llamacpps_loader_refuses_is_an_error_quoting_it(gemma3, host, tmp_path):
    cut = rewrite_gguf(gemma3.gguf, tmp_path / "cut.gguf", drop=("gemma3.embedding_length",))
    r = serve(host, engine("host"), cut, prompt(gemma3, 20), past=4, chunk=16, logits_at=[19])
    assert r.returncode != 0 and r.status == {}
    assert "key not found in model: gemma3.embedding_length" in r.stderr.strip().splitlines()[-1], r.stderr


def test_what_llamacpps_cache_cannot_be_is_refused(gemma3, host):
    tokens = prompt(gemma3, 20)
    int8 = serve(host, engine("host"), gemma3.gguf, tokens, past=4, chunk=16, logits_at=[19], dtype="int8")
    assert int8.status["status"] == "refused" and "float32 and float16" in int8.status["reason"]
    window = serve(host, engine("host"), gemma3.gguf, tokens, past=4, chunk=16, logits_at=[19], window=32)
    assert window.status["status"] == "refused" and "n_swa=8" in window.status["reason"]


def test_ab_of_testbed_c_and_llamacpp_hands_each_its_own_format_and_gives_a_verdict(results_dir):
    """`testbed ab engine:testbed-c engine:llamacpp experiment=chunk_prefill`: testbed-c reads its safetensors
    file, llama.cpp testbed's GGUF of the same seeded model; six pairs interleaved, a verdict, no traceback."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "testbed", "ab", "engine:testbed-c", "engine:llamacpp",
                        "experiment=chunk_prefill", "bench.past=16", "chunk=8", "--reps", "6"], capture_output=True,
                       text=True,
                       env={**os.environ, "PYTHONPATH": str(build.ROOT), "TESTBED_RESULTS": str(results_dir)})
    assert p.returncode in (0, 1) and "Traceback" not in p.stderr, p.stderr
    records = [json.loads(line) for line in (results_dir / "records.jsonl").read_text().splitlines()]
    [ab] = [r["metrics"]["ab"] for r in records if r.get("kind") == "measure"]
    assert ab["a"] == "engine:testbed-c" and ab["b"] == "engine:llamacpp" and ab["pairs"] == 6
    assert ab["verdict"] in ("slower", "faster", "no change", "undecided")
    requests = {e["detail"]["request_sha256"] for r in records if r.get("kind") == "measure" for e in r["evidence"]}
    assert len(requests) == 2  # two requests: each engine's own model file and format
