"""Thin ctypes binding of the native kernels (kernels/tb_kernels.h), built by `pip install`.

Arrays in, arrays out, with refimpl's shapes and layouts: gdn_serial / gdn_chunkwise take the same
arguments as refimpl.gdn's functions; attention takes refimpl.gemma.attention's; SlidingCache wraps
the cache operations over a uint8 array [planes, window, row_bytes].

The library is looked up next to this file. If it is missing, or was compiled from other kernel
sources than the checkout holds (a hash of kernels/ is compiled in), loading raises
NativeLibraryError saying how to rebuild, rather than measuring yesterday's code.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from functools import lru_cache
from pathlib import Path

import numpy as np

from testbed.backends.native import build as kernel_build
from testbed.errors import UsageError

_F32P = ctypes.POINTER(ctypes.c_float)
_U8P = ctypes.POINTER(ctypes.c_uint8)
HEAD_MAPS = {"tiled": 0, "interleaved": 1}
_ERRORS = {-1: "shape rejected", -2: "out of memory", -3: "a worker thread could not start"}


class NativeLibraryError(UsageError):
    """The native library is missing or stale; the message says how to rebuild it."""


class _GDNShape(ctypes.Structure):
    _fields_ = [("n_seqs", ctypes.c_int), ("tokens", ctypes.c_int), ("h_k", ctypes.c_int), ("h_v", ctypes.c_int),
                ("d", ctypes.c_int), ("kda", ctypes.c_int), ("head_map", ctypes.c_int),
                ("q_stride", ctypes.c_ssize_t * 3), ("k_stride", ctypes.c_ssize_t * 3),
                ("v_stride", ctypes.c_ssize_t * 3)]


class _Cache(ctypes.Structure):
    _fields_ = [("rows", _U8P), ("row_bytes", ctypes.c_size_t), ("planes", ctypes.c_int),
                ("window", ctypes.c_int), ("sink", ctypes.c_int), ("count", ctypes.c_int),
                ("empty_byte", ctypes.c_uint8)]


def library_path(cpu_flags: set[str] | None = None) -> Path | None:
    """The best build of the library this CPU can run (build.library_variants: AVX-512, AVX2 + FMA,
    baseline x86-64), by the CPU's own flags: a variant the CPU lacks an instruction of is never
    loaded."""
    here = Path(__file__).resolve().parents[2]  # the testbed package, where setup.py puts it
    flags = kernel_build.cpu_flags() if cpu_flags is None else cpu_flags
    for variant in kernel_build.library_variants():
        if not variant.needs <= flags:
            continue
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = here / f"{kernel_build.LIBRARY_NAME}{variant.suffix}{suffix}"
            if path.is_file():
                return path
    return None


def load_library(path: Path) -> ctypes.CDLL:
    """Load a kernels library from `path` and declare its functions (no staleness check: for
    libraries built elsewhere, such as the tests' deliberately broken variants)."""
    lib = ctypes.CDLL(str(path))
    lib.tb_source_hash.restype = ctypes.c_char_p
    lib.tb_vector_path.restype = ctypes.c_char_p
    lib.tb_gemm_isa.restype = ctypes.c_char_p
    gdn_args = [ctypes.POINTER(_GDNShape)] + [_F32P] * 8
    lib.tb_gdn_serial.argtypes = gdn_args + [ctypes.c_int]
    lib.tb_gdn_chunkwise.argtypes = gdn_args + [ctypes.c_int, ctypes.c_int]
    lib.tb_attention.argtypes = [ctypes.c_int] * 6 + [_F32P] * 4 + [ctypes.c_float, _F32P, ctypes.c_int]
    lib.tb_cache_append.argtypes = [ctypes.POINTER(_Cache), _U8P, ctypes.c_int]
    lib.tb_cache_snapshot.argtypes = [ctypes.POINTER(_Cache), ctypes.c_int, ctypes.c_int, _U8P,
                                      ctypes.POINTER(ctypes.c_int)]
    lib.tb_cache_rollback.argtypes = [ctypes.POINTER(_Cache), ctypes.c_int, _U8P, ctypes.c_int]
    return lib


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The package's library, checked against the kernel sources when they are present (a checkout)."""
    path = library_path()
    if path is None:
        raise NativeLibraryError(f"the native kernels are not built (no testbed/{kernel_build.LIBRARY_NAME}*.so); "
                                 f"{kernel_build.REBUILD_HINT}")
    lib = load_library(path)
    built_from = lib.tb_source_hash().decode()
    if kernel_build.KERNELS_DIR.is_dir():
        current = kernel_build.source_hash()
        if built_from != current:
            raise NativeLibraryError(
                f"{path.name} is stale: built from kernel sources {built_from[:12]}, kernels/ is now "
                f"{current[:12]}; {kernel_build.REBUILD_HINT}")
    return lib


def build_info() -> dict:
    """What artifact records name: the library's source hash, vector path (element-wise code, fixed
    at build time) and the matrix products' micro-kernel (chosen at run time by CPUID, or forced by
    TB_ISA, whose value is recorded beside it when set)."""
    import os

    lib = library()
    info = {"kernels_source_hash": lib.tb_source_hash().decode(), "vector_path": lib.tb_vector_path().decode(),
            "gemm_isa": lib.tb_gemm_isa().decode()}
    if os.environ.get("TB_ISA"):
        info["gemm_isa_forced"] = os.environ["TB_ISA"]
    return info


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise ValueError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _ptr(a: np.ndarray, kind=_F32P):
    return a.ctypes.data_as(kind)


def _rows(a: np.ndarray, name: str) -> tuple[np.ndarray, list[int]]:
    """A float32 [n_seqs, T, H, d] array whose last axis is contiguous, and its strides in floats
    (permuted q, k, v are read in place, as llama.cpp's op does)."""
    if a.dtype != np.float32 or a.strides[-1] != 4 or any(s % 4 for s in a.strides):
        a = _f32(a)
    if a.ndim != 4:
        raise ValueError(f"{name} must be [n_seqs, T, H, d], got shape {a.shape}")
    return a, [s // 4 for s in a.strides[:3]]


def _gdn(lib, fn_name: str, q, k, v, g, beta, state, head_map: str, threads: int, *extra):
    if head_map not in HEAD_MAPS:
        raise ValueError(f"head_map {head_map!r} is not one of {tuple(HEAD_MAPS)}")
    (q, qs), (k, ks), (v, vs) = _rows(q, "q"), _rows(k, "k"), _rows(v, "v")
    n_seqs, t_len, h_k, d = q.shape
    h_v = v.shape[2]
    g, beta = _f32(g), _f32(beta)
    state = np.zeros((n_seqs, h_v, d, d), np.float32) if state is None else _f32(state)
    shape = _GDNShape(n_seqs, t_len, h_k, h_v, d, int(g.ndim == 4), HEAD_MAPS[head_map], (ctypes.c_ssize_t * 3)(*qs),
                      (ctypes.c_ssize_t * 3)(*ks), (ctypes.c_ssize_t * 3)(*vs))
    expected = {"k": (k.shape, q.shape), "v": (v.shape, (n_seqs, t_len, h_v, d)),
                "g": (g.shape, (n_seqs, t_len, h_v) + ((d,) if g.ndim == 4 else ())),
                "beta": (beta.shape, (n_seqs, t_len, h_v)), "state": (state.shape, (n_seqs, h_v, d, d))}
    for name, (got, want) in expected.items():
        if tuple(got) != tuple(want):
            raise ValueError(f"{name} has shape {got}, expected {want}")
    out = np.empty((n_seqs, t_len, h_v, d), np.float32)
    state_out = np.empty_like(state)
    rc = getattr(lib or library(), fn_name)(ctypes.byref(shape), _ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), _ptr(state),
                                     _ptr(out), _ptr(state_out), *extra, threads)
    _check(rc, fn_name)
    return out, state_out


def gdn_serial(q, k, v, g, beta, state=None, head_map: str = "tiled", threads: int = 1, lib=None):
    """refimpl.gdn.gdn_serial in C (float32). Returns (out, final state). `lib`: another library
    than the package's (load_library)."""
    return _gdn(lib, "tb_gdn_serial", q, k, v, g, beta, state, head_map, threads)


def gdn_chunkwise(q, k, v, g, beta, state=None, chunk: int = 64, head_map: str = "tiled", threads: int = 1,
                  lib=None):
    """refimpl.gdn.gdn_chunkwise in C (float32). Returns (out, final state)."""
    if chunk <= 0:
        raise ValueError(f"chunk must be a positive integer, got {chunk}")
    return _gdn(lib, "tb_gdn_chunkwise", q, k, v, g, beta, state, head_map, threads, chunk)


def attention(q, k, v, mask, scale: float, threads: int = 1, length: int | None = None, lib=None) -> np.ndarray:
    """One attention layer: q [heads, C, hd], k and v [kv_heads, P + C, hd], mask [1, heads, C, P + C]
    (or [heads, C, P + C]); returns [heads, C, hd]. `length`: attend only the first `length` cache
    rows of k and v (a cache allocated larger than it is filled; the mask then has `length` columns)."""
    q, k, v, mask = _f32(q), _f32(k), _f32(v), _f32(mask)
    heads, c, hd = q.shape
    kv_heads, kv_rows, _ = k.shape
    length = kv_rows if length is None else length
    mask = mask.reshape(mask.shape[-3:]) if mask.ndim == 4 else mask
    if k.shape != v.shape or k.shape[2] != hd or mask.shape != (heads, c, length) or length > kv_rows:
        raise ValueError(f"attention shapes q {q.shape}, k {k.shape}, v {v.shape}, mask {mask.shape}, "
                         f"length {length} do not agree")
    out = np.empty_like(q)
    _check((lib or library()).tb_attention(heads, kv_heads, c, length, kv_rows, hd, _ptr(q), _ptr(k), _ptr(v), _ptr(mask),
                                  scale, _ptr(out), threads), "tb_attention")
    return out


class SlidingCache:
    """A sliding-window cache over `rows` (uint8 [planes, window, row_bytes], changed in place)
    holding `count` rows per plane, the first `sink` of them never evicted; slots not held are
    filled with `empty_byte`."""

    def __init__(self, rows: np.ndarray, count: int, sink: int = 0, empty_byte: int = 0, lib=None):
        if rows.dtype != np.uint8 or rows.ndim != 3 or not rows.flags.c_contiguous:
            raise ValueError(f"cache rows must be a contiguous uint8 [planes, window, row_bytes], got "
                             f"{rows.dtype} {rows.shape}")
        self.rows = rows
        self._lib = lib or library()
        planes, window, row_bytes = rows.shape
        self._c = _Cache(_ptr(rows, _U8P), row_bytes, planes, window, sink, count, empty_byte)

    @property
    def count(self) -> int:
        return self._c.count

    def held(self) -> np.ndarray:
        """The rows held now, [planes, count, row_bytes]."""
        return self.rows[:, : self.count]

    def append(self, new_rows: np.ndarray) -> None:
        new_rows = self._planar(new_rows)
        _check(self._lib.tb_cache_append(ctypes.byref(self._c), _ptr(new_rows, _U8P), new_rows.shape[1]),
               "tb_cache_append")

    def snapshot(self, n_real: int, n_pad: int) -> np.ndarray:
        """The rows a padded append of n_real + n_pad would evict beyond the exact one."""
        saved = np.zeros((self.rows.shape[0], n_pad, self.rows.shape[2]), np.uint8)
        n_saved = ctypes.c_int(0)
        _check(self._lib.tb_cache_snapshot(ctypes.byref(self._c), n_real, n_pad, _ptr(saved, _U8P),
                                           ctypes.byref(n_saved)), "tb_cache_snapshot")
        return saved[:, : n_saved.value]

    def rollback(self, n_pad: int, saved: np.ndarray) -> None:
        planes, _, row_bytes = self.rows.shape
        buf = np.zeros((planes, n_pad, row_bytes), np.uint8)
        buf[:, : saved.shape[1]] = saved
        _check(self._lib.tb_cache_rollback(ctypes.byref(self._c), n_pad, _ptr(buf, _U8P), saved.shape[1]),
               "tb_cache_rollback")

    def _planar(self, new_rows: np.ndarray) -> np.ndarray:
        new_rows = np.ascontiguousarray(new_rows)
        planes, _, row_bytes = self.rows.shape
        if new_rows.dtype != np.uint8 or new_rows.ndim != 3 or new_rows.shape[::2] != (planes, row_bytes):
            raise ValueError(f"new rows must be uint8 [{planes}, n, {row_bytes}], got {new_rows.dtype} {new_rows.shape}")
        return new_rows


# --- refimpl.sliding_cache's caches through the native row operations --------------------------------


def _planes(a: np.ndarray, positions: bool) -> np.ndarray:
    """A layout array as raw rows: uint8 [planes, slots, row_bytes], a view (changes write through)."""
    a = a[None] if positions else a
    row_bytes = a.itemsize * int(np.prod(a.shape[2:], dtype=np.int64))
    return a.view(np.uint8).reshape(a.shape[0], a.shape[1], row_bytes)


def _layout_caches(cache, lib) -> dict[str, SlidingCache]:
    """One native cache per layout array of a refimpl SlidingCache (k, v, scales, positions)."""
    out = {}
    for name, a in cache.rows.arrays().items():
        if a.size:  # scales are zero-width unless the storage is int8
            # empty slots: zero data, and position sc.EMPTY = -1, whose int64 bytes are all 0xff
            empty = 0xFF if name == "positions" else 0
            out[name] = SlidingCache(_planes(a, name == "positions"), cache.length, cache.sink, empty, lib)
    return out


def sliding_cache_ops(lib=None):
    """refimpl.sliding_cache's append / snapshot / rollback, done by the native kernels on the cache's
    bytes (refimpl.sliding_cache.CacheOps). Full caches and conv states keep the reference's code."""
    from refimpl import sliding_cache as sc

    def append(cache, k, v, positions):
        if not isinstance(cache, sc.SlidingCache):
            return sc.append(cache, k, v, positions)
        new = sc.encode_rows(cache.rows.dtype, cache.rows.group, k, v, positions).arrays()
        for name, native in _layout_caches(cache, lib).items():
            native.append(_planes(np.ascontiguousarray(new[name]), name == "positions"))
            count = native.count
        cache.rows.length = count

    def snapshot(cache, real, pads):
        if not isinstance(cache, sc.SlidingCache):
            return sc.snapshot_padded_append(cache, real, pads)
        saved = {}
        for name, a in cache.rows.arrays().items():
            if not a.size:
                saved[name] = np.take(a, np.arange(0), axis=1)
                continue
            rows = _layout_caches(cache, lib)[name].snapshot(real, pads)
            shape = (rows.shape[1],) if name == "positions" else (a.shape[0], rows.shape[1], *a.shape[2:])
            saved[name] = np.ascontiguousarray(rows).view(a.dtype).reshape(shape)
        length = cache.length
        return sc.PaddedAppendSnapshot(real, pads, saved, min(cache.window, length + real + pads),
                                       min(cache.window, length + real))

    def rollback(cache, snap):
        if not isinstance(cache, sc.SlidingCache):
            return sc.rollback_padded_append(cache, snap)
        for name, native in _layout_caches(cache, lib).items():
            native.rollback(snap.pads, _planes(np.ascontiguousarray(snap.saved[name]), name == "positions"))
            count = native.count
        cache.rows.length = count

    return sc.CacheOps(append=append, snapshot=snapshot, rollback=rollback)
