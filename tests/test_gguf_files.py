"""testbed writes the GGUF of a Hugging Face folder (testbed.models.gguf_files): the Qwen3.5 hybrid
(arch qwen35) and Gemma 3 (arch gemma3), in llama.cpp's converter's form, and its own reader judges
the file. The hybrid's folder is made by transformers (tests/hybrid_support.py), so the GGUF read back
must give transformers' logits; a writer that forgets a step of the converter's form, a value a GGUF
cannot hold, and a file that would make llama.cpp rotate otherwise are each refused in one line
naming it, with nothing left behind. (libllama running these files: tests/test_llamacpp_hybrid.py.)
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from refimpl import gemma, qwen35
from testbed.errors import UsageError
from testbed.models import checkpoints, gguf_files, hybrid_checkpoints
from testbed.oracles.numerical import nmse
from tests.hybrid_support import VARIANTS, make_tiny_qwen35

REFIMPL_TOLERANCE = 1e-9  # float32 on both sides (measured 1e-12 to 3e-12)
PROMPT_TOKENS = 24


@pytest.fixture(scope="module", params=VARIANTS)
def made(request, tmp_path_factory):
    pytest.importorskip("transformers", exc_type=ImportError)
    return make_tiny_qwen35(tmp_path_factory.mktemp("qwen35") / "tiny", VARIANTS[request.param], PROMPT_TOKENS)


@pytest.fixture(scope="module")
def written(made, tmp_path_factory):
    return gguf_files.write_gguf(made.folder, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_the_hybrids_gguf_reads_back_as_the_folder_and_computes_transformers_logits(made, written):
    cfg, w = hybrid_checkpoints.load_checkpoint(written)
    hf_cfg, hf_w = hybrid_checkpoints.load_checkpoint(made.folder)
    assert cfg == hf_cfg and set(w) == set(hf_w)
    logits, _ = qwen35.redecode(w, cfg, made.prompt)
    assert nmse(made.logits, logits) < REFIMPL_TOLERANCE


def test_the_file_holds_llamacpps_form(made, written):
    """What libllama reads: A as -exp(A_log), norms as 1 + w (the GDN output norm as is), the value heads
    tiled (value head j * H_k + g reads key head g), the RoPE sections of Qwen3.5's converter for the
    rotary pairs there are."""
    import gguf

    reader = gguf.GGUFReader(written)
    t = {x.name: np.asarray(x.data) for x in reader.tensors}
    cfg, hf = hybrid_checkpoints.load_hf_folder(made.folder)
    a_log = hf["model.layers.0.linear_attn.A_log"]  # H_v = 4 grouped by H_k = 2: [g0v0, g0v1, g1v0, g1v1]
    np.testing.assert_array_equal(t["blk.0.ssm_a"], -np.exp(a_log[[0, 2, 1, 3]]))
    np.testing.assert_array_equal(t["blk.0.attn_norm.weight"], hf["model.layers.0.input_layernorm.weight"] + 1)
    np.testing.assert_array_equal(t["blk.0.ssm_norm.weight"], hf["model.layers.0.linear_attn.norm.weight"])
    z, d = hf["model.layers.0.linear_attn.in_proj_z.weight"], cfg.linear_head_dim
    np.testing.assert_array_equal(t["blk.0.attn_gate.weight"][d:2 * d], z[2 * d:3 * d])  # tiled 1 = grouped 2
    sections = reader.fields["qwen35.rope.dimension_sections"].contents()
    assert sections == hybrid_checkpoints.gguf_rope_sections(cfg) and sum(sections) == cfg.rotary_dim // 2
    assert reader.fields["tokenizer.ggml.model"].contents() == "none"
    qwen35_9b = replace(cfg, head_dim=256, rotary_fraction=0.25)  # 64 rotary dims: the converter's default
    assert hybrid_checkpoints.gguf_rope_sections(qwen35_9b) == [11, 11, 10, 0]


def test_a_writer_that_forgets_the_norm_offset_is_refused_naming_the_tensor(made, tmp_path, monkeypatch):
    forms = hybrid_checkpoints.to_gguf_form

    def forgetful(name, a, cfg):
        stored = forms(name, a, cfg)
        return stored - 1 if name == "model.norm.weight" else stored

    monkeypatch.setattr(hybrid_checkpoints, "to_gguf_form", forgetful)
    with pytest.raises(UsageError, match=r"tensor 'model\.norm\.weight' does not come back") as e:
        gguf_files.write_gguf(made.folder, tmp_path / "m.gguf")
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []


def test_a_writer_that_drops_a_key_is_refused_naming_the_field(tmp_path, monkeypatch):
    """Without rope.freq_base llama.cpp takes 10000: the written file would compute another model."""
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_freq_base", lambda self, value: None)
    folder = save_hybrid_folder(tmp_path / "hf", qwen35.tiny_config(rope_theta=1e6))
    with pytest.raises(UsageError, match=r"rope_theta=1000000\.0 \(reads back as 10000\.0\) cannot be written"):
        gguf_files.write_gguf(folder, tmp_path / "out" / "m.gguf")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_field_a_gguf_cannot_carry_is_refused_naming_it(tmp_path):
    """A GGUF holds no query scale (llama.cpp derives it from the block count): Gemma's 24 is refused."""
    cfg = gemma.tiny_config(layers=2, query_pre_attn_scalar=24.0)
    folder = checkpoints.save_hf_folder(tmp_path / "hf", cfg, gemma.init_weights(cfg))
    with pytest.raises(UsageError, match=r"hf: query_pre_attn_scalar=24 cannot be stored in a GGUF; accepted: 16") as e:
        gguf_files.write_gguf(folder, tmp_path / "out" / "m.gguf")
    assert "\n" not in str(e.value) and list((tmp_path / "out").iterdir()) == []


def test_sections_that_leave_a_pair_to_the_fourth_stream_are_refused(tmp_path, monkeypatch):
    """[1, 1, 1, 1] over 4 rotary pairs: pair 3 is rotated by the fourth stream, 0 for text."""
    cfg = qwen35.tiny_config()
    monkeypatch.setattr(hybrid_checkpoints, "gguf_rope_sections", lambda cfg: [1, 1, 1, 1])
    path = hybrid_checkpoints.save_gguf(tmp_path / "m.gguf", cfg, qwen35.init_weights(cfg))
    with pytest.raises(UsageError, match=r"qwen35\.rope\.dimension_sections=\[1, 1, 1, 1\] is not implemented"):
        hybrid_checkpoints.load_gguf(path)


def test_an_unknown_key_is_refused(tmp_path, monkeypatch):
    """A key llama.cpp may compute with and the reader does not know (here: bidirectional attention)."""
    import gguf

    class WithExtraKey(gguf.GGUFWriter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_bool("qwen35.attention.causal", False)

    monkeypatch.setattr(gguf, "GGUFWriter", WithExtraKey)
    cfg = qwen35.tiny_config()
    path = hybrid_checkpoints.save_gguf(tmp_path / "m.gguf", cfg, qwen35.init_weights(cfg))
    with pytest.raises(UsageError, match=r"metadata qwen35\.attention\.causal=False is not implemented"):
        hybrid_checkpoints.load_gguf(path)


def test_multi_token_prediction_blocks_after_the_decoders_are_left_out(tmp_path, monkeypatch):
    """The converter stores Qwen3.5's MTP head as blocks after the decoder's (nextn_predict_layers); llama.cpp's
    main pass does not run them, and neither does testbed's reader."""
    import gguf

    class WithMtpBlock(gguf.GGUFWriter):
        def add_block_count(self, length):
            super().add_block_count(length + 1)
            self.add_uint32("qwen35.nextn_predict_layers", 1)
            self.add_tensor(f"blk.{length}.nextn.eh_proj.weight", np.ones((8, 16), np.float32))

    monkeypatch.setattr(gguf, "GGUFWriter", WithMtpBlock)
    cfg = qwen35.tiny_config()
    w = qwen35.init_weights(cfg)
    back_cfg, back = hybrid_checkpoints.load_gguf(hybrid_checkpoints.save_gguf(tmp_path / "m.gguf", cfg, w))
    assert back_cfg == cfg and set(back) == set(w)


def test_gemma_is_written_the_same_way(tmp_path):
    cfg = gemma.tiny_config(layers=3, vocab=64, hidden=32, mlp=64, heads=2, kv_heads=1, head_dim=16,
                            query_pre_attn_scalar=16.0, window=8, layer_types=("local", "local", "global"))
    w = gemma.init_weights(cfg, 3)
    folder = checkpoints.save_hf_folder(tmp_path / "hf", cfg, w)
    back_cfg, back = checkpoints.load_checkpoint(gguf_files.write_gguf(folder, tmp_path / "g.gguf"))
    assert back_cfg == cfg
    tokens = np.arange(12) % cfg.vocab
    assert np.array_equal(gemma.redecode(back, cfg, tokens, 11), gemma.redecode(w, cfg, tokens, 11))


def test_gguf_for_writes_once_per_content_and_takes_a_gguf_as_it_is(made, tmp_path):
    first = gguf_files.gguf_for(made.folder, cache=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert gguf_files.gguf_for(made.folder, cache=tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert gguf_files.gguf_for(first) == first
    with pytest.raises(UsageError, match="model_type 'llama' cannot be written to a GGUF by testbed"):
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "config.json").write_text('{"model_type": "llama"}')
        gguf_files.gguf_for(tmp_path / "other", cache=tmp_path)


def save_hybrid_folder(folder, cfg: qwen35.HybridConfig):
    """A Qwen3.5 folder of seeded weights in transformers' form (no torch needed)."""
    import json

    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(hybrid_checkpoints.config_to_hf(cfg)))
    save_file(qwen35.init_weights(cfg), str(folder / "model.safetensors"))
    return folder


def test_the_gguf_command_writes_the_file_or_says_in_one_line_why_not(made, tmp_path, capsys):
    from testbed.cli import main

    assert main(["gguf", str(made.folder), "--out", str(tmp_path / "m.gguf")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m.gguf")
    written_cfg = hybrid_checkpoints.load_checkpoint(tmp_path / "m.gguf")[0]
    assert written_cfg == hybrid_checkpoints.load_checkpoint(made.folder)[0]
    assert main(["gguf", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err.strip()
    assert "checkpoint" in err and "absent" in err and "\n" not in err


def _config(folder, change):
    path = folder / "config.json"
    path.write_text(change(path.read_text()) if callable(change) else change)


def _cut_safetensors(folder):  # its last kilobyte gone
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


def _header_length(folder):
    path = folder / "model.safetensors"
    path.write_bytes((2**62).to_bytes(8, "little") + path.read_bytes()[8:])


def _block_count(value):
    def write(folder):
        from tests.hostile_inputs import replace_kv, gguf_bytes, read_parts

        valid = gguf_files.gguf_of(gemma.tiny_config(), gemma.init_weights(gemma.tiny_config(), 0), folder / "cache")
        (folder / "m.gguf").write_bytes(gguf_bytes(replace_kv(read_parts(valid), "gemma3.block_count", 4, value)))
    return write


# What issue 44 measured ending in a traceback (exit 1) or returned unchecked, each now one line, exit 2, naming
# the file and the value, and nothing written: (input, how it is made from a valid Gemma folder, what is said).
GGUF_COMMAND_REFUSALS = [
    ("config.json not JSON", lambda f: _config(f, '{"model_type": "gemma3_text",'), "config.json is not JSON"),
    ("config.json an array", lambda f: _config(f, "[1, 2]"), "config.json is an array, not an object"),
    ("10^9 layers", lambda f: _config(f, lambda t: t.replace('"num_hidden_layers": 2', '"num_hidden_layers": 10**9')
                                      .replace("10**9", str(10**9))),
     "num_hidden_layers=1000000000 is not accepted"),
    ("a truncated safetensors file", _cut_safetensors, "run past the end of the file"),
    ("a safetensors header length of 2^62", _header_length, "its header claims 4611686018427387904 bytes"),
    ("--out naming a folder", None, "is a folder; accepted: the path of the .gguf file to write"),
    ("a .gguf of 10^9 blocks", _block_count(10**9), "gemma3.block_count=1000000000 is not accepted; accepted: an "
                                                    "integer in 1..80"),
    ("a .gguf of random bytes", lambda f: (f / "m.gguf").write_bytes(bytes(range(256))), "not a GGUF file"),
]


@pytest.mark.parametrize("what, make, said", GGUF_COMMAND_REFUSALS, ids=[r[0] for r in GGUF_COMMAND_REFUSALS])
def test_the_gguf_command_refuses_a_bad_input_in_one_line(what, make, said, tmp_path, capsys):
    from testbed.cli import main

    cfg = gemma.tiny_config(layers=2)
    folder = checkpoints.save_hf_folder(tmp_path / "hf", cfg, gemma.init_weights(cfg))
    out = tmp_path / "out"
    out.mkdir()
    if make:
        make(folder)
    given = folder / "m.gguf" if (folder / "m.gguf").exists() else folder
    args = ["gguf", str(given)] + ([] if given.suffix == ".gguf" else ["--out", str(out / "m.gguf")])
    if what == "--out naming a folder":
        args[-1] = str(out)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and said in err and (str(given) in err or str(out) in err), err
    assert list(out.iterdir()) == []


def test_the_gguf_command_reads_a_gguf_whole_before_it_prints_it(tmp_path, capsys):
    from testbed.cli import main

    cfg = gemma.tiny_config(layers=2)
    path = gguf_files.gguf_of(cfg, gemma.init_weights(cfg), tmp_path)
    assert main(["gguf", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(path) and "read by testbed's reader" in err


@pytest.mark.slow_build  # libllama
def test_chunk_prefill_through_llamacpp_takes_a_hugging_face_folder(tmp_path, results_dir):
    """`testbed run chunk_prefill backend=llamacpp model.checkpoint=DIR`: the reference reads the folder,
    llama.cpp the GGUF testbed writes of it; the token at P + n - 1 and the logits agree."""
    from testbed import config, runner

    cfg = gemma.tiny_config(layers=3, vocab=64, hidden=32, mlp=64, heads=2, kv_heads=1, head_dim=16,
                            query_pre_attn_scalar=16.0, window=8, layer_types=("local", "local", "global"))
    folder = checkpoints.save_hf_folder(tmp_path / "hf", cfg, gemma.init_weights(cfg, 5))
    outcome = runner.execute(config.load(["experiment=chunk_prefill", "device=host", "backend=llamacpp", "mode=oracle",
                                          f"model.checkpoint={folder}", "chunk=16", "cases=[{past: 20, tokens: 12}]"]))
    verdicts = outcome.frame().query("kind == 'oracle'").set_index("oracle")
    assert verdicts.loc["token", "verdict"] == "pass" and verdicts.loc["logits", "verdict"] == "pass", verdicts
    assert verdicts.loc["token", "backend"] == "engine:llamacpp"
