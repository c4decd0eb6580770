"""GGUF files read as llama.cpp's loader reads them (ggml/src/gguf.cpp, gguf_init_from_reader), in memory
bounded by the file.

Every count and length in the file (tensors, key-value pairs, a string's bytes, an array's entries, a
tensor's dimensions) is checked against the bytes left in the file before anything is made of it, so a
header claiming 10^9 tensors or a 2^60-entry array is one UsageError naming the file, the item and the
value, never an allocation. What gguf.cpp refuses is refused here too, with its reason: another magic or
version, an empty or duplicate key, a nested array, an unknown value or tensor type, a duplicate tensor
name, more than four dimensions, a row that is not a whole number of blocks, `general.alignment` that
is not a uint32 power of two, a tensor whose offset is not where the previous one ends (padded to the
alignment), data past the end of the file.

The file is memory-mapped: numeric arrays and tensor data are views into it (read-only), so opening a
file costs its header, not its weights. The `gguf` package supplies the format's tables (value and
tensor types, block sizes) and the dequantization; its GGUFReader is not used, because it builds
Python objects per array entry before anything can be checked (a 10^6-entry array took 778 MB).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from testbed.errors import UsageError
from testbed.inputs import shown

MAGIC = b"GGUF"
VERSIONS = (2, 3)          # gguf.cpp: version 1 is no longer read, past 3 is not known
MAX_DIMS = 4               # GGML_MAX_DIMS
MAX_NAME = 64              # GGML_MAX_NAME: a tensor name is shorter
DEFAULT_ALIGNMENT = 32     # GGUF_DEFAULT_ALIGNMENT
ALIGNMENT_KEY = "general.alignment"

# GGUF value types (gguf.GGUFValueType): struct format of each scalar; 8 string, 9 array.
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
INTEGER_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
FLOAT_TYPES = frozenset({6, 12})
BOOL_TYPE = 7
TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
              8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}


@dataclass(frozen=True)
class Field:
    """One metadata key's value: a Python int, float, bool or str; an array of numbers or bools is a
    read-only numpy view into the file, an array of strings a tuple. `kind` is the GGUF value type,
    `item` the entry type of an array (None otherwise)."""

    value: object
    kind: int
    item: int | None = None

    @property
    def type_name(self) -> str:
        return f"array of {TYPE_NAMES[self.item]}" if self.kind == ARRAY else TYPE_NAMES[self.kind]


@dataclass(frozen=True)
class Tensor:
    """A tensor's header and its bytes in the file: `shape` in numpy's order (ggml's ne reversed)."""

    name: str
    tensor_type: int
    shape: tuple[int, ...]
    nbytes: int
    raw: np.ndarray        # uint8 view of its bytes, rows of whole blocks: [..., ne0 / block * type_size]

    def float32(self, path: Path, rows: int | None = None) -> np.ndarray:
        """The tensor dequantized to float32 (a copy: at most 8 bytes per byte of the file's data); with
        `rows`, only its first rows (0: nothing, only its type checked to be one testbed dequantizes)."""
        import gguf

        qtype = gguf.GGMLQuantizationType(self.tensor_type)
        raw = self.raw if rows is None else self.raw.reshape(-1, self.raw.shape[-1])[:rows]
        try:
            out = gguf.quants.dequantize(raw, qtype)
        except NotImplementedError:
            raise UsageError(f"{path}: tensor {self.name!r} has type {qtype.name}, which testbed cannot dequantize; "
                             f"accepted: F32, F16, BF16 and the quantized types of the gguf package") from None
        return np.asarray(out, np.float32).reshape(self.shape if rows is None else (-1, self.shape[-1]))


@dataclass(frozen=True)
class GGUF:
    path: Path
    version: int
    fields: dict[str, Field]
    tensors: dict[str, Tensor]
    alignment: int
    data_offset: int

    @property
    def largest_dimension(self) -> int:
        """The largest extent of any tensor: no dimension of the model can be larger, so counts read
        from the metadata are bounded by what the file holds."""
        return max((d for t in self.tensors.values() for d in t.shape), default=0)


class _Cursor:
    """Reads the file front to back; every read is checked against the bytes left."""

    def __init__(self, path: Path, data: np.ndarray):
        self.path, self.data, self.at, self.size = path, data, 0, int(data.size)

    def refuse(self, what: str) -> UsageError:
        return UsageError(f"{self.path}: not a GGUF file as llama.cpp reads it: {what} (at byte {self.at} of "
                          f"{self.size})")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.at:
            raise self.refuse(f"{what} needs {n} bytes, {self.size - self.at} are left")

    def scalar(self, kind: int, what: str):
        fmt = "<" + SCALARS[kind]
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += n
        return value

    def text(self, what: str, limit: int | None = None) -> str:
        n = self.scalar(10, f"{what}'s length")
        if limit is not None and n >= limit:
            raise self.refuse(f"{what} is {n} bytes long; accepted: fewer than {limit}")
        self.need(n, what)
        raw = bytes(self.data[self.at:self.at + n])
        self.at += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.refuse(f"{what} is not UTF-8: {shown(raw)}") from None

    def array(self, key: str) -> Field:
        item = self.scalar(4, f"key {key!r}'s array type")
        count = self.scalar(10, f"key {key!r}'s array length")
        if item == ARRAY:
            raise self.refuse(f"key {key!r} is an array of arrays; accepted: arrays of numbers, bools or strings")
        if item not in SCALARS and item != STRING:
            raise self.refuse(f"key {key!r} is an array of type {item}; accepted: "
                              f"{', '.join(sorted(TYPE_NAMES.values()))}")
        least = 8 if item == STRING else struct.calcsize(SCALARS[item])  # bytes per entry, at the least
        if count > (self.size - self.at) // least:
            raise self.refuse(f"key {key!r} claims {count} entries of {TYPE_NAMES[item]}, the {self.size - self.at} "
                              f"bytes left hold at most {(self.size - self.at) // least}")
        if item == STRING:
            return Field(tuple(self.text(f"key {key!r} entry {i}") for i in range(count)), ARRAY, item)
        dtype = np.dtype("<" + SCALARS[item]) if item != BOOL_TYPE else np.dtype(np.bool_)
        values = self.data[self.at:self.at + count * dtype.itemsize].view(dtype)
        if item == BOOL_TYPE and values.size and int(self.data[self.at:self.at + count].max()) > 1:
            raise self.refuse(f"key {key!r} holds a bool that is neither 0 nor 1")
        self.at += count * dtype.itemsize
        return Field(values, ARRAY, item)

    def value(self, key: str) -> Field:
        kind = self.scalar(4, f"key {key!r}'s type")
        if kind == STRING:
            return Field(self.text(f"key {key!r}'s value"), kind)
        if kind == ARRAY:
            return self.array(key)
        if kind not in SCALARS:
            raise self.refuse(f"key {key!r} has type {kind}; accepted: {', '.join(sorted(TYPE_NAMES.values()))}")
        value = self.scalar(kind, f"key {key!r}'s value")
        if kind == BOOL_TYPE and self.data[self.at - 1] > 1:
            raise self.refuse(f"key {key!r} is a bool of byte {int(self.data[self.at - 1])}; accepted: 0 or 1")
        return Field(value, kind)


def read(path: str | Path) -> GGUF:
    """The file's metadata and tensors, checked as gguf.cpp checks them (see the module docstring)."""
    import gguf

    path = Path(path)
    try:
        size = path.stat().st_size
        data = np.memmap(path, np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: cannot be read as a GGUF file: {getattr(e, 'strerror', None) or e}") from None
    c = _Cursor(path, data)
    c.need(4, "the magic")
    if bytes(data[:4]) != MAGIC:
        raise c.refuse(f"the magic is {shown(bytes(data[:4]))}; accepted: {MAGIC!r}")
    c.at = 4
    version = c.scalar(4, "the version")
    if version & 0xFFFF == 0 and version:
        raise c.refuse(f"version {version} (a big-endian file?); accepted: little-endian versions "
                       f"{', '.join(map(str, VERSIONS))}")
    if version not in VERSIONS:
        raise c.refuse(f"version {version}; accepted: {', '.join(map(str, VERSIONS))}")
    n_tensors, n_kv = c.scalar(11, "the tensor count"), c.scalar(11, "the key count")
    # each key takes at least 8 (length) + 1 (a byte of key) + 4 (type) + 1 bytes; each tensor's header
    # 8 (length) + 1 + 4 (dims) + 4 (type) + 8 (offset)
    for count, least, what in ((n_kv, 14, "key-value pairs"), (n_tensors, 25, "tensors")):
        if not 0 <= count <= (size - c.at) // least:
            raise c.refuse(f"the header claims {count} {what}; the {size - c.at} bytes left hold at most "
                           f"{(size - c.at) // least}")
    fields: dict[str, Field] = {}
    for i in range(n_kv):
        key = c.text(f"key {i}")
        if not key:
            raise c.refuse(f"key {i} is empty")
        if key in fields:
            raise c.refuse(f"key {key!r} is given twice")
        fields[key] = c.value(key)
    alignment = fields.get(ALIGNMENT_KEY, Field(DEFAULT_ALIGNMENT, 4))
    if alignment.kind != 4 or alignment.value == 0 or alignment.value & (alignment.value - 1):
        raise c.refuse(f"{ALIGNMENT_KEY}={shown(alignment.value)} ({alignment.type_name}); accepted: a uint32 power "
                       f"of two")
    alignment = int(alignment.value)
    headers = []
    for i in range(n_tensors):
        name = c.text(f"tensor {i}'s name", limit=MAX_NAME)
        if any(name == h[0] for h in headers):
            raise c.refuse(f"tensor {name!r} is given twice")
        n_dims = c.scalar(4, f"tensor {name!r}'s dimension count")
        if n_dims > MAX_DIMS:
            raise c.refuse(f"tensor {name!r} has {n_dims} dimensions; accepted: at most {MAX_DIMS}")
        ne = [c.scalar(11, f"tensor {name!r}'s dimension {j}") for j in range(n_dims)]
        if any(d < 0 for d in ne):
            raise c.refuse(f"tensor {name!r} has dimensions {ne}; accepted: none negative")
        kind = c.scalar(4, f"tensor {name!r}'s type")
        if kind not in gguf.GGMLQuantizationType._value2member_map_:
            raise c.refuse(f"tensor {name!r} has type {kind}; accepted: a ggml type "
                           f"({', '.join(t.name for t in gguf.GGMLQuantizationType)})")
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        row = ne[0] if ne else 1
        if row % block:
            raise c.refuse(f"tensor {name!r} has rows of {row} values, not a whole number of "
                           f"{gguf.GGMLQuantizationType(kind).name} blocks of {block}")
        elements = int(np.prod(ne, dtype=object)) if ne else 1
        headers.append((name, kind, tuple(reversed(ne)) or (1,), elements // block * type_size, block, type_size,
                        c.scalar(10, f"tensor {name!r}'s offset")))
    data_offset = -(-c.at // alignment) * alignment if n_tensors else c.at
    tensors, expected = {}, 0
    for name, kind, shape, nbytes, block, type_size, offset in headers:
        if offset != expected:
            raise c.refuse(f"tensor {name!r} is at offset {offset}; llama.cpp reads it at {expected} (where the one "
                           f"before it ends, padded to {alignment})")
        begin = data_offset + offset
        if begin + nbytes > size:
            raise c.refuse(f"tensor {name!r} ({nbytes} bytes at byte {begin}) runs past the end of the file")
        byte_shape = (*shape[:-1], shape[-1] // block * type_size)
        tensors[name] = Tensor(name, kind, shape, nbytes, data[begin:begin + nbytes].reshape(byte_shape))
        expected += -(-nbytes // alignment) * alignment
    return GGUF(path, version, fields, tensors, alignment, data_offset)
