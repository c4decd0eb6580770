"""The GGUF of a model testbed holds as arrays (a seeded shape, or a checkpoint already read), for an
engine that reads GGUF only (llama.cpp). It is llama.cpp's converter's form, as testbed writes it
(testbed.models.checkpoints.save_gguf), with a vocabulary of plain ids (tokenizer.ggml.model = none and
{arch}.vocab_size, and the context_length llama.cpp's loader requires: libllama then takes token ids as given, and no tokenizer is needed). Written once per
content under .cache/gguf/; testbed's own reader reads the tensors and metadata back (before the two
vocabulary keys are added, which it does not take) so the engine and the reference compute one model."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from refimpl import gemma
from testbed.backends.native.build import ROOT
from testbed.models import checkpoints

GGUF_DIR = ROOT / ".cache" / "gguf"
CONTEXT_LENGTH = 32768  # the trained context llama.cpp reads (it only warns when a context exceeds it)


def gguf_of(cfg: gemma.GemmaConfig, w: dict[str, np.ndarray], folder: Path = GGUF_DIR) -> Path:
    import gguf

    h = hashlib.sha256(f"{cfg!r} vocab=none context_length={CONTEXT_LENGTH}".encode())
    for name in sorted(w):
        h.update(name.encode() + np.ascontiguousarray(w[name], np.float32).tobytes())
    path = folder / f"{h.hexdigest()[:20]}.gguf"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    bare = path.with_name(f".{path.stem}.bare{os.getpid()}.gguf")
    whole = path.with_name(f".{path.stem}.tmp{os.getpid()}.gguf")
    try:
        checkpoints.save_gguf(bare, cfg, w)  # refuses a config the format cannot carry
        if checkpoints.load_gguf(bare)[0] != cfg:
            raise ValueError(f"{bare}: testbed's reader gives another config than the one written")
        reader = gguf.GGUFReader(bare)
        writer = gguf.GGUFWriter(str(whole), checkpoints.GGUF_ARCH)
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
        writer.add_tokenizer_model("none")
        writer.add_vocab_size(cfg.vocab)
        if f"{checkpoints.GGUF_ARCH}.context_length" not in reader.fields:  # llama.cpp's loader requires it
            writer.add_context_length(CONTEXT_LENGTH)
        for t in reader.tensors:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        whole.rename(path)
    finally:
        bare.unlink(missing_ok=True)
        whole.unlink(missing_ok=True)
    return path
