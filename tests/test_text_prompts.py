"""Text prompts: tokenised by the checkpoint's own tokenizer (a tokenizer.json made here with the
`tokenizers` library, or a tokenizer.model trained here with sentencepiece), optionally rendered by the
chat template first; the ids and their source go in the record, and the token oracle names tokens as
text. The chat rendering is checked against transformers' own apply_chat_template."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from refimpl import gemma
from testbed import cli
from testbed.models import checkpoints, prompts
from testbed.oracles.numerical import digest
from testbed.results import ResultsStore

WORDS = "the cat sat on a mat and dog ran to red ball while birds sang in green trees user model".split()
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# Gemma's chat template, cut to one conversation of plain-text turns
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                 "{% if message['role'] != 'user' and message['role'] != 'assistant' %}"
                 "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
                 "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}\n"
                 "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
                 "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TOKENIZER_CONFIG = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                    "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}
TEXT = "the cat sat on a mat and the dog ran to the red ball while birds sang in green trees and the cat sat"
CFG = gemma.tiny_config(vocab=len(SPECIALS) + len(WORDS), layers=3, window=16)


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return tok


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A tiny Gemma checkpoint folder with a word-level tokenizer.json and a chat template."""
    folder = checkpoints.save_hf_folder(tmp_path_factory.mktemp("text") / "gemma", CFG, gemma.init_weights(CFG, 4))
    word_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return folder


def test_text_is_tokenised_by_the_checkpoints_own_tokenizer(checkpoint):
    tokenizer = prompts.find_tokenizer(str(checkpoint))
    prompt = prompts.load_prompt(TEXT, 10, CFG.vocab, 0, tokenizer)
    want = word_tokenizer().encode(TEXT).ids
    assert want[0] == 2 and prompt.ids.tolist() == want[:10]  # <bos> added by the tokenizer itself
    assert (prompt.source, prompt.chat) == ("text", False) and "tokenizer.json sha256:" in prompt.tokenizer
    assert prompt.artifacts()["prompt_sha256"] == digest(prompt.ids)
    assert [tokenizer.token_text(t) for t in want[:3]] == ["<bos>", "the", "cat"]


def test_chat_template_renders_one_user_turn_as_transformers_does(checkpoint, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the tokenizer is made here: never reach for a hub
    from transformers import AutoTokenizer

    tokenizer = prompts.find_tokenizer(str(checkpoint))
    assert tokenizer.render_chat("  the cat ") == "<bos><start_of_turn>user\nthe cat<end_of_turn>\n<start_of_turn>model\n"
    ids = prompts.load_prompt("the cat sat", 8, CFG.vocab, 0, tokenizer, chat=True).ids.tolist()
    hf = AutoTokenizer.from_pretrained(checkpoint)
    want = hf.apply_chat_template([{"role": "user", "content": "the cat sat"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert ids == list(want)[:8] and ids[:2] == [2, 4]  # <bos> <start_of_turn>


def sentencepiece_folder(folder, model_type: str = "word", **config) -> "sentencepiece.SentencePieceProcessor":
    """A checkpoint folder whose tokenizer is a tokenizer.model trained here (special tokens 0-5, the
    model's dummy prefix on), with tokenizer_config.json's special tokens plus `config`."""
    import sentencepiece

    lines = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) for i in range(300)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=26 if model_type == "word" else 60,
        model_type=model_type, pad_id=0, eos_id=1, bos_id=2, unk_id=3, control_symbols=["<start_of_turn>", "<end_of_turn>"],
        hard_vocab_limit=False, minloglevel=2)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    added = {"4": {"content": "<start_of_turn>", "special": True}, "5": {"content": "<end_of_turn>", "special": True}}
    (folder / "tokenizer_config.json").write_text(json.dumps({**TOKENIZER_CONFIG, "bos_token": "<s>", "eos_token": "</s>",
                                                             "added_tokens_decoder": added, **config}))
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


def test_sentencepiece_tokenizer_model_is_read_when_there_is_no_tokenizer_json(tmp_path):
    sp = sentencepiece_folder(tmp_path, add_bos_token=True)
    tokenizer = prompts.find_tokenizer(str(tmp_path))
    assert prompts.load_prompt("the cat sat", 4, 26, 0, tokenizer).ids.tolist() == [2, *sp.encode("the cat sat")]
    chat = prompts.load_prompt("the cat", 4, 26, 0, tokenizer, chat=True).ids.tolist()
    assert chat[:2] == [2, sp.piece_to_id("<start_of_turn>")]  # the rendered <bos> and turn, looked up whole
    assert tokenizer.token_text(sp.encode("cat")[0]) == "▁cat"


SP_TEXTS = ["the cat sat", "<start_of_turn>user the cat<end_of_turn><start_of_turn>model", "the cat<end_of_turn> sat on",
            "the  cat", " the cat", "<start_of_turn> user", "the cat "]


@pytest.mark.parametrize("bos", [None, True, False], ids=["no add_bos_token", "add_bos_token", "no bos"])
def test_sentencepiece_prompts_are_tokenised_as_transformers_does(tmp_path, monkeypatch, bos):
    """Issue 24, item 25: with no add_bos_token key testbed added <bos> (transformers does not), and with
    the model's add_dummy_prefix it put "▁" after every special token (transformers puts it at the
    start of the text only)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
    sp = sentencepiece_folder(tmp_path, "bpe", tokenizer_class="LlamaTokenizer",
                              **({} if bos is None else {"add_bos_token": bos}))
    tokenizer = prompts.find_tokenizer(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in SP_TEXTS:
        assert tokenizer.encode(text, chat=False) == hf(text)["input_ids"], text
    ids = tokenizer.encode("<start_of_turn>user the cat", chat=False)
    assert (ids[0] == 2) == bool(bos)
    after = ids[ids.index(sp.piece_to_id("<start_of_turn>")) + 1]
    assert not sp.id_to_piece(after).startswith("▁")  # no dummy prefix after a special token


def test_text_prompt_case_through_the_cli(checkpoint, results_dir, capsys):
    """The seed's kind of case written as text: the token at the last position of this prompt."""
    n = len(word_tokenizer().encode(TEXT).ids)
    assert cli.main(["run", "chunk_prefill", "mode=oracle", "chunk=4", f"cases=[{{past:{n - 7},tokens:7}}]",
                     f"model.checkpoint={checkpoint}", f"model.prompt={TEXT}"]) == 0
    assert "oracles 4 pass" in capsys.readouterr().out
    records = ResultsStore(results_dir).records("chunk_prefill")
    ids = word_tokenizer().encode(TEXT).ids
    for r in records:
        assert r["artifacts"]["prompt_tokens"] == ",".join(map(str, ids))
        assert r["artifacts"]["prompt_sha256"] == digest(np.asarray(ids, np.int64))
        assert r["artifacts"]["prompt_source"] == "text" and r["artifacts"]["prompt_chat"] == "false"
    token = next(r for r in records if r["oracle"] == "token")["metrics"]
    assert token["token_text"] == prompts.find_tokenizer(str(checkpoint)).token_text(token["token_ref"])


def test_text_file_prompt_with_chat(checkpoint, results_dir, tmp_path, capsys):
    (tmp_path / "prompt.txt").write_text(TEXT + "\n")
    assert cli.main(["run", "chunk_prefill", "mode=oracle", "chunk=8", "cases=[{past:20,tokens:9}]",
                     f"model.checkpoint={checkpoint}", f"model.prompt={tmp_path / 'prompt.txt'}", "model.chat=true"]) == 0
    record = ResultsStore(results_dir).records("chunk_prefill")[0]
    assert record["artifacts"]["prompt_source"] == str(tmp_path / "prompt.txt")
    assert record["artifacts"]["prompt_chat"] == "true"
    assert record["artifacts"]["prompt_tokens"].startswith("2,4,")  # <bos> <start_of_turn>


def test_text_prompt_without_a_tokenizer_is_one_line_and_exit_2(checkpoint, results_dir, tmp_path, capsys):
    gguf_path = checkpoints.save_gguf(tmp_path / "m.gguf", CFG, gemma.init_weights(CFG, 4))
    for override in ([f"model.checkpoint={gguf_path}"], ["model.preset=tiny"]):
        assert cli.main(["run", "chunk_prefill", "mode=oracle", "cases=[{past:3,tokens:2}]", *override,
                         "model.prompt=the cat sat on a mat"]) == 2
        err = capsys.readouterr().err.strip()
        assert "model.prompt='the cat sat on a mat' is text" in err and "has no tokenizer" in err
        assert len(err.splitlines()) == 1
    assert cli.main(["run", "chunk_prefill", "mode=oracle", "cases=[{past:3,tokens:2}]", "model.chat=true"]) == 2
    assert "model.chat=true renders text" in capsys.readouterr().err
    assert not results_dir.exists()


def test_token_verdicts_name_tokens_as_text(checkpoint, results_dir, capsys):
    n = len(word_tokenizer().encode(TEXT).ids)
    base = ["run", "chunk_prefill", "mode=oracle", "chunk=4", f"cases=[{{past:{n - 5},tokens:5}}]",
            f"model.checkpoint={checkpoint}", f"model.prompt={TEXT}"]
    assert cli.main(base) == 0
    token = next(r for r in ResultsStore(results_dir).records() if r["oracle"] == "token")["metrics"]
    wrong = (token["token_ref"] + 1) % CFG.vocab
    capsys.readouterr()
    assert cli.main([*base, f"model.expected_token={wrong}"]) == 1
    text = prompts.find_tokenizer(str(checkpoint)).token_text
    assert f"the config pins {wrong} ({text(wrong)!r})" in capsys.readouterr().out
