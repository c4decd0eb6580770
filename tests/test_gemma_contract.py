"""The graph contract: argument/result order and counts from the config alone, packing, the manifest."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from refimpl import gemma
from testbed.models import contract


def test_functiongemma_prefill_with_past_has_44_args_and_37_results():
    c = contract.prefill_with_past_contract(gemma.functiongemma_config(), chunk=64, past=800)
    assert (len(c.args), len(c.results)) == (44, 37)
    names = [a.name for a in c.args]
    # first use: layer 0 is local, layer 5 the first global
    assert names[:8] == ["tokens", "cos_local", "sin_local", "k_0", "v_0", "mask_local", "k_1", "v_1"]
    assert names[names.index("k_5") - 2: names.index("k_5")] == ["cos_global", "sin_global"]
    assert names[names.index("v_5") + 1] == "mask_global" and names[-1] == "select"
    spec = {a.name: a for a in c.args}
    assert spec["mask_global"].shape == (1, 4, 64, 864) and spec["k_17"].shape == (1, 800, 256)
    assert spec["tokens"].dtype == "int32"
    assert c.results[0].shape == (262144,) and c.results[-1].shape == (1, 864, 256)


def test_single_type_model_counts():
    cfg = gemma.tiny_config(layers=5)  # all local: one table pair, one mask
    c = contract.prefill_with_past_contract(cfg, chunk=16, past=10)
    assert (len(c.args), len(c.results)) == (1 + 2 + 2 * 5 + 1 + 1, 1 + 2 * 5)


def test_other_graphs():
    cfg = gemma.functiongemma_config()
    assert len(contract.decode_with_past_contract(cfg, 800).args) == 43  # no select
    assert len(contract.prefill_at_contract(cfg, 800).results) == 37
    assert [a.name for a in contract.redecode_contract(cfg, 852).args] == ["tokens", "select"]


def test_packed_host_arrays_follow_the_contract_and_unpack():
    cfg = gemma.tiny_config()
    w = gemma.init_weights(cfg, 0)
    tokens = np.arange(30)
    _, ks, vs = gemma.prefill_at(w, cfg, tokens[:20], 19)
    inp = gemma.chunk_inputs(cfg, tokens[20:30], 20, 16)
    args = contract.pack_prefill_with_past(cfg, inp, ks, vs)
    c = contract.prefill_with_past_contract(cfg, 16, 20)
    contract.check_args(c, args)
    with pytest.raises(ValueError, match="k_0: got float32"):
        contract.check_args(c, [args[0], args[1], args[2], args[3][:, :5], *args[4:]])
    # a graph fed the flat list in contract order gives the reference result
    by_name = dict(zip((a.name for a in c.args), args))
    out = gemma.prefill_with_past(
        w, cfg, by_name["tokens"], {t: (by_name[f"cos_{t}"], by_name[f"sin_{t}"]) for t in cfg.types_in_use},
        [by_name[f"k_{i}"] for i in range(cfg.layers)], [by_name[f"v_{i}"] for i in range(cfg.layers)],
        {t: by_name[f"mask_{t}"] for t in cfg.types_in_use}, by_name["select"])
    flat = [out[0]] + [a for kv in zip(out[1], out[2]) for a in kv]
    for spec, a in zip(c.results, flat):
        spec.check(a)
    logits, k2, _ = contract.unpack_results(cfg, flat)
    assert logits is out[0] and k2[3] is out[1][3]


def test_manifest_names_contract_config_and_file_hashes(tmp_path):
    cfg = gemma.tiny_config()
    artifact = tmp_path / "graph.bin"
    artifact.write_bytes(b"\x00\x01graph")
    c = contract.prefill_with_past_contract(cfg, 32, 820)
    path = contract.write_manifest(tmp_path / "graph.json", c, cfg, {"module": artifact}, {"backend": "refimpl"})
    m = contract.read_manifest(path)
    assert m["contract"]["version"] == contract.CONTRACT_VERSION and len(m["contract"]["args"]) == len(c.args)
    assert m["contract_sha256"] == c.digest() and m["model"]["hidden"] == cfg.hidden
    assert m["files"]["module"]["sha256"] == hashlib.sha256(b"\x00\x01graph").hexdigest()
    assert m["backend"] == "refimpl" and not list(tmp_path.glob("*.tmp"))
    assert json.loads(path.read_text())["contract"]["graph"] == "prefill_with_past"
