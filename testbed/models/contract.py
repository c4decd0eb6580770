"""The graph contract: the arguments and results of each Gemma graph, in order, with shapes and dtypes.

A compiled graph (IREE module, native library) takes flat positional arguments, so their order is an
interface between the exporter, the host that feeds it and every backend. The order (seed 000):

    tokens; then per layer in order: the cos and sin tables of its RoPE base on first use, its K, its
    V, and its layer type's mask on first use; the one-hot select last.

Results: the selected row's logits, then per layer its K and V. For the FunctionGemma shape (18
layers, two layer types) prefill_with_past has 1 + 2*2 + 18*2 + 2 + 1 = 44 arguments and
1 + 18*2 = 37 results.

`pack_prefill_with_past` lays out host arrays in that order and `unpack_results` reads results back,
so every backend feeds the same bytes. Every artifact is written with a manifest (JSON): the contract,
the model config and the sha256 of each file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refimpl.gemma import ChunkInputs, GemmaConfig

CONTRACT_VERSION = 1
GRAPHS = ("decode_with_past", "prefill_at", "redecode", "prefill_with_past")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    def check(self, array: np.ndarray) -> None:
        if tuple(array.shape) != self.shape or np.dtype(array.dtype) != np.dtype(self.dtype):
            raise ValueError(f"{self.name}: got {array.dtype}{tuple(array.shape)}, "
                             f"the contract says {self.dtype}{self.shape}")


@dataclass(frozen=True)
class Contract:
    graph: str
    version: int
    args: tuple[TensorSpec, ...]
    results: tuple[TensorSpec, ...]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


def _cache_args(cfg: GemmaConfig, rows_per_type: dict[str, int], past: int, dtype: str, with_tables: bool):
    """The per-layer block shared by the with-past graphs: tables and mask of a type on first use."""
    args, seen = [], set()
    for i, t in enumerate(cfg.layer_types):
        first = t not in seen
        seen.add(t)
        rows = rows_per_type[t]
        if first and with_tables:
            args += [TensorSpec(f"cos_{t}", (rows, cfg.head_dim), "float32"),
                     TensorSpec(f"sin_{t}", (rows, cfg.head_dim), "float32")]
        args += [TensorSpec(f"k_{i}", (cfg.kv_heads, past, cfg.head_dim), dtype),
                 TensorSpec(f"v_{i}", (cfg.kv_heads, past, cfg.head_dim), dtype)]
        if first and with_tables:
            args.append(TensorSpec(f"mask_{t}", (1, cfg.heads, rows, past + rows), "float32"))
    return args


def _results(cfg: GemmaConfig, rows: int | None, dtype: str) -> tuple[TensorSpec, ...]:
    out = [TensorSpec("logits", (cfg.vocab,), "float32")]
    if rows is not None:
        for i in range(cfg.layers):
            out += [TensorSpec(f"k_{i}_out", (cfg.kv_heads, rows, cfg.head_dim), dtype),
                    TensorSpec(f"v_{i}_out", (cfg.kv_heads, rows, cfg.head_dim), dtype)]
    return tuple(out)


def prefill_with_past_contract(cfg: GemmaConfig, chunk: int, past: int, kv_dtype: str = "float32") -> Contract:
    per_type = {t: chunk for t in cfg.types_in_use}
    args = [TensorSpec("tokens", (chunk,), "int32"), *_cache_args(cfg, per_type, past, kv_dtype, True),
            TensorSpec("select", (chunk,), "float32")]
    return Contract("prefill_with_past", CONTRACT_VERSION, tuple(args), _results(cfg, past + chunk, kv_dtype))


def decode_with_past_contract(cfg: GemmaConfig, past: int, kv_dtype: str = "float32") -> Contract:
    """One token: prefill_with_past's order with C = 1 and no select (the only row is the output)."""
    per_type = {t: 1 for t in cfg.types_in_use}
    args = [TensorSpec("tokens", (1,), "int32"), *_cache_args(cfg, per_type, past, kv_dtype, True)]
    return Contract("decode_with_past", CONTRACT_VERSION, tuple(args), _results(cfg, past + 1, kv_dtype))


def prefill_at_contract(cfg: GemmaConfig, n: int, kv_dtype: str = "float32") -> Contract:
    """Positions 0..n-1 are implied, so the graph takes only the tokens and the one-hot select."""
    args = (TensorSpec("tokens", (n,), "int32"), TensorSpec("select", (n,), "float32"))
    return Contract("prefill_at", CONTRACT_VERSION, args, _results(cfg, n, kv_dtype))


def redecode_contract(cfg: GemmaConfig, n: int) -> Contract:
    args = (TensorSpec("tokens", (n,), "int32"), TensorSpec("select", (n,), "float32"))
    return Contract("redecode", CONTRACT_VERSION, args, _results(cfg, None, "float32"))


def pack_prefill_with_past(cfg: GemmaConfig, inputs: ChunkInputs, past_k, past_v) -> list[np.ndarray]:
    """Host arrays in contract order (tokens, per-layer tables/K/V/mask, select)."""
    out, seen = [inputs.tokens.astype(np.int32)], set()
    for i, t in enumerate(cfg.layer_types):
        first = t not in seen
        seen.add(t)
        if first:
            out += list(inputs.tables[t])
        out += [past_k[i], past_v[i]]
        if first:
            out.append(inputs.masks[t])
    out.append(inputs.select.astype(np.float32))
    return out


def check_args(contract: Contract, arrays: list[np.ndarray]) -> None:
    if len(arrays) != len(contract.args):
        raise ValueError(f"{contract.graph} takes {len(contract.args)} arguments, got {len(arrays)}")
    for spec, a in zip(contract.args, arrays):
        spec.check(np.asarray(a))


def unpack_results(cfg: GemmaConfig, results: list[np.ndarray]):
    """(logits, K list, V list) from flat results in contract order."""
    if len(results) != 1 + 2 * cfg.layers:
        raise ValueError(f"expected {1 + 2 * cfg.layers} results, got {len(results)}")
    return results[0], list(results[1::2]), list(results[2::2])


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(path: str | Path, contract: Contract, cfg: GemmaConfig, files: dict[str, str | Path] | None = None,
                   extra: dict | None = None) -> Path:
    """The manifest beside an artifact: contract, model config, and sha256 of each named file.
    Written to a temporary name and renamed, so a reader never sees half a manifest."""
    path = Path(path)
    body = {
        "contract": contract.to_dict(),
        "contract_sha256": contract.digest(),
        "model": dataclasses.asdict(cfg),
        "files": {name: {"path": str(p), "sha256": sha256_file(p)} for name, p in (files or {}).items()},
        **(extra or {}),
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
