"""Prompts: the token ids a run feeds the model, and where they came from.

`model.prompt` is one of
  seed              ids drawn from the run's seed
  FILE.json, .npy   token ids (a JSON list, or {"tokens": [...]}; a 1-D integer array)
  FILE.txt          text, read from the file
  anything else     the text itself
Text is tokenised by the checkpoint's own tokenizer (tokenizer.json through the `tokenizers` library,
else tokenizer.model through sentencepiece). With `model.chat=true` the text is first rendered as one
user turn by the checkpoint's chat template (tokenizer_config.json or chat_template.jinja, through
jinja2, as transformers' apply_chat_template renders it), so a case such as "the token at position 851
of this prompt" can be written as the text a user would type. The oracles still compare token ids.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from testbed.config import project_path
from testbed.errors import UsageError
from testbed.oracles.numerical import digest

ID_FILES = (".json", ".npy")
TEXT_FILES = (".txt",)


@dataclass(frozen=True)
class Prompt:
    ids: np.ndarray            # int64 token ids
    source: str                # "seed", the file it was read from, or "text"
    tokenizer: str | None = None  # the tokenizer file that made the ids from text, with its sha256
    chat: bool = False         # the text was rendered by the chat template first

    def artifacts(self) -> dict[str, str]:
        """What a record needs to say which prompt it is about: the ids, their sha256, their source."""
        out = {"prompt_sha256": digest_ids(self.ids), "prompt_tokens": ",".join(map(str, self.ids.tolist())),
               "prompt_source": self.source}
        if self.tokenizer:
            out |= {"prompt_tokenizer": self.tokenizer, "prompt_chat": str(self.chat).lower()}
        return out


def digest_ids(ids: np.ndarray) -> str:
    return digest(np.asarray(ids, np.int64))


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- tokenizers ------------------------------------------------------------------------------------


class Tokenizer:
    """A Hugging Face checkpoint folder's own tokenizer, with its special tokens and chat template."""

    def __init__(self, file: Path):
        self.file, self.folder = file, file.parent
        config_file = self.folder / "tokenizer_config.json"
        self.config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if file.name == "tokenizer.json":
            from tokenizers import Tokenizer as FastTokenizer

            self._fast, self._sp = FastTokenizer.from_file(str(file)), None
        else:
            import sentencepiece

            self._fast, self._sp = None, sentencepiece.SentencePieceProcessor(model_file=str(file))

    @property
    def name(self) -> str:
        return f"{self.file} sha256:{sha256_file(self.file)}"

    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, ... as tokenizer_config.json names them (a string or {"content": ...}):
        the variables a chat template reads."""
        out = {}
        for key, value in self.config.items():
            if key.endswith("_token") and isinstance(value, (str, dict)):
                out[key] = value["content"] if isinstance(value, dict) else value
        return out

    def added_tokens(self) -> list[str]:
        """Every token text that must be matched whole, before the model's own segmentation: the
        special tokens and tokenizer_config.json's added tokens (Gemma: <start_of_turn>, ...)."""
        added = [t["content"] for t in self.config.get("added_tokens_decoder", {}).values()]
        added += self.config.get("additional_special_tokens", [])
        return sorted(set(self.special_tokens().values()) | set(added), key=len, reverse=True)

    def chat_template(self) -> str:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one renders conversations
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (self.folder / "chat_template.jinja").is_file():
            template = (self.folder / "chat_template.jinja").read_text()
        if not isinstance(template, str):
            raise UsageError(f"checkpoint folder {self.folder} has no chat template (tokenizer_config.json "
                             f"chat_template or chat_template.jinja); accepted: model.chat=false")
        return template

    def render_chat(self, text: str) -> str:
        """One user turn and the prompt for the model's reply, as apply_chat_template renders it
        (a sandboxed jinja2 environment with trim_blocks and lstrip_blocks)."""
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template()).render(
                messages=[{"role": "user", "content": text}], add_generation_prompt=True, **self.special_tokens())
        except TemplateError as e:
            raise UsageError(f"chat template of {self.folder}: {e}") from None

    def encode(self, text: str, chat: bool) -> list[int]:
        """Ids of `text`. Plain text gets the special tokens the tokenizer adds itself (Gemma: <bos>);
        a rendered chat carries them as text already, so none are added (as apply_chat_template does)."""
        if chat:
            text = self.render_chat(text)
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=not chat).ids
        # sentencepiece never matches control tokens in text: split them out and look each one up. The
        # rest as transformers' tokenizer for this model reads it: <bos> only where tokenizer_config.json
        # says add_bos_token (absent: none); whitespace kept as it is (each space a "▁"), and the model's
        # dummy prefix ("▁", where the model has one) at the start of the text only, never after a
        # special token.
        specials = self.added_tokens()
        ids = [self._sp.bos_id()] if not chat and self.config.get("add_bos_token", False) else []
        raw, prefix = self._sp_raw()
        parts = re.split(f"({'|'.join(map(re.escape, specials))})", text) if specials else [text]
        for i, part in enumerate(parts):
            if part in specials:
                ids.append(self._sp.piece_to_id(part))
            elif part:
                part = part.replace(" ", "\u2581")
                if i == 0 and prefix and not part.startswith("\u2581"):
                    part = "\u2581" + part
                ids.extend(raw.encode(part))
        return ids

    def _sp_raw(self):
        """The sentencepiece model with its normalizer adding no dummy prefix and keeping every space
        (encode() puts the prefix where it belongs), and whether the model adds the prefix."""
        if getattr(self, "_raw", None) is None:
            import sentencepiece
            from sentencepiece import sentencepiece_model_pb2

            proto = sentencepiece_model_pb2.ModelProto()
            proto.ParseFromString(self.file.read_bytes())
            prefix = proto.normalizer_spec.add_dummy_prefix
            proto.normalizer_spec.add_dummy_prefix = False
            proto.normalizer_spec.remove_extra_whitespaces = False
            self._raw = (sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString()), prefix)
        return self._raw

    def token_text(self, token: int) -> str:
        """One token as text, special tokens included (what a person reads beside the id)."""
        if self._fast is not None:
            return self._fast.decode([int(token)], skip_special_tokens=False)
        return self._sp.id_to_piece(int(token))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # in order of preference


def find_tokenizer(checkpoint: str | None) -> Tokenizer | None:
    """The tokenizer of a Hugging Face checkpoint folder; None without a checkpoint, for a GGUF (whose
    tokenizer this testbed does not read) and for a folder without a tokenizer file."""
    folder = project_path(checkpoint) if checkpoint else None
    if folder is None or not folder.is_dir():
        return None
    file = next((folder / f for f in TOKENIZER_FILES if (folder / f).is_file()), None)
    return Tokenizer(file) if file else None


# --- prompts ---------------------------------------------------------------------------------------


def seeded_prompt(length: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, length).astype(np.int64)


def read_ids(path: Path) -> np.ndarray:
    if path.suffix == ".npy":
        ids = np.load(path, allow_pickle=False)
    else:
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UsageError(f"prompt file {path} is not JSON ({e.msg} at line {e.lineno})") from None
        ids = data["tokens"] if isinstance(data, dict) and "tokens" in data else data
        try:
            ids = np.asarray(ids)
        except ValueError:
            ids = np.asarray([None])
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise UsageError(f"prompt file {path} does not hold a non-empty list of integer token ids")
    return ids.astype(np.int64)


def existing_file(value: str) -> Path:
    path = project_path(value)
    if not path.is_file():
        raise UsageError(f"prompt file {str(path)!r} does not exist; accepted: a .json or .npy file of token ids, "
                         f"or a .txt file of text")
    return path


def load_prompt(value: str, length: int, vocab: int, seed: int, tokenizer: Tokenizer | None = None,
                chat: bool = False) -> Prompt:
    """The first `length` ids of `value` (see the module's docstring), all below `vocab`. Text is
    tokenised by `tokenizer` (the checkpoint's: find_tokenizer); `chat` renders it through the chat
    template first."""
    is_ids = value == "seed" or Path(value).suffix in ID_FILES
    if chat and is_ids:
        raise UsageError(f"model.chat=true renders text, and model.prompt={value!r} is token ids; accepted: "
                         f"model.chat=false, or a text prompt")
    if value == "seed":
        prompt = Prompt(seeded_prompt(length, vocab, seed), "seed")
    elif is_ids:
        path = existing_file(value)
        prompt = Prompt(read_ids(path), str(path))
    else:
        path = existing_file(value) if Path(value).suffix in TEXT_FILES else None
        if tokenizer is None:
            raise UsageError(f"model.prompt={value!r} is text (not seed, nor a .json, .npy or .txt file) and the model "
                             f"has no tokenizer; accepted for text: model.checkpoint=a Hugging Face folder with "
                             f"{' or '.join(TOKENIZER_FILES)}")
        ids = tokenizer.encode(path.read_text() if path else value, chat)
        prompt = Prompt(np.asarray(ids, np.int64), str(path) if path else "text", tokenizer.name, chat)
    ids = prompt.ids
    if ids.size < length:
        raise UsageError(f"prompt {value!r} has {ids.size} tokens; the cases need at least {length}")
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.size:
        raise UsageError(f"prompt {value!r} holds token id {int(bad[0])}; accepted: ids from 0 to {vocab - 1}")
    return Prompt(ids[:length], prompt.source, prompt.tokenizer, prompt.chat)
