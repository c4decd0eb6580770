"""Hostile inputs made from valid ones by seeded mutations, and the child process that hands each to
testbed's real entry point (tests/test_hostile_inputs.py runs it and judges what it reports).

Five surfaces, each from a valid input testbed accepts:
- GGUF files (a gemma3 and a qwen35 file testbed wrote): byte flips, truncations, counts and lengths made
  huge, metadata values of another kind or range, keys dropped, doubled and swapped, tensors retyped,
  reshaped, renamed and moved; handed to testbed.models.gguf_files.load_gguf.
- Hugging Face folders (Gemma 3, Qwen3.5): config.json values of another kind, dropped, the file broken;
  safetensors headers' entries changed, lengths made huge, files truncated; handed to
  testbed.models.gguf_files.write_gguf (what `testbed gguf DIR --out FILE` runs).
- engine responses (what testbed-c answers to a small request): logits.npy and cache/ files with headers
  claiming huge or wrong shapes, truncated or flipped; timings.json, status.json as other JSON, deeply
  nested, huge numbers, huge files; replayed by a real engine program through
  testbed.backends.engine.runner.call on the host device.
- engine yamls (a valid prebuilt yaml and a valid build-command yaml): keys dropped, values of another
  type, placeholders unknown or broken, shell words in the program word, bad prebuilt files, links in the
  source tree; handed to testbed.backends.engine.spec.parse and build.program_for.
- IREE user folders (a manifest of seed 000's contract over a real .vmfb): `files` and its entries of
  another kind, paths out of the folder, contract entries changed, the module flipped, truncated,
  emptied or an ELF; handed to testbed.backends.iree.user_module.load.

Each case ends in one of: accepted (a harmless mutation), or one of testbed's own errors (UsageError,
exit 2; ToolMissing or DeviceUnreachable, exit 3; DeviceError, exit 4) whose message is one line naming
the input. Anything else is reported as a traceback. `python -m tests.hostile_inputs OUT --seed S` writes
one JSON line per case (surface, case, outcome, exit status, message, CPU seconds) and a last line with the
process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import struct
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

# --- GGUF files, written field by field (so a mutant may break any rule of the format) ---------------

STRING, ARRAY = 8, 9
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass
class KV:
    key: str | bytes
    kind: int
    value: object
    item: int | None = None    # the entry type of an array


@dataclass
class TensorEntry:
    name: str
    ne: list[int]              # ggml order
    kind: int
    data: bytes


@dataclass
class GGUFParts:
    kvs: list[KV]
    tensors: list[TensorEntry]
    version: int = 3
    alignment: int = 32
    tensor_count: int | None = None   # as the header claims (None: the true count)
    kv_count: int | None = None


def read_parts(path: Path) -> GGUFParts:
    """A valid file's parts, read with the gguf package's own reader (not testbed's)."""
    import gguf

    reader = gguf.GGUFReader(path)
    kvs = []
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        kind = int(field.types[0])
        item = int(field.types[1]) if kind == ARRAY else None
        kvs.append(KV(name, kind, field.contents(), item))
    tensors = [TensorEntry(t.name, [int(d) for d in t.shape], int(t.tensor_type), bytes(np.asarray(t.data).tobytes()))
               for t in reader.tensors]
    return GGUFParts(kvs, tensors, alignment=reader.alignment)


def _string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: int, value, item: int | None) -> bytes:
    if kind == STRING:
        return _string(value)
    if kind == ARRAY:
        head = struct.pack("<IQ", item, len(value))
        if item == STRING:
            return head + b"".join(_string(v) for v in value)
        if item == ARRAY:  # an array of arrays (gguf.cpp refuses it): entries of uint8 arrays
            return head + b"".join(_value(ARRAY, v, 0) for v in value)
        return head + np.asarray(value, np.dtype("<" + SCALAR_FORMATS[item])).tobytes()
    if kind in SCALAR_FORMATS:
        return struct.pack("<" + SCALAR_FORMATS[kind], value)
    return b""  # an unknown type: no value (the reader must stop at the type)


def gguf_bytes(p: GGUFParts) -> bytes:
    tensors = len(p.tensors) if p.tensor_count is None else p.tensor_count
    out = bytearray(b"GGUF" + struct.pack("<IQQ", p.version, tensors, len(p.kvs) if p.kv_count is None else p.kv_count))
    for kv in p.kvs:
        out += _string(kv.key) + struct.pack("<I", kv.kind) + _value(kv.kind, kv.value, kv.item)
    offset, data = 0, bytearray()
    for t in p.tensors:
        out += _string(t.name) + struct.pack("<I", len(t.ne)) + struct.pack(f"<{len(t.ne)}Q", *t.ne)
        out += struct.pack("<IQ", t.kind, offset)
        padded = -(-len(t.data) // p.alignment) * p.alignment
        data += t.data + b"\0" * (padded - len(t.data))
        offset += padded
    out += b"\0" * (-len(out) % p.alignment)
    return bytes(out + data)


def replace_kv(p: GGUFParts, key: str, kind: int, value, item=None) -> GGUFParts:
    kvs = [KV(kv.key, kind, value, item) if kv.key == key else kv for kv in p.kvs]
    return GGUFParts(kvs, p.tensors, p.version, p.alignment)


def _with(p: GGUFParts, **changes) -> GGUFParts:
    return GGUFParts(**{**p.__dict__, **changes})


HUGE = (2**32 - 1, 10**9, 2**62)
# Values of another kind or range for a metadata key: (GGUF type, value, entry type).
ODD_VALUES = [(4, 0, None), (5, -1, None), (10, 10**9, None), (10, 2**63, None), (6, 1.5, None),
              (6, float("nan"), None), (12, float("inf"), None), (STRING, "sixty-four", None), (7, True, None),
              (ARRAY, [1, 2], 4), (ARRAY, ["a"], STRING), (ARRAY, [[1]], ARRAY), (99, None, None)]


def gguf_mutants(base: GGUFParts, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """(what was changed, the file's bytes) for one valid file: every model key given four odd values (seeded),
    keys dropped, doubled, swapped and added, array lengths made huge, tensors changed, header counts and
    versions changed, then seeded byte flips, huge u64 fields and truncations of the whole file."""
    arch = next(kv.value for kv in base.kvs if kv.key == "general.architecture")
    model_keys = [kv.key for kv in base.kvs if kv.key.startswith(f"{arch}.")]
    for key in model_keys:
        for kind, value, item in rng.sample(ODD_VALUES, 4):
            yield (f"{key}={value!r} (type {kind})", gguf_bytes(replace_kv(base, key, kind, value, item)))
        yield (f"{key} dropped", gguf_bytes(_with(base, kvs=[kv for kv in base.kvs if kv.key != key])))
    yield (f"{arch}.block_count=10^9", gguf_bytes(replace_kv(base, f"{arch}.block_count", 4, 10**9)))
    kvs = base.kvs
    for _ in range(4):
        a, b = rng.sample(range(len(kvs)), 2)
        swapped = list(kvs)
        swapped[a], swapped[b] = KV(kvs[a].key, kvs[b].kind, kvs[b].value, kvs[b].item), \
            KV(kvs[b].key, kvs[a].kind, kvs[a].value, kvs[a].item)
        yield (f"values of {kvs[a].key} and {kvs[b].key} swapped", gguf_bytes(_with(base, kvs=swapped)))
    dup = rng.choice(kvs)
    yield (f"key {dup.key} given twice", gguf_bytes(_with(base, kvs=[*kvs, dup])))
    yield ("an empty key", gguf_bytes(_with(base, kvs=[*kvs, KV("", 4, 1)])))
    yield ("a key not UTF-8", gguf_bytes(_with(base, kvs=[*kvs, KV(b"\xff\xfe", 4, 1)])))
    yield (f"{arch}.unknown_key added", gguf_bytes(_with(base, kvs=[*kvs, KV(f"{arch}.unknown_key", 4, 7)])))
    # per-layer arrays of a million entries (778 MB through the gguf package's reader)
    for key, item, value in ((f"{arch}.attention.sliding_window_pattern", 7, True),
                             (f"{arch}.attention.recurrent_layers", 7, True),
                             (f"{arch}.rope.dimension_sections", 5, 1),
                             ("tokenizer.ggml.scores", 6, 0.0)):
        grown = [kv for kv in kvs if kv.key != key] + [KV(key, ARRAY, [value] * 10**6, item)]
        yield (f"{key}: an array of 10^6 entries", gguf_bytes(_with(base, kvs=grown)))
    for a_len in HUGE:  # an array whose length claims more than the file holds
        data = bytearray(gguf_bytes(_with(base, kvs=[*kvs, KV(f"{arch}.attention.sliding_window_pattern", ARRAY,
                                                                [True, False], 7)])))
        at = data.index(struct.pack("<IQ", 7, 2) + b"\x01\x00")
        data[at + 4:at + 12] = struct.pack("<Q", a_len)
        yield (f"sliding_window_pattern claiming {a_len} entries", bytes(data))
    yield ("alignment 0", gguf_bytes(_with(base, kvs=[*kvs, KV("general.alignment", 4, 0)])))
    yield ("alignment 3", gguf_bytes(_with(base, kvs=[*kvs, KV("general.alignment", 4, 3)])))
    yield ("alignment as a string", gguf_bytes(_with(base, kvs=[*kvs, KV("general.alignment", STRING, "32")])))
    yield ("architecture llama", gguf_bytes(replace_kv(base, "general.architecture", STRING, "llama")))
    yield ("architecture as an int", gguf_bytes(replace_kv(base, "general.architecture", 4, 3)))
    for version in (0, 1, 4, 3 << 24):
        yield (f"version {version}", gguf_bytes(_with(base, version=version)))
    for count in HUGE:
        yield (f"tensor count {count}", gguf_bytes(_with(base, tensor_count=count)))
        yield (f"key count {count}", gguf_bytes(_with(base, kv_count=count)))
    yield ("one tensor fewer in the header", gguf_bytes(_with(base, tensor_count=len(base.tensors) - 1)))
    # tensors
    tensors = base.tensors
    for _ in range(6):
        i = rng.randrange(len(tensors))
        t = tensors[i]

        def changed(**kw):
            one = TensorEntry(**{**t.__dict__, **kw})
            return gguf_bytes(_with(base, tensors=[*tensors[:i], one, *tensors[i + 1:]]))

        yield (f"tensor {t.name} dropped", gguf_bytes(_with(base, tensors=tensors[:i] + tensors[i + 1:])))
        yield (f"tensor {t.name} given twice", gguf_bytes(_with(base, tensors=[*tensors, t])))
        yield (f"tensor {t.name} of type F16", changed(kind=1, data=t.data[:len(t.data) // 2]))
        yield (f"tensor {t.name} of type Q8_0", changed(kind=8))
        yield (f"tensor {t.name} of type I32", changed(kind=26))
        yield (f"tensor {t.name} of type 99", changed(kind=99))
        yield (f"tensor {t.name} with dimensions reversed", changed(ne=t.ne[::-1]))
        yield (f"tensor {t.name} with a dimension 0", changed(ne=[0, *t.ne[1:]], data=b""))
        yield (f"tensor {t.name} with 5 dimensions", changed(ne=[*t.ne, 1, 1, 1, 1][:5]))
        yield (f"tensor {t.name} with no dimensions", changed(ne=[]))
        yield (f"tensor {t.name} with a dimension 2^40", changed(ne=[2**40, *t.ne[1:]]))
        yield (f"tensor {t.name} renamed to 70 characters", changed(name="x" * 70))
        yield (f"tensor {t.name} one dimension doubled", changed(ne=[t.ne[0] * 2, *t.ne[1:]], data=t.data * 2))
    yield ("token_embd.weight of one dimension", gguf_bytes(_with(base, tensors=[
        TensorEntry(t.name, [int(np.prod(t.ne))], t.kind, t.data) if t.name == "token_embd.weight" else t
        for t in tensors])))
    valid = gguf_bytes(base)
    header_end = len(valid) - sum(-(-len(t.data) // base.alignment) * base.alignment for t in tensors)
    for _ in range(40):  # byte flips: in the header and metadata mostly, some in the data
        data = bytearray(valid)
        span = header_end if rng.random() < 0.8 else len(valid)
        at = [rng.randrange(span) for _ in range(rng.randint(1, 4))]
        for a in at:
            data[a] ^= 1 << rng.randrange(8)
        yield (f"bits flipped at bytes {at}", bytes(data))
    for _ in range(10):  # an 8-byte field made huge wherever it falls
        data = bytearray(valid)
        at = rng.randrange(header_end - 8)
        data[at:at + 8] = struct.pack("<Q", rng.choice(HUGE))
        yield (f"8 bytes at {at} made huge", bytes(data))
    for _ in range(15):
        end = rng.choice([0, 3, 4, 8, 16, 24, rng.randrange(header_end), rng.randrange(len(valid))])
        yield (f"truncated to {end} bytes", valid[:end])


# --- Hugging Face folders (what `testbed gguf DIR` and model.checkpoint=DIR read) ----------------------


def safetensors_bytes(header: dict | bytes, body: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def hf_mutants(config: dict, weights: bytes, rng: random.Random) -> Iterator[tuple[str, bytes, bytes]]:
    """(what was changed, config.json's bytes, model.safetensors' bytes) of a valid folder."""
    odd = [None, True, 0, -1, 1.5, 10**9, 2**63, "x", [], {}, [1], {"a": 1}, float("nan"), [[[[]]]]]
    text = json.dumps(config).encode()
    for key in config:
        for value in rng.sample(odd, 4):
            yield f"config.json {key}={str(value)[:20]}", json.dumps({**config, key: value}).encode(), weights
        yield f"config.json {key} dropped", json.dumps({k: v for k, v in config.items() if k != key}).encode(), weights
    for what, data in (("nested 100000 deep", b"[" * 100000 + b"]" * 100000), ("an array", b"[]"), ("empty", b""),
                       ("not UTF-8", b"\xff\xfe" + text),
                       ("a 5000-digit number", text[:-1] + b', "n": ' + b"7" * 5000 + b"}"),
                       ("of 32 MB", text + b" " * (32 << 20)), ("truncated", text[:len(text) // 2])):
        yield f"config.json {what}", data, weights
    (n,) = struct.unpack("<Q", weights[:8])
    header, body = json.loads(weights[8:8 + n]), weights[8 + n:]
    names = [k for k in header if k != "__metadata__"]
    for name in rng.sample(names, 6):
        entry = header[name]
        for field, value in (("dtype", "F8"), ("dtype", 5), ("shape", [2**40, 2**40]), ("shape", [-1]), ("shape", "x"),
                             ("shape", [True]), ("data_offsets", [0, 2**62]), ("data_offsets", [8, 4]),
                             ("data_offsets", [0]), ("data_offsets", "x"), ("shape", entry["shape"][::-1] + [1])):
            changed = {**header, name: {**entry, field: value}}
            yield f"safetensors {name}.{field}={str(value)[:20]}", text, safetensors_bytes(changed, body)
        yield f"safetensors {name} an int", text, safetensors_bytes({**header, name: 5}, body)
        others = {k: v for k, v in header.items() if k != name}
        yield f"safetensors {name} dropped", text, safetensors_bytes(others, body)
    for what, data in (("header length 2^62", struct.pack("<Q", 2**62) + weights[8:]),
                       ("header length past the file", struct.pack("<Q", len(weights)) + weights[8:]),
                       ("header not JSON", safetensors_bytes(b"{" + b"x" * 20, body)),
                       ("header an array", safetensors_bytes(b"[1]", body)),
                       ("header nested 100000 deep", safetensors_bytes(b"[" * 100000 + b"]" * 100000, body))):
        yield f"safetensors {what}", text, data
    for _ in range(10):
        yield "safetensors truncated", text, weights[:rng.randrange(len(weights))]
        flipped = bytearray(weights)
        for at in (rng.randrange(8 + n) for _ in range(rng.randint(1, 4))):
            flipped[at] ^= 1 << rng.randrange(8)
        yield "safetensors with bits flipped in its header", text, bytes(flipped)


def hf_cases(work: Path, rng: random.Random) -> Iterator[Case]:
    from refimpl import gemma, qwen35
    from safetensors.numpy import save_file
    from testbed.models import checkpoints, gguf_files, hybrid_checkpoints

    gemma_folder = checkpoints.save_hf_folder(work / "hf-gemma", gemma.tiny_config(layers=2),
                                              gemma.init_weights(gemma.tiny_config(layers=2), 0))
    cfg = qwen35.tiny_config()
    qwen_folder = work / "hf-qwen35"
    qwen_folder.mkdir(parents=True, exist_ok=True)
    (qwen_folder / "config.json").write_text(json.dumps(hybrid_checkpoints.config_to_hf(cfg)))
    save_file(qwen35.init_weights(cfg, 0), str(qwen_folder / "model.safetensors"))
    for label, valid in (("gemma3", gemma_folder), ("qwen35", qwen_folder)):
        config, weights = json.loads((valid / "config.json").read_text()), (valid / "model.safetensors").read_bytes()
        for i, (what, config_bytes, weights_bytes) in enumerate(hf_mutants(config, weights, rng)):
            folder = work / "folders" / f"{label}-{i}"

            def run(folder=folder, config_bytes=config_bytes, weights_bytes=weights_bytes):
                folder.mkdir(parents=True)
                (folder / "config.json").write_bytes(config_bytes)
                (folder / "model.safetensors").write_bytes(weights_bytes)
                try:
                    gguf_files.write_gguf(folder, folder / "out.gguf")
                finally:
                    shutil.rmtree(folder, ignore_errors=True)

            yield Case("hf", f"{label}: {what}", run, (str(folder),))


# --- engine responses, replayed by a real program through the contract ------------------------------

# A response folder's file `NAME.huge` holding a size makes the replaying engine leave NAME as a sparse file
# of that size (nothing written): a huge file costs the test no disk.
REPLAY = """#!/bin/sh
# the response of the case testbed's hostile-input test names in {case_file}, as this request's response
case=$(cat {case_file})
cp -R "$case"/. "$2"/ || exit 1
for marker in "$2"/*.huge "$2"/cache/*.huge; do
    [ -f "$marker" ] || continue
    truncate -s "$(cat "$marker")" "${{marker%.huge}}" && rm "$marker"
done
"""
RECORD = """#!/bin/sh
# testbed-c's answer, kept as the valid response the cases are made from
"{engine}" "$1" "$2"; code=$?
cp -R "$2"/. "{keep}"/
exit $code
"""
ENGINE_YAML = """name: {name}
contract: 1
build: {{prebuilt: {{host: {program}}}}}
program: {program_name}
abis: [host]
supports: {{techniques: [chunk_prefill]}}
invoke: ["{{program}}", "{{request}}", "{{response}}"]
timeout_s: 60
counts: process
"""


def npy_bytes(header: dict | str, data: bytes, version: bytes = b"\x01\x00") -> bytes:
    """An .npy file with this header (a dict as numpy writes it, or any text) and data."""
    text = header if isinstance(header, str) else repr(header)
    text += " " * (-(len(text) + 11) % 64) + "\n"
    size = struct.pack("<H" if version == b"\x01\x00" else "<I", len(text.encode()))
    return b"\x93NUMPY" + version + size + text.encode() + data


def json_mutants(valid: dict, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """A JSON file's mutants: each key's value of another kind, keys dropped, the file broken."""
    odd = [None, True, 1.0, -1, 5, "x", [], {}, [5], [{}], {"a": 1}, "DIGITS", [[[[]]]]]
    for key in valid:
        for value in rng.sample(odd, 4):
            text = json.dumps({**valid, key: value}).replace('"DIGITS"', "9" * 5000)  # a 5000-digit number
            yield f"{key}={str(value)[:20]}", text.encode()
        yield f"{key} dropped", json.dumps({k: v for k, v in valid.items() if k != key}).encode()
    text = json.dumps(valid)
    yield "nested 100000 deep", b"[" * 100000 + b"]" * 100000
    yield "an object nested 100000 deep", b'{"a":' * 100000 + b"1" + b"}" * 100000
    yield "an array, not an object", json.dumps([valid]).encode()
    yield "NaN and Infinity", text.replace("1", "NaN", 1).encode()
    yield "not UTF-8", b"\xff\xfe" + text.encode()
    yield "a 5000-digit number", ("[" + "7" * 5000 + "]").encode()
    for _ in range(4):
        yield "truncated", text[:rng.randrange(len(text))].encode()
        at = rng.randrange(len(text))
        yield f"a byte changed at {at}", text[:at].encode() + bytes([rng.randrange(256)]) + text[at + 1:].encode()


def response_mutants(valid: Path, rng: random.Random) -> Iterator[tuple[str, dict[str, bytes | None]]]:
    """(what was changed, {file: new bytes or None to delete it}) over a valid response folder."""
    status = json.loads((valid / "status.json").read_text())
    timings = json.loads((valid / "timings.json").read_text())
    logits = np.load(valid / "logits.npy")
    k0 = np.load(valid / "cache" / "k_0.npy")
    rows, vocab = k0.shape[1], logits.shape[1]
    for name in ("status.json", "timings.json", "logits.npy", "cache/k_0.npy", "cache/v_1.npy"):
        whole = (valid / name).read_bytes()
        yield f"{name} deleted", {name: None}
        yield f"{name} empty", {name: b""}
        yield f"{name} of 2^40 bytes (sparse)", {name: None, f"{name}.huge": str(2**40).encode()}
        for _ in range(3):
            yield f"{name} truncated", {name: whole[:rng.randrange(len(whole))]}
            flipped = bytearray(whole)
            for at in (rng.randrange(min(len(whole), 160)) for _ in range(rng.randint(1, 3))):
                flipped[at] ^= 1 << rng.randrange(8)
            yield f"{name} with bits flipped in its first 160 bytes", {name: bytes(flipped)}
        yield f"{name} with 1 MB of garbage after it", {name: whole + bytes(rng.randrange(256) for _ in range(1 << 20))}
    for what, data in json_mutants(status, rng):
        yield f"status.json {what}", {"status.json": data}
    for what, value in (("contract true", True), ("contract 1.0", 1.0), ("contract '1'", "1"), ("contract 2", 2)):
        yield f"status.json {what}", {"status.json": json.dumps({**status, "contract": value}).encode()}
    for what, data in json_mutants(timings, rng):
        yield f"timings.json {what}", {"timings.json": data}
    call = timings["calls"][0]
    for what, calls in (("calls[0].wall_s=-1", [{**call, "wall_s": -1}]),
                        ("calls[0].cpu_s='1'", [{**call, "cpu_s": "1"}]),
                        ("calls[0].wall_s=1e400", None), ("calls[0].name=5", [{**call, "name": 5}]),
                        ("calls=[5]", [5]), ("100000 calls", [call] * 10**5)):
        text = json.dumps({**timings, "calls": calls}) if calls is not None else \
            json.dumps({**timings, "calls": [{**call, "wall_s": 7.5}]}).replace("7.5", "1e400")
        yield f"timings.json {what}", {"timings.json": text.encode()}
    for marks in (5, "chunk", [1], [{"a": 1}], ["chunk"] * (len(timings["calls"]) + 1), None, []):
        marked = json.dumps({**timings, "marks": marks}).encode()
        yield f"timings.json marks={str(marks)[:30]}", {"timings.json": marked}
    header = {"descr": "<f4", "fortran_order": False, "shape": logits.shape}
    body = logits.astype("<f4").tobytes()
    for what, h, data in (
            ("shape (10^6, 10^6)", {**header, "shape": (10**6, 10**6)}, body),
            ("shape (2^62,)", {**header, "shape": (2**62,)}, body),
            ("shape (-1, vocab)", {**header, "shape": (-1, vocab)}, body),
            ("one column short", {**header, "shape": (1, vocab - 1)}, body[:-4]),
            ("one row more", {**header, "shape": (2, vocab)}, body * 2),
            ("no rows", {**header, "shape": (0, vocab)}, b""),
            ("1-D", {**header, "shape": (vocab,)}, body),
            ("float64", {**header, "descr": "<f8"}, logits.astype("<f8").tobytes()),
            ("big-endian float32", {**header, "descr": ">f4"}, logits.astype(">f4").tobytes()),
            ("float16", {**header, "descr": "<f2"}, logits.astype("<f2").tobytes()),
            ("int32", {**header, "descr": "<i4"}, body),
            ("objects (a pickle)", {**header, "descr": "|O"}, b"\x80\x04K\x01."),
            ("a structured dtype", {**header, "descr": [("a", "<f4")]}, body),
            ("Fortran order", {**header, "fortran_order": True}, body),
            ("data 4 bytes short", header, body[:-4]),
            ("data 4 bytes long", header, body + b"\0" * 4),
            ("a NaN", header, np.concatenate([[np.nan], logits.ravel()[1:]]).astype("<f4").tobytes()),
            ("an infinity", header, np.concatenate([[np.inf], logits.ravel()[1:]]).astype("<f4").tobytes()),
            ("a header that is not a dict", "[1, 2, 3]", body),
            ("a header missing shape", "{'descr': '<f4', 'fortran_order': False}", body),
            ("a header nested 10000 deep", "{'descr': '<f4', 'fortran_order': False, 'shape': " + "(" * 10000
             + ")" * 10000 + "}", body),
            ("a header calling a function",
             "{'descr': '<f4', 'fortran_order': False, 'shape': __import__('os')}", body)):
        yield f"logits.npy {what}", {"logits.npy": npy_bytes(h, data)}
    yield "logits.npy format version 3.0", {"logits.npy": npy_bytes(header, body, b"\x03\x00")}
    yield "logits.npy header length 2^32-1", {"logits.npy": b"\x93NUMPY\x02\x00\xff\xff\xff\xff{"}
    k_header = {"descr": "<f4", "fortran_order": False, "shape": k0.shape}
    heads, _, dim = k0.shape
    for what, shape in (("one row more than P+n+C", (heads, rows + 1)), ("10^9 rows", (heads, 10**9)),
                        ("another head count", (heads + 1, rows)), ("two dimensions", (heads * rows,))):
        full = (*shape, dim) if len(shape) == 2 else (shape[0], dim)
        data = np.zeros(full, "<f4").tobytes() if np.prod(full) < 10**7 else k0.tobytes()
        yield f"cache/k_0.npy with {what}", {"cache/k_0.npy": npy_bytes({**k_header, "shape": full}, data)}
    yield "cache/v_1.npy with a row fewer than k_1", {"cache/v_1.npy": npy_bytes(
        {**k_header, "shape": (heads, rows - 1, dim)}, k0[:, 1:].astype("<f4").tobytes())}


def response_cases(work: Path, rng: random.Random) -> Iterator[Case]:
    from refimpl import gemma
    from testbed import devices
    from testbed.backends.engine import gemma as engine_gemma, runner as engine_runner, spec as engine_spec
    from testbed.backends.native import build as kernel_build
    from testbed.backends.native.engine import export_weights
    from testbed.devices import load_profile

    cfg = gemma.tiny_config()
    model = export_weights(cfg, gemma.init_weights(cfg, 0), folder=work / "weights")
    request = engine_runner.Request("chunk_prefill", np.arange(12, dtype=np.int32) % cfg.vocab, model, past=5,
                                    chunk=4, logits_at=[11], config=engine_gemma.model_config(cfg, "f32", 32))
    expect = engine_runner.Expect(cfg.vocab, cfg.layers, cfg.kv_heads, cfg.head_dim)
    device = devices.connect(load_profile("host"))
    engines = work / "engines"
    engines.mkdir(parents=True, exist_ok=True)

    def engine(name: str, script: str):
        program = engines / f"{name}.sh"
        program.write_text(script)
        program.chmod(0o755)
        (engines / f"{name}.yaml").write_text(ENGINE_YAML.format(name=name, program=program, program_name=program.name))
        spec = engine_spec.parse(engines / f"{name}.yaml")
        return spec, program

    valid = work / "response-valid"
    shutil.rmtree(valid, ignore_errors=True)
    valid.mkdir(parents=True)
    real = kernel_build.build_programs("host") / "tb_model_engine"
    spec, program = engine("record", RECORD.format(engine=real, keep=valid))
    answer = engine_runner.call(device, spec, request, expect, program)
    assert answer.status == "ok" and answer.cache_k is not None, "testbed-c's response is the cases' valid base"
    case_file = work / "response-case"
    spec, program = engine("replay", REPLAY.format(case_file=case_file))
    for i, (what, changes) in enumerate(response_mutants(valid, rng)):
        def run(i=i, changes=changes):
            folder = work / "responses" / str(i)
            shutil.rmtree(folder, ignore_errors=True)
            shutil.copytree(valid, folder)
            for name, data in changes.items():
                (folder / name).unlink(missing_ok=True)
                if data is not None:
                    (folder / name).write_bytes(data)
            case_file.write_text(str(folder))
            try:
                engine_runner.call(device, spec, request, expect, program)
            finally:
                shutil.rmtree(folder, ignore_errors=True)

        yield Case("response", what, run, ("response/",))


# --- engine yamls --------------------------------------------------------------------------------------

YAML_ODD = ["null", "true", "1", "1.0", ".inf", ".nan", "x", "[]", "{}", "[1]", "{a: 1}", "'{nosuch}'",
            "[[[[[[1]]]]]]", "'" + "y" * 100000 + "'"]
WORD_ODD = ["{nosuch}", "{", "}", "a{b", "{program!r}", "{program:>9}", "{program[0]}", "{program.x}", "{0}", "{}",
            "{program};ls", "{program} x", "a b", "$(id)", "{{program}}", "\u2028"]


def yaml_text(fields: dict) -> str:
    return "".join(f"{k}: {v}\n" for k, v in fields.items())


def yaml_mutants(base: dict, word_keys: tuple[str, ...], rng: random.Random) -> Iterator[tuple[str, str | bytes]]:
    for key in base:
        for value in rng.sample(YAML_ODD, 5):
            yield f"{key}={value[:20]}", yaml_text({**base, key: value})
        yield f"{key} dropped", yaml_text({k: v for k, v in base.items() if k != key})
    for key in word_keys:
        for word in rng.sample(WORD_ODD, 8):
            for at in (0, 1):
                words = json.loads(base[key]) if key == "invoke" else None
                if key == "invoke":
                    words[at] = word
                    yield f"invoke[{at}]={word!r}", yaml_text({**base, "invoke": json.dumps(words)})
                else:
                    command = json.loads(base["build"][len("{command: "):-1])
                    command[at] = word
                    built = f"{{command: {json.dumps(command)}}}"
                    yield f"build.command[{at}]={word!r}", yaml_text({**base, "build": built})
    text = yaml_text(base)
    yield "an alias of an alias, nine deep", "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")) + text.replace(
        "supports:", "description: *i\nsupports:", 1)
    yield "a list holding itself", text + "extra: &loop [*loop]\n"
    yield "nested 100000 deep", "name: " + "[" * 100000 + "]" * 100000 + "\n"
    yield "2 MB long", text + "# " + "z" * (2 << 20) + "\n"
    yield "not UTF-8", b"\xff\xfe" + text.encode()
    yield "a tab indent", text.replace("supports:", "supports:\n\t", 1)
    yield "a YAML tag", text.replace("name: ", "name: !!python/object:os.system ", 1)
    for _ in range(6):
        yield "truncated", text[:rng.randrange(len(text))]
        at = rng.randrange(len(text))
        yield f"a character changed at {at}", text[:at] + chr(rng.choice(b"{}[]:,'\"&*!|>-#%@` \t\n")) + text[at + 1:]


def yaml_cases(work: Path, rng: random.Random) -> Iterator[Case]:
    from testbed.backends.engine import build, spec as engine_spec
    from testbed.backends.native import build as kernel_build

    lab = work / "yamls"
    (lab / "engines").mkdir(parents=True, exist_ok=True)
    source = lab / "src"
    source.mkdir(exist_ok=True)
    (source / "engine.c").write_text("int main(void) { return 0; }\n")
    program = kernel_build.build_programs("host") / "tb_model_engine"
    files = {"prog": program.read_bytes(), "random": bytes(rng.randrange(256) for _ in range(4096)), "empty": b"",
             "script": b"#!/bin/sh\nexit 0\n", "text": b"echo hi\n"}
    other = next((p for p in Path("/usr/aarch64-linux-gnu/lib").glob("libc.so*") if p.is_file()), None)
    if other is not None:  # an ELF for another machine
        files["aarch64"] = other.read_bytes()
    for name, data in files.items():
        (lab / name).write_bytes(data)
        (lab / name).chmod(0o755)
    prebuilt = {"name": "x", "contract": "1", "program": "prog", "abis": "[host]",
                "supports": "{techniques: [chunk_prefill], model_formats: [safetensors]}",
                "invoke": json.dumps(["{program}", "{request}", "{response}"]), "timeout_s": "60",
                "counts": "marked", "build": "{prebuilt: {host: ../prog}}"}
    command = {**prebuilt, "source": "../src", "build": "{command: " + json.dumps(
        ["cc", "-o", "{out}/prog", "{source}/engine.c", "-DJOBS={jobs}", "-DABI={abi}"]) + "}"}
    texts = [(f"prebuilt yaml: {w}", t) for w, t in yaml_mutants(prebuilt, ("invoke",), rng)]
    texts += [(f"command yaml: {w}", t) for w, t in yaml_mutants(command, ("build",), rng)]
    texts += [(f"prebuilt.host is {name}", yaml_text({**prebuilt, "build": f"{{prebuilt: {{host: ../{name}}}}}"}))
              for name in files if name != "prog"]
    for what, name in (("with a NUL", '"a\\0b"'), ("of 5000 characters", "y" * 5000), ("/dev/zero", "/dev/zero")):
        texts += [(f"prebuilt.host {what}", yaml_text({**prebuilt, "build": f"{{prebuilt: {{host: {name}}}}}"})),
                  (f"source {what}", yaml_text({**command, "source": name}))]
    texts += [("prebuilt.host a folder", yaml_text({**prebuilt, "build": "{prebuilt: {host: ../src}}"}))]
    texts += [("prebuilt.host is missing", yaml_text({**prebuilt, "build": "{prebuilt: {host: ../nothing}}"})),
              ("abis lists aarch64 with no prebuilt", yaml_text({**prebuilt, "abis": "[host, aarch64]"})),
              ("source is a file", yaml_text({**command, "source": "../prog"}))]
    path = lab / "engines" / "x.yaml"
    link = source / "outside"
    for what, text in [*texts, ("source holds a link out of it", None)]:
        def run(text=text):
            if text is None:
                link.symlink_to("/etc/passwd")
                text = yaml_text(command)
            path.write_bytes(text if isinstance(text, bytes) else text.encode())
            try:
                spec = engine_spec.parse(path)
                if spec.prebuilt is not None:
                    build.program_for(spec, "host")
            finally:
                link.unlink(missing_ok=True)

        yield Case("yaml", what, run, (str(path),))


# --- users' IREE folders --------------------------------------------------------------------------------


def manifest_mutants(manifest: dict, module: bytes, rng: random.Random) -> Iterator[tuple[str, dict | bytes, bytes]]:
    """(what was changed, the manifest (a dict, or raw bytes), the module's bytes)."""
    odd = [None, True, 5, 1.5, "x", [], {}, ["module.vmfb"], {"path": 5}, [[[]]]]
    for key in ("contract", "files", "function", "parameter_scope", "model"):
        for value in rng.sample(odd, 5):
            yield f"{key}={str(value)[:20]}", {**manifest, key: value}, module
    files = manifest["files"]
    for value in ("module.vmfb", ["module.vmfb"], {"module": "module.vmfb"}, {"module": ["module.vmfb"]},
                  {"module": {"path": None}}, {"module": {"path": "../module.vmfb"}},
                  {"module": {"path": "/etc/passwd.vmfb"}}, {"module": {"path": "module.vmfb", "sha256": 5}},
                  {"module": {"path": "module.vmfb", "sha256": "0" * 64}},
                  {**files, "parameters": {"path": "nothing.irpa"}}, {**files, "parameters": "module.vmfb"},
                  {"module": {"path": "x" * 5000 + ".vmfb"}}, {"module": {"path": "a\0b.vmfb"}}):
        yield f"files={str(value)[:40]}", {**manifest, "files": value}, module
    contract = manifest["contract"]
    for what, changed in (("version true", {**contract, "version": True}),
                          ("version 1.0", {**contract, "version": 1.0}),
                          ("args as a dict", {**contract, "args": {}}), ("args [5]", {**contract, "args": [5]}),
                          ("an arg of shape [1e9, 1e9]", {**contract, "args": [{**contract["args"][0],
                                                                                 "shape": [10**9, 10**9]}]}),
                          ("an arg of shape 'x'", {**contract, "args": [{**contract["args"][0], "shape": "x"}]}),
                          ("an arg of shape [-1]", {**contract, "args": [{**contract["args"][0], "shape": [-1]}]}),
                          ("100000 args", {**contract, "args": contract["args"] * (10**5 // len(contract["args"]))}),
                          ("results reversed", {**contract, "results": contract["results"][::-1]}),
                          ("k_0 of two dimensions", {**contract, "args": [
                              {**a, "shape": a["shape"][:2]} if a["name"] == "k_0" else a for a in contract["args"]]})):
        yield f"contract {what}", {**manifest, "contract": changed}, module
    text = json.dumps(manifest)
    yield "manifest nested 100000 deep", b"[" * 100000 + b"]" * 100000, module
    yield "manifest of 8 MB", text.encode() + b" " * (8 << 20), module
    yield "manifest not JSON", text[:len(text) // 2].encode(), module
    yield "manifest an array", b"[]", module
    yield "manifest with a 5000-digit number", (text[:-1] + ', "n": ' + "9" * 5000 + "}").encode(), module
    yield "module empty", manifest, b""
    yield "module random bytes", manifest, bytes(rng.randrange(256) for _ in range(4096))
    yield "module an ELF", manifest, Path(sys.executable).resolve().read_bytes()[:65536]
    for _ in range(12):
        yield "module truncated", manifest, module[:rng.randrange(len(module))]
        flipped = bytearray(module)
        for at in (rng.randrange(len(module)) for _ in range(rng.randint(1, 8))):
            flipped[at] ^= 1 << rng.randrange(8)
        yield "module with bits flipped", manifest, bytes(flipped)


def manifest_cases(work: Path, rng: random.Random) -> Iterator[Case]:
    from refimpl import gemma
    from testbed.backends.iree import user_module
    from testbed.backends.iree.graphs import gemma as graphs

    # the shape of tests/test_iree_user_module.py: its compile is shared through the cache
    cfg = gemma.tiny_config(layers=2, layer_types=("local", "global"), window=16)
    valid = work / "user-valid"
    shutil.rmtree(valid, ignore_errors=True)
    user_module.write_user_folder(valid, graphs.prefill_with_past(cfg, gemma.init_weights(cfg, 0), 8, 40), cfg,
                                  form="vmfb", target="host")
    user_module.load(valid, cfg, "host")  # the base is accepted
    manifest = json.loads((valid / "manifest.json").read_text())
    manifest["files"]["module"].pop("sha256")  # so a changed module reaches the loader
    module = (valid / "module.vmfb").read_bytes()
    for i, (what, changed, module_bytes) in enumerate(manifest_mutants(manifest, module, rng)):
        folder = work / "users" / str(i)

        def run(folder=folder, changed=changed, module_bytes=module_bytes):
            shutil.copytree(valid, folder)
            text = changed if isinstance(changed, bytes) else json.dumps(changed).encode()
            (folder / "manifest.json").write_bytes(text)
            (folder / "module.vmfb").write_bytes(module_bytes)
            try:
                user_module.load(folder, cfg, "host")
            finally:
                shutil.rmtree(folder, ignore_errors=True)

        yield Case("manifest", what, run, (str(folder), "module.vmfb"))


# --- running the cases ------------------------------------------------------------------------------


@dataclass
class Case:
    surface: str
    name: str
    run: Callable[[], object]    # hands the input to testbed's entry point
    names: tuple[str, ...]       # what the one-line error names (one of: the file, or its name in the contract)


def outcome(case: Case, limit_as: int = 0) -> dict:
    """The case run: accepted, or testbed's own error (one line, its exit status), or a traceback. With
    `limit_as` (bytes), the process's address space is bounded while the case runs: an allocation past it
    fails at once (MemoryError: a traceback), however few of its pages would have been touched."""
    from testbed.errors import DeviceError, DeviceUnreachable, StoreError, ToolMissing, UsageError

    reset_peak_rss()
    cpu = time.process_time()
    said = {"surface": case.surface, "case": case.name}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        if limit_as:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, hard))
        case.run()
        said |= {"outcome": "accepted", "exit": 0, "message": ""}
    except (UsageError, ToolMissing, DeviceUnreachable, DeviceError, StoreError) as e:
        said |= {"outcome": "refused", "exit": e.exit_status, "message": str(e), "error": type(e).__name__}
    except BaseException as e:  # noqa: BLE001 -- what the test counts: anything but testbed's own errors
        said |= {"outcome": "traceback", "exit": 1, "message": f"{type(e).__name__}: {e}"[:2000],
                 "traceback": "".join(traceback.format_exception(e, limit=-8))[-3000:]}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    said["cpu_s"] = time.process_time() - cpu
    said["peak_rss_mb"] = status_mb("VmHWM")
    said["names"] = case.names
    return said


def status_mb(field: str) -> float | None:
    """A size of this process from /proc/self/status (VmHWM: its peak resident set), in MiB."""
    status = Path("/proc/self/status").read_text() if Path("/proc/self/status").is_file() else ""
    return next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith(f"{field}:")), None)


def reset_peak_rss() -> None:
    """Start VmHWM again from the resident set now (Linux: "5" to clear_refs), so a case's peak is its own,
    not the bases this process built before it (jax for the IREE module)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def gguf_cases(work: Path, rng: random.Random) -> Iterator[Case]:
    from refimpl import gemma, qwen35
    from testbed.models import gguf_files

    for label, cfg, init in (("gemma3", gemma.tiny_config(), gemma.init_weights),
                             ("qwen35", qwen35.tiny_config(), qwen35.init_weights)):
        valid = gguf_files.gguf_of(cfg, init(cfg, 0), work / "valid")
        for i, (what, data) in enumerate(gguf_mutants(read_parts(valid), rng)):
            path = work / "gguf" / f"{label}-{i}.gguf"

            def run(path=path, data=data):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                try:
                    gguf_files.load_gguf(path)
                finally:
                    path.unlink()

            yield Case("gguf", f"{label}: {what}", run, (str(path),))


SURFACES = {"gguf": gguf_cases, "hf": hf_cases, "response": response_cases, "yaml": yaml_cases,
            "manifest": manifest_cases}


def main(argv: list[str] | None = None) -> int:
    a = argparse.ArgumentParser(prog="python -m tests.hostile_inputs", description=__doc__.splitlines()[0])
    a.add_argument("work", type=Path, help="a folder for the inputs (made, left for the caller to remove)")
    a.add_argument("--seed", type=int, default=44)
    a.add_argument("--surfaces", default=",".join(SURFACES))
    a.add_argument("--limit-as", type=int, default=0, help="RLIMIT_AS in MiB while each case runs (0: none)")
    args = a.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ["TESTBED_RESULTS"] = str(args.work / "results")  # the host device's work folder is in it
    rng = random.Random(args.seed)
    for surface in args.surfaces.split(","):
        for case in SURFACES[surface](args.work, rng):
            print(json.dumps(outcome(case, args.limit_as << 20)), flush=True)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "peak_vm_mb": status_mb("VmPeak")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
