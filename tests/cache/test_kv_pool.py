"""Paged KV storage: slot writes, gathers, block copies, no pool copies."""

from __future__ import annotations

import mlxkv  # noqa: F401  (loads the BLAS before mlx)
import mlx.core as mx
import numpy as np

from mlxkv.cache.kv_pool import KVLayout, KVPool
from mlxkv.attention.paged_cache import PagedBatch

LAYOUT = KVLayout(num_layers=2, n_kv_heads=2, head_dim=8, v_head_dim=8, block_size=4, dtype=mx.float32)


def test_writes_land_in_their_slots_and_gather_in_order():
    pool = KVPool(LAYOUT, num_blocks=6)
    table = [5, 2, 0]  # a shuffled block table
    keys = mx.random.normal((1, 2, 10, 8))
    values = mx.random.normal((1, 2, 10, 8))
    batch = PagedBatch.build([table], [0], 10, block_size=4)
    pool.write(1, batch.groups[0].write_blocks, batch.write_offsets, keys, values)
    k, v = pool.gather(1, batch.block_tables, length=10)
    assert k.shape == (1, 2, 10, 8)
    np.testing.assert_array_equal(np.array(k), np.array(keys))
    np.testing.assert_array_equal(np.array(v), np.array(values))
    # Token 5 sits in the table's second block (id 2) at offset 1.
    np.testing.assert_array_equal(np.array(pool.keys[1][2, :, 1]), np.array(keys[0, :, 5]))
    # Layer 0 is untouched.
    assert not np.any(np.array(pool.keys[0]))


def test_batched_write_and_padded_gather():
    pool = KVPool(LAYOUT, num_blocks=8)
    batch = PagedBatch.build([[1, 3], [4]], [5, 2], 1, block_size=4)
    new = mx.random.normal((2, 2, 1, 8))
    pool.write(0, batch.groups[0].write_blocks, batch.write_offsets, new, new)
    np.testing.assert_array_equal(np.array(pool.keys[0][3, :, 1]), np.array(new[0, :, 0]))
    np.testing.assert_array_equal(np.array(pool.keys[0][4, :, 2]), np.array(new[1, :, 0]))
    k, _ = pool.gather(0, batch.block_tables)
    assert k.shape == (2, 2, 8, 8)


def test_read_and_write_blocks_round_trip():
    src = KVPool(LAYOUT, num_blocks=4)
    src.keys[0][1] = mx.ones((2, 4, 8))
    src.values[1][1] = mx.full((2, 4, 8), 3.0)
    (block,) = src.read_blocks([1])
    assert block.keys.shape == (2, 2, 4, 8)  # [layers, heads, block, head_dim]
    dst = KVPool(LAYOUT, num_blocks=4)
    dst.write_blocks([3], [block])
    np.testing.assert_array_equal(np.array(dst.keys[0][3]), np.ones((2, 4, 8)))
    np.testing.assert_array_equal(np.array(dst.values[1][3]), np.full((2, 4, 8), 3.0))


def _peak_during_writes(pool: KVPool, keep_alias: bool) -> int:
    # A view shares the pool's buffer, as a kept-around slice would.
    alias = pool.keys[0][1:] if keep_alias else None
    mx.eval(alias) if keep_alias else None
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    batch = PagedBatch.build([[7]], [0], 1, block_size=16)
    for _ in range(3):
        new = mx.random.normal((1, 8, 1, 128))
        pool.write(0, batch.groups[0].write_blocks, batch.write_offsets, new, new)
        mx.eval(pool.keys[0], pool.values[0])
    del alias
    return mx.get_peak_memory() - base


def test_writes_are_in_place_unless_the_pool_is_aliased():
    layout = KVLayout(num_layers=1, n_kv_heads=8, head_dim=128, v_head_dim=128, block_size=16, dtype=mx.float32)
    pool = KVPool(layout, num_blocks=512)  # 32 MiB for K, 32 MiB for V
    one_pool = pool.keys[0].nbytes
    assert _peak_during_writes(pool, keep_alias=False) < one_pool / 16
    # The check can fail: a second live reference makes MLX copy the pool.
    assert _peak_during_writes(pool, keep_alias=True) >= one_pool


def test_mirror_writes_in_place_at_the_offset_and_grows_in_steps():
    from mlxkv.attention.mirror import STEP, KVMirror

    mirror = KVMirror(num_layers=1)
    first = mx.random.normal((1, 2, 5, 8))
    k, _ = mirror.reset(0, first, first)
    assert k.shape == (1, 2, 5, 8) and mirror.keys[0].shape[2] == STEP
    new = mx.random.normal((1, 2, STEP, 8))
    k, v = mirror.write(0, 5, new, new)
    assert k.shape == (1, 2, 5 + STEP, 8) and mirror.keys[0].shape[2] == 2 * STEP
    np.testing.assert_array_equal(np.array(k[:, :, :5]), np.array(first))
    np.testing.assert_array_equal(np.array(v[:, :, 5:]), np.array(new))
    assert mirror.covers(0, 5 + STEP) and mirror.covers(0, 5) and not mirror.covers(0, 6 + STEP)
    # A rolled-back step: the next write lands at the offset, over the rejected tokens.
    again = mx.random.normal((1, 2, 2, 8))
    k, _ = mirror.write(0, 7, again, again)
    assert k.shape == (1, 2, 9, 8) and mirror.lengths[0] == 9
    np.testing.assert_array_equal(np.array(k[:, :, 7:]), np.array(again))


def test_engine_drops_a_sequence_mirror_when_it_ends(model_dirs):
    from mlxkv.config import CacheConfig
    from mlxkv.engine.engine import Engine

    engine = Engine.load(model_dirs["llama"], CacheConfig(block_size=8, num_blocks=16))
    stream = engine.stream(list(range(3, 30)), max_tokens=8)
    next(stream)
    assert len(engine.runner._mirrors) == 1
    stream.close()
    assert engine.runner._mirrors == {}


def test_hydrate_writes_runs_and_scattered_blocks():
    from mlxkv.cache.block_kv import BlockKV
    from mlxkv.cache.kv_pool import _segments

    ids = [4, 5, 6, 9, 2, 3]
    blocks = [BlockKV(mx.full((2, 2, 4, 8), float(i)), mx.full((2, 2, 4, 8), -float(i))) for i in range(6)]
    # Blocks of no run are stacked into one; stretches follow the block ids.
    assert [(d, s, n) for d, _, s, n in _segments(ids, blocks)] == [(4, 0, 3), (9, 3, 1), (2, 4, 2)]
    pool = KVPool(LAYOUT, num_blocks=10)
    pool.write_blocks(ids, blocks)
    for i, block_id in enumerate(ids):
        assert np.all(np.array(pool.keys[1][block_id]) == i)
        assert np.all(np.array(pool.values[0][block_id]) == -i)
    assert not np.any(np.array(pool.keys[0][[0, 1, 7, 8]]))


def test_blocks_of_one_run_are_copied_a_stretch_at_a_time():
    from mlxkv.cache.kv_pool import _segments

    src = KVPool(LAYOUT, num_blocks=8)
    for i in range(8):
        src.keys[0][i] = mx.full((2, 4, 8), float(i))
        src.values[1][i] = mx.full((2, 4, 8), -float(i))
    blocks = src.read_blocks([1, 2, 3, 6])  # views of one layer-major run
    assert blocks[0].run is blocks[3].run and blocks[0].run.keys.shape == (2, 4, 2, 4, 8)
    ids = [0, 1, 2, 5]
    assert [(d, s, n) for d, _, s, n in _segments(ids, blocks)] == [(0, 0, 3), (5, 3, 1)]
    assert [(d, s, n) for d, _, s, n in _segments([0, 1, 5, 6], blocks)] == [(0, 0, 2), (5, 2, 2)]
    dst = KVPool(LAYOUT, num_blocks=8)
    dst.write_blocks([7, 0, 1, 2], blocks)
    for block_id, value in zip([7, 0, 1, 2], [1, 2, 3, 6]):
        assert np.all(np.array(dst.keys[0][block_id]) == value)
        assert np.all(np.array(dst.values[1][block_id]) == -value)


def test_hydrate_writes_in_place():
    layout = KVLayout(num_layers=2, n_kv_heads=8, head_dim=128, v_head_dim=128, block_size=16, dtype=mx.float32)
    pool = KVPool(layout, num_blocks=256)  # 16 MiB per layer for K and for V
    blocks = KVPool(layout, num_blocks=4).read_blocks([0, 1, 2, 3])
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    pool.write_blocks([10, 11, 12, 13], blocks)
    assert mx.get_peak_memory() - base < pool.keys[0].nbytes / 4  # no copy of any layer's pool
