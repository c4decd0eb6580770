"""Checkpoints and prompts: real-format files written by the formats' own packages (safetensors,
gguf) load into the same logits as the weights held in memory; mismatches name the tensor."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from refimpl import gemma
from testbed import checkpoints, prompts
from testbed.errors import UsageError

CFG = gemma.tiny_config(vocab=96, layers=6, window=8)
TOKENS = np.random.default_rng(0).integers(0, 96, 20)


@pytest.fixture(scope="module")
def weights():
    return gemma.init_weights(CFG, 7)


@pytest.fixture(scope="module")
def logits(weights):
    return gemma.redecode(weights, CFG, TOKENS, 19)


def test_hf_folder_gives_the_same_logits(tmp_path, weights, logits):
    folder = checkpoints.save_hf_folder(tmp_path / "hf", CFG, weights)
    assert set(load_file(str(folder / "model.safetensors"))) == set(weights)  # the library reads what we wrote
    cfg, loaded = checkpoints.load_checkpoint(folder)
    assert cfg == CFG
    assert np.array_equal(gemma.redecode(loaded, cfg, TOKENS, 19), logits)


def test_hf_folder_bf16_and_sharded(tmp_path, weights, logits):
    """Gemma is released in bfloat16 across shards: a bf16 value is the top half of a float32."""
    folder = tmp_path / "hf"
    checkpoints.save_hf_folder(folder, CFG, weights)
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    truncated = {k: ((v.view(np.uint32) >> 16) << 16).view(np.float32) for k, v in weights.items()}
    for shard, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        # safetensors' numpy API has no bfloat16, so write F32 and rewrite the header as BF16 halves
        raw = {k: (weights[k].view(np.uint32) >> 16).astype(np.uint16) for k in part}
        path = folder / f"model-0000{shard + 1}.safetensors"
        save_file(raw, str(path))
        data = bytearray(path.read_bytes())
        n = int.from_bytes(data[:8], "little")
        header = data[8:8 + n].replace(b'"U16"', b'"BF16"')
        path.write_bytes(len(header).to_bytes(8, "little") + bytes(header) + bytes(data[8 + n:]))
    cfg, loaded = checkpoints.load_checkpoint(folder)
    assert all(np.array_equal(loaded[k], truncated[k]) for k in weights)
    got = gemma.redecode(loaded, cfg, TOKENS, 19)
    assert np.abs(got - logits).max() < 0.1 and np.abs(got - logits).max() > 0  # bf16 rounding, not a bug


def test_gguf_gives_the_same_logits(tmp_path, weights, logits):
    path = checkpoints.save_gguf(tmp_path / "m.gguf", CFG, weights)
    reader = gguf.GGUFReader(path)
    stored = {t.name: t for t in reader.tensors}
    # llama.cpp's converter convention: Gemma's norm weights stored with the +1 folded in
    np.testing.assert_allclose(stored["blk.0.attn_norm.weight"].data,
                               weights["model.layers.0.input_layernorm.weight"] + 1, rtol=0, atol=1e-7)
    assert stored["blk.2.ffn_gate.weight"].data.shape == (CFG.mlp, CFG.hidden)
    cfg, loaded = checkpoints.load_checkpoint(path)
    assert cfg == CFG
    np.testing.assert_allclose(gemma.redecode(loaded, cfg, TOKENS, 19), logits, atol=1e-5)


def test_misshapen_tensor_is_named(tmp_path, weights):
    bad = dict(weights)
    bad["model.layers.3.mlp.up_proj.weight"] = bad["model.layers.3.mlp.up_proj.weight"][:-1]
    checkpoints.save_hf_folder(tmp_path / "hf", CFG, bad)
    with pytest.raises(UsageError, match=r"'model\.layers\.3\.mlp\.up_proj\.weight' has shape \(127, 64\)"):
        checkpoints.load_checkpoint(tmp_path / "hf")
    checkpoints.save_gguf(tmp_path / "m.gguf", CFG, bad)
    with pytest.raises(UsageError, match=r"up_proj\.weight' has shape"):
        checkpoints.load_checkpoint(tmp_path / "m.gguf")


def test_missing_and_unexpected_tensors_are_named(tmp_path, weights):
    missing = {k: v for k, v in weights.items() if k != "model.layers.5.self_attn.k_norm.weight"}
    checkpoints.save_hf_folder(tmp_path / "a", CFG, missing)
    with pytest.raises(UsageError, match=r"missing tensor 'model\.layers\.5\.self_attn\.k_norm\.weight'"):
        checkpoints.load_checkpoint(tmp_path / "a")
    checkpoints.save_hf_folder(tmp_path / "b", CFG, {**weights, "model.layers.6.input_layernorm.weight": np.ones(64)})
    with pytest.raises(UsageError, match=r"unexpected tensor 'model\.layers\.6\.input_layernorm\.weight'"):
        checkpoints.load_checkpoint(tmp_path / "b")
    checkpoints.save_gguf(tmp_path / "c.gguf", CFG, missing)
    with pytest.raises(UsageError, match=r"missing tensor 'blk\.5\.attn_k_norm\.weight'"):
        checkpoints.load_checkpoint(tmp_path / "c.gguf")


def test_config_json_problems_are_one_line(tmp_path, weights):
    folder = checkpoints.save_hf_folder(tmp_path / "hf", CFG, weights)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "rope_scaling": {"factor": 8.0}}))
    with pytest.raises(UsageError, match="rope_scaling"):
        checkpoints.load_checkpoint(folder)
    del hf["head_dim"]
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UsageError, match="lacks 'head_dim'"):
        checkpoints.load_checkpoint(folder)
    with pytest.raises(UsageError, match="accepted: a folder"):
        checkpoints.load_checkpoint(tmp_path / "nothing.bin")


def test_prompts_from_json_npy_and_seed(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"tokens": [5, 6, 7, 8]}))
    np.save(tmp_path / "p.npy", np.array([1, 2, 3]))
    assert prompts.load_prompt(str(tmp_path / "p.json"), 3, 10, 0).tolist() == [5, 6, 7]
    assert prompts.load_prompt(str(tmp_path / "p.npy"), 3, 10, 0).tolist() == [1, 2, 3]
    assert np.array_equal(prompts.load_prompt("seed", 5, 10, 1), prompts.load_prompt("seed", 5, 10, 1))
    with pytest.raises(UsageError, match="holds token id 8; accepted: ids from 0 to 7"):
        prompts.load_prompt(str(tmp_path / "p.json"), 4, 8, 0)
    with pytest.raises(UsageError, match="has 3 tokens; the cases need at least 4"):
        prompts.load_prompt(str(tmp_path / "p.npy"), 4, 10, 0)
    (tmp_path / "bad.json").write_text('["a"]')
    with pytest.raises(UsageError, match="integer token ids"):
        prompts.load_prompt(str(tmp_path / "bad.json"), 1, 10, 0)
