"""Slots that are part of a page layer (kv_pool.PageView) and what the paged cache
answers for them: unit heads, keys alone, shared K/V, chunk masks, unused slots."""

from __future__ import annotations

import mlxkv  # noqa: F401  (loads the BLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from mlxkv.attention.paged_cache import GroupTables, PagedBatch, PagedKVCache, UnusedSlotCache
from mlxkv.cache.kv_pool import KVLayout, KVPool, PageView
from mlxkv.cache.page_format import EMPTY, KEYS

# Page layers of 2 unit heads of 8: one slot of a 16-wide head, or two of an 8-wide one.
PAGE = KVLayout(num_layers=1, n_kv_heads=2, head_dim=8, v_head_dim=8, block_size=4, dtype=mx.float32)
WIDE = PageView(0, 2, 0, 2)
NARROW_SECOND = PageView(1, 1, 1, 1)


def write(pool, view, keys, values, table=(3, 1, 0)):
    batch = PagedBatch.build([list(table)], [0], keys.shape[2], block_size=4)
    pool.write(0, batch.groups[0].write_blocks, batch.write_offsets, keys, values, view)
    return batch


def test_a_head_twice_the_unit_width_round_trips_through_two_unit_heads():
    pool = KVPool(PAGE, num_blocks=4)
    keys, values = mx.random.normal((1, 1, 10, 16)), mx.random.normal((1, 1, 10, 16))
    batch = write(pool, WIDE, keys, values)
    k, v = pool.gather(0, batch.block_tables, 10, WIDE, heads=1)
    np.testing.assert_array_equal(np.array(k), np.array(keys))
    np.testing.assert_array_equal(np.array(v), np.array(values))
    # Token 5 (block 1, offset 1): its first 8 dims in unit head 0, the next 8 in unit head 1.
    np.testing.assert_array_equal(np.array(pool.keys[0][1, :, 1]), np.array(keys[0, 0, 5].reshape(2, 8)))


def test_two_narrow_slots_share_a_page_layer_without_touching_each_other():
    pool = KVPool(PAGE, num_blocks=4)
    first, second = mx.random.normal((1, 1, 6, 8)), mx.random.normal((1, 1, 6, 8))
    write(pool, PageView(0, 1, 0, 1), first, first)
    batch = write(pool, NARROW_SECOND, second, second)
    k0, _ = pool.gather(0, batch.block_tables, 6, PageView(0, 1, 0, 1), heads=1)
    k1, _ = pool.gather(0, batch.block_tables, 6, NARROW_SECOND, heads=1)
    np.testing.assert_array_equal(np.array(k0), np.array(first))
    np.testing.assert_array_equal(np.array(k1), np.array(second))


def test_a_slot_of_keys_alone_stores_no_values():
    pool = KVPool(PAGE, num_blocks=4)
    keys = mx.random.normal((1, 1, 5, 8))
    batch = write(pool, PageView(0, 1, 0, 1, KEYS), keys, keys)
    k, v = pool.gather(0, batch.block_tables, 5, PageView(0, 1, 0, 1, KEYS), heads=1)
    assert v is k and not np.any(np.array(pool.values[0]))
    write(pool, PageView(1, 1, 0, 1, EMPTY, 1), keys, mx.zeros((1, 1, 5, 0)))
    _, empty = pool.gather(0, batch.block_tables, 5, PageView(1, 1, 0, 1, EMPTY, 1), heads=1)
    assert empty.shape == (1, 1, 5, 0) and not np.any(np.array(pool.values[0]))


def test_a_view_write_is_in_place():
    layout = KVLayout(num_layers=1, n_kv_heads=8, head_dim=64, v_head_dim=64, block_size=16, dtype=mx.float32)
    pool = KVPool(layout, num_blocks=512)  # 16 MiB per pool
    batch = PagedBatch.build([[7]], [0], 1, block_size=16)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for _ in range(3):
        new = mx.random.normal((1, 2, 1, 128))  # two heads of 128: four unit heads of 64
        pool.write(0, batch.groups[0].write_blocks, batch.write_offsets, new, new, PageView(4, 2, 4, 2))
        mx.eval(pool.keys[0], pool.values[0])
    assert mx.get_peak_memory() - base < pool.keys[0].nbytes / 16


def cache_of(pool, tables, offsets, num_new, **rule):
    group = GroupTables.build(tables, [0] * len(tables), offsets, num_new, 4, **rule)
    batch = PagedBatch.of_groups((group,), offsets, num_new, 4)
    return PagedKVCache(pool, 0, batch)


def test_a_layer_that_shares_kv_reads_what_its_owner_fetched_this_step():
    pool = KVPool(PAGE, num_blocks=4)
    cache = cache_of(pool, [[2, 0]], [0], 6)
    keys = mx.random.normal((1, 2, 6, 8))
    fetched = cache.update_and_fetch(keys, keys)
    assert cache.keys_and_values() is fetched
    np.testing.assert_array_equal(np.array(cache.keys), np.array(keys))
    cache.keys = cache.values = None  # a model's graph chaining: dropped, the pool is the truth
    assert cache.keys_and_values() is fetched


def test_a_chunked_slot_masks_what_is_before_the_query_s_chunk():
    pool = KVPool(PAGE, num_blocks=8)
    cache = cache_of(pool, [[0, 1, 2]], [6], 4, chunk=8)  # queries at 6..9, chunks of 8
    mask = np.array(cache.make_mask(4))
    assert mask.shape == (4, 10)
    assert mask[0].tolist() == [True] * 7 + [False] * 3  # 6 sees 0..6
    assert mask[2].tolist() == [False] * 8 + [True, False]  # 8 starts a chunk: itself alone
    assert cache.start_position == 0


def test_an_unused_slot_answers_masks_and_refuses_writes():
    pool = KVPool(PAGE, num_blocks=4)
    full = cache_of(pool, [[1, 2]], [5], 1)
    unused = UnusedSlotCache(pool, 0, full.batch, slot=1, index=None)
    assert unused.offset == full.offset == 5 and unused.make_mask(1) == full.make_mask(1)
    with pytest.raises(RuntimeError, match="probed as unused"):
        unused.update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)))
