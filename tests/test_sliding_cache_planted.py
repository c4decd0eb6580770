"""Planted bugs in the padded-append snapshot and rollback: each must fail the byte-identical oracle."""

import dataclasses

import numpy as np

from refimpl import sliding_cache as sc
from refimpl.sliding_cache import CacheOps
from testbed.oracles.tail import check_padded_rollback, grid


def failures(ops):
    verdicts = [(c, check_padded_rollback(c, ops)) for c in grid()]
    assert all(v.verdict in ("pass", "fail") for _, v in verdicts)
    return [(c, v) for c, v in verdicts if not v.passed]


def test_reference_ops_pass_the_grid():
    assert failures(CacheOps()) == []


def test_pads_left_in_the_cache_are_caught():
    # Rollback forgotten: the pad rows stay and the over-evicted rows are lost.
    caught = failures(CacheOps(rollback=lambda cache, snap: None))
    assert caught and {c.covers for c, _ in caught} >= {"eviction by pads only", "no eviction"}


def test_rollback_reinserting_in_the_wrong_order_is_caught():
    def reversed_rollback(cache, snap):
        saved = {name: np.flip(a, axis=0 if name == "positions" else 1) for name, a in snap.saved.items()}
        sc.rollback_padded_append(cache, dataclasses.replace(snap, saved=saved))

    caught = failures(CacheOps(rollback=reversed_rollback))
    assert caught and all("padded+rollback" in v.detail for _, v in caught)


def test_snapshot_one_row_short_is_caught():
    def short_snapshot(cache, real, pads):
        snap = sc.snapshot_padded_append(cache, real, pads)
        if not snap.n:
            return snap
        saved = {name: (a[1:] if name == "positions" else a[:, 1:]) for name, a in snap.saved.items()}
        return dataclasses.replace(snap, saved=saved)

    caught = failures(CacheOps(snapshot=short_snapshot))
    assert caught and all("padded+rollback" in v.detail for _, v in caught)


def test_sink_rows_evicted_are_caught():
    def append_ignoring_sinks(cache, k, v, positions):
        sink = cache.sink
        cache.sink = 0 if cache.kind == "sliding" else sink  # eviction starts at slot 0
        try:
            sc.append(cache, k, v, positions)
        finally:
            cache.sink = sink

    caught = failures(CacheOps(append=append_ignoring_sinks))
    assert caught and all(c.sink > 0 for c, _ in caught)
    assert any("exact append" in v.detail for _, v in caught)
