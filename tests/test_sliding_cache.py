"""The sliding-window cache: eviction, sinks, storage formats, the byte-identical grid oracle."""

import copy

import numpy as np
import pytest

from refimpl import sliding_cache as sc
from testbed.oracles.tail import GridCase, check_padded_rollback, grid


def rows(n, start=0, heads=2, dim=8, seed=0):
    rng = np.random.default_rng([seed, start, n])
    return (rng.standard_normal((heads, n, dim)).astype(np.float32),
            rng.standard_normal((heads, n, dim)).astype(np.float32), np.arange(start, start + n))


def filled(window, sink, n, dtype="float32", piece=3):
    cache = sc.sliding_cache(2, 8, window, sink, dtype, group=4)
    for start in range(0, n, piece):
        sc.append(cache, *rows(min(piece, n - start), start))
    return cache


def test_eviction_keeps_sinks_and_newest_rows_in_position_order():
    cache = filled(window=10, sink=2, n=25)
    assert cache.length == 10
    assert cache.rows.positions.tolist() == [0, 1] + list(range(17, 25))


def test_rows_read_back_as_written_in_float32():
    cache = filled(window=10, sink=0, n=7)
    k, v, pos = sc.read(cache)
    want_k, want_v, _ = zip(*[rows(min(3, 7 - s), s) for s in range(0, 7, 3)])
    np.testing.assert_array_equal(k, np.concatenate(want_k, axis=1))
    np.testing.assert_array_equal(v, np.concatenate(want_v, axis=1))
    assert pos.tolist() == list(range(7))


def test_empty_slots_are_zero_bytes_and_position_minus_one():
    cache = filled(window=10, sink=0, n=4)
    assert not cache.rows.k[:, 4:].any() and (cache.rows.positions[4:] == -1).all()


@pytest.mark.parametrize("dtype,tol", [("float16", 2e-3), ("int8", 1.5e-2)])
def test_reduced_storage_round_trips_within_its_precision(dtype, tol):
    cache = filled(window=16, sink=0, n=9, dtype=dtype)
    exact = filled(window=16, sink=0, n=9)
    k, _, _ = sc.read(cache)
    ref, _, _ = sc.read(exact)
    err = np.abs(k - ref).max() / np.abs(ref).max()
    assert 0 < err < tol


def test_int8_scales_are_per_group_and_part_of_the_cache_bytes():
    cache = filled(window=16, sink=0, n=5, dtype="int8")
    assert cache.rows.k_scale.shape == (2, 16, 2)  # head_dim 8 in groups of 4
    assert (cache.rows.k_scale[:, :5] > 0).all() and not cache.rows.k_scale[:, 5:].any()
    assert "k_scale" in sc.cache_bytes(cache)


def test_full_cache_grows_without_eviction():
    cache = sc.full_cache(2, 8)
    for start in range(0, 40, 7):
        sc.append(cache, *rows(min(7, 40 - start), start))
    assert cache.length == 40 and sc.read(cache)[2].tolist() == list(range(40))


def test_padded_append_larger_than_tail_capacity_is_refused_untouched():
    cache = filled(window=16, sink=4, n=20)
    before = copy.deepcopy(sc.cache_bytes(cache))
    with pytest.raises(sc.CacheCannotHonour, match="exceeds the tail capacity 12"):
        sc.snapshot_padded_append(cache, 5, 8)
    assert all(np.array_equal(before[n], a) for n, a in sc.cache_bytes(cache).items())


def test_conv_state_refuses_snapshot_and_rollback():
    state = sc.conv_state(4, 8)
    with pytest.raises(sc.CacheCannotHonour, match="conv/recurrent"):
        sc.snapshot_padded_append(state, 3, 5)


def test_rollback_refuses_a_cache_that_changed_since_the_snapshot():
    cache = filled(window=16, sink=0, n=20)
    snap = sc.snapshot_padded_append(cache, 2, 6)
    sc.append(cache, *rows(3, 20))  # not the padded append the snapshot was taken for
    cache.rows.length -= 1
    with pytest.raises(sc.CacheCannotHonour, match="changed since the snapshot"):
        sc.rollback_padded_append(cache, snap)


def test_bad_formats_are_rejected():
    with pytest.raises(ValueError, match="bfloat16"):
        sc.sliding_cache(2, 8, 16, dtype="bfloat16")
    with pytest.raises(ValueError, match="group=3"):
        sc.sliding_cache(2, 8, 16, dtype="int8", group=3)
    with pytest.raises(ValueError, match="sink=16"):
        sc.sliding_cache(2, 8, 16, sink=16)


def test_grid_covers_every_situation_the_issue_names():
    cases = grid()
    assert {c.covers for c in cases} == {"empty cache", "no eviction", "eviction by pads only", "overshoot"}
    assert {c.dtype for c in cases} == set(sc.STORAGE_DTYPES) and any(c.sink for c in cases)
    assert all(c.real + c.pads <= c.window - c.sink for c in cases)


@pytest.mark.quick
def test_byte_identical_grid_passes():
    verdicts = [check_padded_rollback(c) for c in grid()]
    failed = [(c.name, v.detail) for c, v in zip(grid(), verdicts) if not v.passed]
    assert not failed
    assert all(v.metrics["sha256"] == v.metrics["sha256_expected"] for v in verdicts)


def test_padded_rollback_really_evicted_rows_that_it_had_to_restore():
    # The oracle is only meaningful where the padded append evicts more than the exact one.
    case = GridCase(prefix=13, real=3, pads=10, window=16, sink=3, dtype="int8")
    cache = filled(16, 3, 13, "int8")
    snap = sc.snapshot_padded_append(cache, case.real, case.pads)
    assert snap.n == 10 and check_padded_rollback(case).passed
