"""Cross-checks against Hugging Face transformers, which defines what a Gemma 3 checkpoint means.

Tiny random Gemma 3 models are made and saved by transformers itself (non-default RoPE bases, linear
scaling of the global layers, a query scale other than 1/sqrt(head_dim), randomised norm weights so a
(1 + w) slip shows), in the config form transformers 5 saves and in the older one. They load through
testbed.models.checkpoints, directly and after a round trip through a GGUF in llama.cpp's layout, and must give
transformers' logits at every position and its K/V cache (eager attention), through refimpl.gemma, the
refimpl backend and its chunk path. Then refimpl.gdn against transformers' own gated delta rule.

Every comparison is an NMSE (testbed.oracles.numerical.nmse) under TOLERANCE: float32 on both sides, so about
1e-13 when right; each planted bug below lands orders of magnitude above it.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is made here: never reach for a hub

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
pytest.importorskip("transformers", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

from refimpl import gdn, gemma  # noqa: E402
from testbed import backends
from testbed.models import checkpoints  # noqa: E402
from testbed.oracles.numerical import nmse  # noqa: E402
from testbed.oracles.tokens import TokenCase  # noqa: E402

TOLERANCE = 1e-9
TOKENS = 20  # more than the window of 8: the local layers drop keys

# One tiny shape, RoPE and query scale chosen so that each default would be wrong.
SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24)
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5_000.0}}
# Gemma 3 27B's case at tiny size: llama.cpp keys it on the block count (62) and scales queries by
# 1/sqrt(hidden / heads) = 1/sqrt(12) instead of 1/sqrt(head_dim) = 1/sqrt(16).
SHAPE_62 = dict(SHAPE, vocab_size=64, hidden_size=48, intermediate_size=32, num_hidden_layers=62,
                num_attention_heads=4, num_key_value_heads=1, query_pre_attn_scalar=12)


def legacy_config(config: dict) -> dict:
    """The same model as transformers 4 saved it: bases and scaling at the top level, the sliding
    pattern instead of layer types."""
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")}
    rope = config["rope_parameters"]
    scaling = {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}
    return {**old, "rope_theta": rope["full_attention"]["rope_theta"],
            "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
            "rope_scaling": scaling if scaling["rope_type"] != "default" else None, "sliding_window_pattern": 6}


class Made:
    """A checkpoint folder saved by transformers, and transformers' own answers for one prompt."""

    def __init__(self, folder, model, tokens):
        self.folder, self.tokens = folder, tokens
        with torch.no_grad():
            out = model(torch.tensor(tokens)[None], use_cache=True)
        self.logits = out.logits[0].numpy()
        # per layer [kv_heads, rows, head_dim]; a sliding layer keeps only its last window - 1 rows
        self.k = [layer.keys[0].numpy() for layer in out.past_key_values.layers]
        self.v = [layer.values[0].numpy() for layer in out.past_key_values.layers]


def make(folder, shape: dict, rope: dict, seed: int) -> Made:
    torch.manual_seed(seed)
    config = Gemma3TextConfig(**shape, rope_parameters=json.loads(json.dumps(rope)), attn_implementation="eager")
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    tokens = np.random.default_rng(seed).integers(0, shape["vocab_size"], TOKENS)
    return Made(folder, model, tokens)


@pytest.fixture(scope="session")
def made(tmp_path_factory) -> Made:
    return make(tmp_path_factory.mktemp("hf") / "gemma3", SHAPE, ROPE, 0)


@pytest.fixture(scope="session")
def made_62(tmp_path_factory) -> Made:
    return make(tmp_path_factory.mktemp("hf62") / "gemma3", SHAPE_62, ROPE, 1)


@pytest.fixture(scope="session")
def legacy(made, tmp_path_factory) -> Made:
    """The same weights with the config rewritten in transformers 4's form; transformers must read it
    as the same model, or the legacy form here would not mean what the test says."""
    folder = tmp_path_factory.mktemp("legacy") / "gemma3"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(made.folder / "model.safetensors")
    config = json.loads((made.folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(legacy_config(config)))
    again = Made(folder, Gemma3ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval(), made.tokens)
    assert nmse(made.logits, again.logits) == 0.0
    return again


def errors(cfg: gemma.GemmaConfig, w: dict, want: Made) -> dict[str, float]:
    """NMSE against transformers of: refimpl.gemma's logits at every position (redecode) and its K/V
    (prefill_at); the refimpl backend's prefill_at; and its chunk path (12 cached positions, then 8
    tokens in chunks of 5: logits of the last position and the cache)."""
    tokens, last = want.tokens, len(want.tokens) - 1
    ref = np.stack([gemma.redecode(w, cfg, tokens, p) for p in range(len(tokens))])
    _, k, v = gemma.prefill_at(w, cfg, tokens, last)
    backend = backends.load("refimpl", "gemma").backend(w, cfg)
    backend_logits, bk, bv = backend.prefill_at(tokens, last)
    run = backend.utterance(tokens, TokenCase(past=12, tokens=8, chunk=5))

    def cache(ks, vs):
        rows = [hk.shape[1] for hk in want.k]  # compare the rows transformers keeps
        ours = [a[:, -r:] for a, r in zip(ks + vs, rows + rows)]
        return nmse(np.concatenate([a.ravel() for a in want.k + want.v]), np.concatenate([a.ravel() for a in ours]))

    return {"redecode logits": nmse(want.logits, ref), "prefill_at cache": cache(k, v),
            "backend logits": nmse(want.logits[last], backend_logits), "backend cache": cache(bk, bv),
            "chunk logits": nmse(want.logits[last], run.chunk_logits), "chunk cache": cache(run.k, run.v)}


def assert_agree(cfg, w, want: Made):
    bad = {name: e for name, e in errors(cfg, w, want).items() if not e < TOLERANCE}
    assert not bad, f"NMSE against transformers above {TOLERANCE:g}: {bad}"


def assert_caught(cfg, w, want: Made):
    errs = errors(cfg, w, want)
    assert min(errs.values()) > 1e3 * TOLERANCE, f"a planted bug went unseen: {errs}"


# --- Hugging Face folders -------------------------------------------------------------------------


def test_transformers5_config_loads_to_transformers_logits_and_cache(made):
    cfg, w = checkpoints.load_checkpoint(made.folder)
    assert (cfg.rope_local, cfg.rope_global, cfg.rope_scaling_global, cfg.query_pre_attn_scalar) == (100, 5000, 4, 24)
    assert_agree(cfg, w, made)


def test_transformers4_config_loads_to_transformers_logits_and_cache(legacy):
    cfg, w = checkpoints.load_checkpoint(legacy.folder)
    assert_agree(cfg, w, legacy)


def test_refimpl_directly_and_without_scaling_would_differ(made):
    """The scaled model really depends on each RoPE setting: dropping any one is caught."""
    cfg, w = checkpoints.load_checkpoint(made.folder)
    for wrong in (dict(rope_scaling_global=1.0), dict(rope_global=1_000_000.0), dict(rope_local=10_000.0),
                  dict(query_pre_attn_scalar=16.0)):
        assert nmse(made.logits[-1], gemma.redecode(w, replace(cfg, **wrong), made.tokens, TOKENS - 1)) > 1e-6, wrong


def test_planted_loader_reading_the_local_base_for_global_layers_is_caught(made, monkeypatch):
    read = checkpoints.hf_rope
    monkeypatch.setattr(checkpoints, "hf_rope", lambda hf, source: {**read(hf, source),
                                                                    "rope_global": read(hf, source)["rope_local"]})
    cfg, w = checkpoints.load_checkpoint(made.folder)
    assert_caught(cfg, w, made)


# --- GGUF in llama.cpp's layout ----------------------------------------------------------------------


def test_gguf_from_transformers_checkpoint_loads_to_transformers_logits(made, tmp_path):
    cfg, w = checkpoints.load_checkpoint(made.folder)
    cfg = replace(cfg, query_pre_attn_scalar=16.0)  # GGUF carries no query scale: llama.cpp's is 1/sqrt(head_dim)
    path = checkpoints.save_gguf(tmp_path / "m.gguf", cfg, w)
    loaded_cfg, loaded = checkpoints.load_checkpoint(path)
    assert loaded_cfg == cfg
    want = Made(made.folder, Gemma3ForCausalLM.from_pretrained(made.folder, attn_implementation="eager",
                                                               query_pre_attn_scalar=16).eval(), made.tokens)
    assert_agree(loaded_cfg, loaded, want)


def test_gguf_of_62_layers_takes_llamacpps_27b_query_scale(made_62, tmp_path):
    cfg, w = checkpoints.load_checkpoint(made_62.folder)
    assert cfg.query_pre_attn_scalar == 12 != cfg.head_dim
    loaded_cfg, loaded = checkpoints.load_checkpoint(checkpoints.save_gguf(tmp_path / "m.gguf", cfg, w))
    assert loaded_cfg.query_pre_attn_scalar == 12
    assert_agree(loaded_cfg, loaded, made_62)


def test_planted_gguf_norm_offset_slip_is_caught(made_62, tmp_path, monkeypatch):
    cfg, w = checkpoints.load_checkpoint(made_62.folder)
    path = checkpoints.save_gguf(tmp_path / "m.gguf", cfg, w)
    monkeypatch.setattr(checkpoints, "GGUF_NORM_SHIFT", 0.0)  # the loader forgets the converter's +1
    assert_caught(*checkpoints.load_checkpoint(path), made_62)


# --- Gated DeltaNet against transformers' torch fallbacks -------------------------------------------


@pytest.mark.parametrize("form", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
@pytest.mark.parametrize("model", ["qwen3_next", "qwen3_5"])
def test_gdn_matches_transformers_with_the_interleaved_head_map(model, form):
    """Qwen3-Next and Qwen3.5 run the gated delta rule with grouped value heads (3 per key head here)
    through these torch functions when no fused kernel is installed. They repeat_interleave the key
    heads, so value head h reads key head h // 3: refimpl.gdn's `interleaved` map, not llama.cpp's
    `tiled` one. 100 tokens cross one chunk boundary of 64 with a mild gate, so the state carries."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    x = gdn.draw_inputs(n_seqs=2, tokens=100, h_k=2, d=16, v_repeat=3, gate="mild", seed=3)
    # transformers' state is [.., d_k, d_v]; refimpl.gdn stores it transposed, as ggml does
    hf_out, hf_state = getattr(modeling, form)(
        *(torch.from_numpy(a) for a in (x.q, x.k, x.v, x.g, x.beta)),
        initial_state=torch.from_numpy(np.swapaxes(x.state, -1, -2).copy()), output_final_state=True)
    hf_out, hf_state = hf_out.numpy(), np.swapaxes(hf_state.numpy(), -1, -2)
    for ours in (gdn.gdn_serial, gdn.gdn_chunkwise):
        out, state = ours(*x.arrays(), head_map="interleaved")
        assert nmse(hf_out, out) < TOLERANCE and nmse(hf_state, state) < TOLERANCE, ours.__name__
        tiled_out, _ = ours(*x.arrays(), head_map="tiled")
        assert nmse(hf_out, tiled_out) > 1e-3, "the head maps must differ for this check to mean anything"


def test_transformers_reads_what_testbed_writes(tmp_path):
    """save_hf_folder writes config.json as transformers 5 does: transformers loads it into the model
    refimpl computes (scaled global RoPE, non-default bases and query scale)."""
    cfg = gemma.tiny_config(vocab=96, window=8, rope_local=100.0, rope_global=5_000.0, rope_scaling_global=4.0,
                            query_pre_attn_scalar=24.0)
    w = gemma.init_weights(cfg, 5)
    folder = checkpoints.save_hf_folder(tmp_path / "hf", cfg, w)
    model = Gemma3ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert_agree(cfg, w, Made(folder, model, np.random.default_rng(5).integers(0, 96, TOKENS)))


@pytest.mark.parametrize("name", ["GEMMA3_1B", "GEMMA3_4B_TEXT", "GEMMA3_27B_TEXT"])
def test_config_fields_and_defaults_are_what_transformers_resolves(name):
    """The loader's defaults (HF_DEFAULTS) and RoPE resolution against the installed transformers'
    own Gemma3TextConfig, on the forms of the released configs."""
    from tests import test_gemma_checkpoints as released

    given = getattr(released, name)
    ours = checkpoints.config_from_hf(given, name)
    theirs = Gemma3TextConfig(**given)
    rope = theirs.rope_parameters
    assert (ours.vocab, ours.hidden, ours.layers, ours.heads, ours.kv_heads, ours.head_dim, ours.mlp, ours.window) == \
        (theirs.vocab_size, theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads,
         theirs.num_key_value_heads, theirs.head_dim, theirs.intermediate_size, theirs.sliding_window)
    assert list(ours.layer_types) == [checkpoints.HF_LAYER_TYPES[t] for t in theirs.layer_types]
    assert (ours.rope_local, ours.rope_global) == (rope["sliding_attention"]["rope_theta"],
                                                   rope["full_attention"]["rope_theta"])
    assert ours.rope_scaling_global == rope["full_attention"].get("factor", 1.0)
    assert (ours.query_pre_attn_scalar, ours.rms_eps, ours.tie_embeddings) == \
        (theirs.query_pre_attn_scalar, theirs.rms_norm_eps, theirs.tie_word_embeddings)
