"""KV caches for prefill with a padded tail (seed 003): sliding-window, full-attention, conv state.

A cache holds rows, one per cached position: K and V for every KV head, stored as float32, float16 or
int8 with one float32 scale per group of `group` elements (the scales are cache bytes too), and the
row's absolute position (-1 for an empty slot or a pad). The byte layout is explicit, so "the same
cache" can mean memcmp equality:

    k, v        [kv_heads, capacity, head_dim]            storage dtype
    k_scale,    [kv_heads, capacity, head_dim // group]   float32 (zero width unless int8)
    v_scale
    positions   [capacity]                                int64, -1 = empty
    length      rows in use: slots 0..length-1; every slot from `length` on is all zero bytes
                with position -1

SlidingCache: `window` slots in all, the first `sink` of which are never evicted (attention sinks);
the other `window - sink` slots (the tail capacity) hold the most recent rows. An append that
overflows evicts the oldest non-sink rows and the survivors compact chronologically: slot order is
always position order. The sinks count inside the window, as in the seed's engine: its guard
"no padding where window <= chunk + sink" is exactly "a padded chunk does not fit the tail capacity".

FullCache: a full-attention (global) layer's cache, which grows by every append and never evicts.

ConvState: the marker of state that cannot be rolled back (a short-conv ring of the last inputs, a
recurrent state): a padded append would shift real rows out of it and nothing can restore them.

Padded append with rollback. A tail of `real` rows run as one chunk padded with `pads` rows evicts up
to `pads` real rows more than an unpadded append would. `snapshot_padded_append` saves exactly those
rows before the padded append; `rollback_padded_append` drops the pad rows afterwards and reinserts
the saved rows, after which the cache is byte-identical to an unpadded append of the real rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

STORAGE_DTYPES = ("float32", "float16", "int8")
EMPTY = -1  # the position of an empty slot and of a pad row


class CacheCannotHonour(ValueError):
    """A request the cache cannot carry out without corrupting rows; nothing was changed."""


@dataclass
class RowStorage:
    """Rows in one storage dtype: the arrays of the layout above, `capacity` slots each."""

    dtype: str
    group: int
    k: np.ndarray
    v: np.ndarray
    k_scale: np.ndarray
    v_scale: np.ndarray
    positions: np.ndarray
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.positions.shape[0]

    def arrays(self) -> dict[str, np.ndarray]:
        """The cache bytes, by name (what byte-identical compares)."""
        return {"k": self.k, "v": self.v, "k_scale": self.k_scale, "v_scale": self.v_scale,
                "positions": self.positions}


def _check_format(kv_heads: int, head_dim: int, dtype: str, group: int) -> None:
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"cache dtype {dtype!r} is not one of {', '.join(STORAGE_DTYPES)}")
    if kv_heads < 1 or head_dim < 1:
        raise ValueError(f"kv_heads={kv_heads} and head_dim={head_dim} must be positive")
    if dtype == "int8" and (group < 1 or head_dim % group):
        raise ValueError(f"int8 group={group} must divide head_dim={head_dim}")


def _empty_storage(kv_heads: int, head_dim: int, capacity: int, dtype: str, group: int) -> RowStorage:
    groups = head_dim // group if dtype == "int8" else 0
    return RowStorage(
        dtype=dtype, group=group,
        k=np.zeros((kv_heads, capacity, head_dim), dtype), v=np.zeros((kv_heads, capacity, head_dim), dtype),
        k_scale=np.zeros((kv_heads, capacity, groups), np.float32),
        v_scale=np.zeros((kv_heads, capacity, groups), np.float32),
        positions=np.full(capacity, EMPTY, np.int64),
    )


def quantize_int8(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per group of `group` elements on the last axis: scale = max|x| / 127, q =
    round(x / scale). An all-zero group gets scale 0 and q 0."""
    shape = x.shape
    g = x.astype(np.float32).reshape(*shape[:-1], shape[-1] // group, group)
    scale = (np.abs(g).max(axis=-1) / np.float32(127)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    q = np.clip(np.rint(g / safe), -127, 127).astype(np.int8)
    return q.reshape(shape), scale


def encode_rows(dtype: str, group: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> RowStorage:
    """Rows [kv_heads, n, head_dim] (any float dtype) in a storage dtype: what an append writes."""
    positions = np.asarray(positions, np.int64)
    if dtype == "int8":
        (qk, sk), (qv, sv) = quantize_int8(k, group), quantize_int8(v, group)
        return RowStorage(dtype, group, qk, qv, sk, sv, positions, len(positions))
    kv_heads, n, _ = k.shape
    no_scale = np.zeros((kv_heads, n, 0), np.float32)
    return RowStorage(dtype, group, k.astype(dtype), v.astype(dtype), no_scale, no_scale.copy(),
                      positions, len(positions))


def decode_rows(s: RowStorage) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows in use as float32 (K, V [kv_heads, length, head_dim]) and their positions."""
    n = s.length
    if s.dtype == "int8":
        def dequantize(q, scale):
            kv_heads, _, head_dim = q.shape
            g = q[:, :n].astype(np.float32).reshape(kv_heads, n, head_dim // s.group, s.group)
            return (g * scale[:, :n, :, None]).reshape(kv_heads, n, head_dim)

        return dequantize(s.k, s.k_scale), dequantize(s.v, s.v_scale), s.positions[:n].copy()
    return s.k[:, :n].astype(np.float32), s.v[:, :n].astype(np.float32), s.positions[:n].copy()


def _axis(name: str) -> int:
    """The row axis of a layout array: positions are indexed by row, the others by head then row."""
    return 0 if name == "positions" else 1


def _take(s: RowStorage, start: int, stop: int) -> dict[str, np.ndarray]:
    """Copies of slots [start, stop) of every layout array."""
    return {name: np.take(a, np.arange(start, stop), axis=_axis(name)) for name, a in s.arrays().items()}


def _put(s: RowStorage, start: int, rows: dict[str, np.ndarray]) -> None:
    """Write rows (as `_take` returns them) into slots from `start` on."""
    for name, a in s.arrays().items():
        n = rows[name].shape[_axis(name)]
        index = (slice(start, start + n),) if name == "positions" else (slice(None), slice(start, start + n))
        a[index] = rows[name]


def _clear(s: RowStorage, start: int) -> None:
    """Slots from `start` on become empty: zero bytes, position -1."""
    for name, a in s.arrays().items():
        if name == "positions":
            a[start:] = EMPTY
        else:
            a[:, start:] = 0


@dataclass
class SlidingCache:
    """A sliding-window layer's cache: `window` slots, the first `sink` never evicted."""

    window: int
    sink: int
    rows: RowStorage
    kind: str = field(default="sliding", init=False)

    @property
    def length(self) -> int:
        return self.rows.length

    @property
    def tail_capacity(self) -> int:
        """Slots for evictable rows: the largest append whose rows can all stay."""
        return self.window - self.sink


@dataclass
class FullCache:
    """A full-attention layer's cache: it grows with every append and never evicts."""

    rows: RowStorage
    kind: str = field(default="full", init=False)

    @property
    def length(self) -> int:
        return self.rows.length


@dataclass
class ConvState:
    """State that cannot be rolled back: a short-conv ring holding the last `kernel - 1` input rows
    [kernel - 1, width], oldest first. A pad pushed in displaces exactly the rows the conv kernel's
    lookback reads."""

    kernel: int
    ring: np.ndarray
    kind: str = field(default="conv", init=False)


def sliding_cache(kv_heads: int, head_dim: int, window: int, sink: int = 0, dtype: str = "float32",
                  group: int = 32) -> SlidingCache:
    _check_format(kv_heads, head_dim, dtype, group)
    if not 0 <= sink < window:
        raise ValueError(f"sink={sink} must be in [0, window={window})")
    return SlidingCache(window, sink, _empty_storage(kv_heads, head_dim, window, dtype, group))


def full_cache(kv_heads: int, head_dim: int, dtype: str = "float32", group: int = 32) -> FullCache:
    _check_format(kv_heads, head_dim, dtype, group)
    return FullCache(_empty_storage(kv_heads, head_dim, 0, dtype, group))


def conv_state(kernel: int, width: int) -> ConvState:
    if kernel < 2 or width < 1:
        raise ValueError(f"conv kernel={kernel} must be >= 2 and width={width} >= 1")
    return ConvState(kernel, np.zeros((kernel - 1, width), np.float32))


# --- append ----------------------------------------------------------------------------------------


def _evictions(cache: SlidingCache, total: int) -> int:
    """How many of the oldest non-sink rows go when `total` rows (held + appended) meet the window."""
    return max(0, total - cache.window)


def append(cache, k: np.ndarray, v: np.ndarray, positions) -> None:
    """Append rows K, V [kv_heads, n, head_dim] at `positions` [n] (-1 for pads), in place.

    A sliding cache that overflows evicts its oldest non-sink rows; the rest compact chronologically.
    Rows past the tail capacity in one append are evicted by that same append (they would be by the
    next one anyway: the newest `window - sink` rows are the ones a sliding window reads)."""
    if isinstance(cache, ConvState):
        raise TypeError("a conv state takes input rows: use push_conv")
    new = encode_rows(cache.rows.dtype, cache.rows.group, k, v, positions)
    if isinstance(cache, FullCache):
        s = cache.rows
        grown = _empty_storage(s.k.shape[0], s.k.shape[2], s.length + new.length, s.dtype, s.group)
        _put(grown, 0, _take(s, 0, s.length))
        _put(grown, s.length, _take(new, 0, new.length))
        grown.length = s.length + new.length
        cache.rows = grown
        return
    s = cache.rows
    total = s.length + new.length
    evict = _evictions(cache, total)
    if evict == 0:
        _put(s, s.length, _take(new, 0, new.length))
        s.length = total
        return
    # Chronological compaction: the combined sequence is (held rows, new rows); its first `sink`
    # rows are the sinks, then the newest rows fill the tail, oldest first.
    held, incoming = _take(s, 0, s.length), _take(new, 0, new.length)
    kept = np.r_[0:cache.sink, cache.sink + evict:total]
    _clear(s, 0)
    _put(s, 0, {name: np.take(np.concatenate([held[name], incoming[name]], axis=_axis(name)), kept,
                              axis=_axis(name)) for name in held})
    s.length = cache.window


def push_conv(state: ConvState, rows: np.ndarray) -> None:
    """Push input rows [n, width] into the conv ring: it keeps the last kernel - 1, oldest first."""
    state.ring = np.concatenate([state.ring, rows.astype(np.float32)], axis=0)[-(state.kernel - 1):].copy()


def read(cache) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What attention reads: K, V [kv_heads, length, head_dim] as float32, and positions [length]."""
    return decode_rows(cache.rows)


def cache_bytes(cache) -> dict[str, np.ndarray]:
    """Every byte the cache holds, plus its length, by name: the byte-identical oracle's input."""
    if isinstance(cache, ConvState):
        return {"ring": cache.ring}
    return {**cache.rows.arrays(), "length": np.array([cache.rows.length], np.int64)}


# --- padded append: snapshot and rollback ----------------------------------------------------------


@dataclass
class PaddedAppendSnapshot:
    """What a padded append of `real` + `pads` rows will evict beyond an unpadded one (the saved
    rows, oldest first), and the lengths that let rollback check it is given the cache it expects."""

    real: int
    pads: int
    saved: dict[str, np.ndarray]
    length_after_padded: int
    length_after_exact: int

    @property
    def n(self) -> int:
        return self.saved["positions"].shape[0]


def snapshot_padded_append(cache, real: int, pads: int) -> PaddedAppendSnapshot:
    """Save the real rows that appending real + pads rows would evict beyond appending `real`.

    Raises CacheCannotHonour for a conv state (its rows cannot be restored) and for a padded append
    larger than the tail capacity (the pads would evict rows of the same append, which no snapshot
    taken before it holds)."""
    if real < 0 or pads < 0:
        raise ValueError(f"real={real} and pads={pads} must be >= 0")
    if isinstance(cache, ConvState):
        raise CacheCannotHonour("a conv/recurrent state cannot be rolled back: pads would displace its real rows")
    length = cache.length
    if isinstance(cache, FullCache):
        return PaddedAppendSnapshot(real, pads, _take(cache.rows, 0, 0), length + real + pads, length + real)
    if real + pads > cache.tail_capacity:
        raise CacheCannotHonour(
            f"a padded append of {real} real + {pads} pad rows exceeds the tail capacity "
            f"{cache.tail_capacity} (window {cache.window} - sink {cache.sink})")
    # The rows an append evicts are the oldest non-sink ones, right after the sinks. Both appends
    # fit the tail, so every row the padded one evicts in excess is a held row: the slots
    # [sink + evicted_exact, sink + evicted_padded) of the cache as it is now.
    evicted_exact = _evictions(cache, length + real)
    evicted_padded = _evictions(cache, length + real + pads)
    saved = _take(cache.rows, cache.sink + evicted_exact, cache.sink + evicted_padded)
    return PaddedAppendSnapshot(real, pads, saved, min(cache.window, length + real + pads),
                                min(cache.window, length + real))


def rollback_padded_append(cache, snap: PaddedAppendSnapshot) -> None:
    """After the padded append: drop the `pads` rows (the last ones) and reinsert the saved rows in
    their chronological place, right after the sinks (the padded append evicted them, so the rows
    following the sinks are the ones that came after them)."""
    if isinstance(cache, ConvState):
        raise CacheCannotHonour("a conv/recurrent state cannot be rolled back")
    s = cache.rows
    if s.length != snap.length_after_padded:
        raise CacheCannotHonour(
            f"rollback expects {snap.length_after_padded} rows after the padded append, the cache holds "
            f"{s.length}: it changed since the snapshot")
    kept = s.length - snap.pads
    if isinstance(cache, FullCache):
        shrunk = _empty_storage(s.k.shape[0], s.k.shape[2], kept, s.dtype, s.group)
        _put(shrunk, 0, _take(s, 0, kept))
        shrunk.length = kept
        cache.rows = shrunk
        return
    if snap.n:
        survivors = _take(s, cache.sink, kept)
        _clear(s, cache.sink)
        _put(s, cache.sink, snap.saved)
        _put(s, cache.sink + snap.n, survivors)
    else:
        _clear(s, kept)
    s.length = snap.length_after_exact


@dataclass(frozen=True)
class CacheOps:
    """The three operations a prefill engine performs on a cache. These are the reference's; the
    native kernels bring their own (testbed.backends.native.library.sliding_cache_ops), and a planted-bug test swaps one."""

    append: object = append
    snapshot: object = snapshot_padded_append
    rollback: object = rollback_padded_append
