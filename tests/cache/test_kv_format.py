"""A quantized pool's format and its pages: bytes per token, quantization a token at a time,
the bytes the tiers move, and the layouts that cannot be quantized."""

from __future__ import annotations

import dataclasses

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import numpy as np
import pytest

from mlxkv.attention.paged_cache import PagedBatch
from mlxkv.cache.block_kv import BlockKV
from mlxkv.cache.kv_format import FULL, KVFormat
from mlxkv.cache.kv_pool import KVLayout, KVPool, with_kv_format
from mlxkv.cache.layer_groups import GroupLayout, KVGroup
from mlxkv.cache.page_format import KVShape, PageFormat
from mlxkv.config import CacheConfig
from mlxkv.errors import MlxkvError

Q8 = KVFormat(8, 32)


def layout(kv=FULL, dtype=mx.float16, head_dim=64, layers=2) -> KVLayout:
    return KVLayout(layers, 2, head_dim, head_dim, 4, dtype, kv=kv)


@pytest.mark.parametrize(("bits", "group", "ratio"), [(8, 64, 17 / 32), (4, 64, 9 / 32), (8, 32, 18 / 32),
                                                      (4, 32, 10 / 32)])
def test_bytes_per_token_over_float16(bits, group, ratio):
    # bits / 8 bytes a value, and a float16 scale and bias per group: 0.53 at 8/64, 0.28 at 4/64
    assert layout(KVFormat(bits, group)).bytes_per_token / layout().bytes_per_token == ratio
    assert layout(KVFormat(bits, group)).kv_format == f"q{bits}g{group}"
    assert layout().kv_format == "float16"


@pytest.mark.parametrize("fields", [dict(kv_bits=3), dict(kv_bits=8, kv_group_size=128), dict(kv_bits=True),
                                    dict(kv_bits=8, memory_tier_bits=8)])
def test_bad_formats_are_one_line_errors(fields):
    with pytest.raises(MlxkvError) as e:
        CacheConfig(**fields)
    assert "\n" not in str(e.value)


def test_each_token_is_quantized_alone_so_a_block_never_depends_on_its_batch():
    tokens = mx.random.normal((1, 2, 8, 64), key=mx.random.key(1)).astype(mx.float16)
    together, apart = KVPool(layout(Q8), 4), KVPool(layout(Q8), 4)
    batch = PagedBatch.build([[0, 1]], [0], 8, 4)
    together.write(0, batch.groups[0].write_blocks, batch.write_offsets, tokens, tokens)
    for t in range(8):
        one = PagedBatch.build([[0, 1]], [t], 1, 4)
        apart.write(0, one.groups[0].write_blocks, one.write_offsets, tokens[:, :, t : t + 1], tokens[:, :, t : t + 1])
    for a, b in zip(together.arrays, apart.arrays):
        assert mx.array_equal(a, b)
    # what a gather hands the model: the stored values, dequantized
    k, v = together.gather(0, mx.array([[0, 1]]))
    want = mx.dequantize(*mx.quantize(tokens, group_size=32, bits=8), group_size=32, bits=8)
    assert mx.array_equal(k, want) and k.dtype == mx.float16


def test_blocks_leave_and_come_back_as_their_bytes():
    pool = KVPool(layout(Q8), 6)
    batch = PagedBatch.build([[4, 1]], [0], 7, 4)
    x = mx.random.normal((1, 2, 7, 64))
    pool.write(1, batch.groups[0].write_blocks, batch.write_offsets, x, -x)
    blocks = pool.read_blocks([4, 1])
    assert blocks[0].keys.dtype == mx.uint8 and blocks[0].keys.shape == (2, 2, 4, 64 + 2 * 2 * 2)
    assert blocks[0].nbytes == pool.layout.bytes_per_block  # the tiers count quantized bytes
    other = KVPool(layout(Q8), 6)
    other.write_blocks([2, 3], blocks)
    for a, b in zip(pool.arrays, other.arrays):
        assert mx.array_equal(a[mx.array([4, 1])], b[2:4])
    assert mx.array_equal(pool.gather(1, mx.array([[4, 1]]), 7)[1], other.gather(1, mx.array([[2, 3]]), 7)[1])


def test_grow_and_shrink_keep_a_quantized_pool_whole():
    pool = KVPool(layout(KVFormat(4, 32)), 4)
    assert pool.nbytes == sum(a.nbytes for a in pool.arrays)
    batch = PagedBatch.build([[3]], [0], 4, 4)
    x = mx.random.normal((1, 2, 4, 64))
    pool.write(0, batch.groups[0].write_blocks, batch.write_offsets, x, x)
    before = pool.gather(0, mx.array([[3]]))
    pool.grow(9)
    assert pool.nbytes == sum(a.nbytes for a in pool.arrays) and all(a.shape[0] == 9 for a in pool.arrays)
    pool.shrink([(3, 0)], 2)
    assert all(a.shape[0] == 2 for a in pool.arrays)
    after = pool.gather(0, mx.array([[0]]))
    assert all(mx.array_equal(a, b) for a, b in zip(before, after))


def _main_bytes(parts) -> mx.array:
    """A quantized page's bytes as the tiers stored them when the pool held three arrays (main
    at 9f29a50): each vector's packed words, then its scales, then its biases."""
    return mx.concatenate([p.view(mx.uint8) for p in parts], axis=-1)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_records_round_trip_and_are_the_tiers_old_bytes(dtype):
    for kv in (KVFormat(8, 64), KVFormat(4, 32), KVFormat(4, 64)):
        for dim in (64, 96, 128):
            if dim % kv.group_size:
                continue
            parts = kv.quantize(mx.random.normal((3, 2, 4, dim)).astype(dtype))
            records = kv.record(parts)
            assert records.dtype == mx.uint32 and records.shape[-1] == kv.record_words(dim, dtype)
            back = kv.parts(records, dim, dtype)
            assert all(mx.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(parts, back))
            data = kv.to_bytes(records)
            assert data.shape[-1] == kv.vector_bytes(dim, dtype)
            assert mx.array_equal(data, _main_bytes(parts))  # the same bytes on disk and remote
            assert mx.array_equal(kv.from_bytes(data), records)


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_a_block_main_spilled_hydrates_into_the_record_pool(dtype):
    # Old SSD files and remote values stay valid: bytes written with main's three-array format
    # read back into a pool of records as the same values (no format tag change needed).
    kv, lay = KVFormat(4, 32), layout(KVFormat(4, 32), dtype)
    pool = KVPool(lay, 4)
    x = [mx.random.normal((1, 2, 4, 64)).astype(dtype) for _ in range(4)]  # K, V of 2 layers
    old = [_main_bytes(kv.quantize(a)) for a in x]
    block = BlockKV(mx.concatenate(old[0:2]), mx.concatenate(old[2:4]))  # [layers, heads, block, bytes]
    pool.write_blocks([2], [block])
    for layer in range(2):
        for have, want in zip(pool.gather_quantized(layer, mx.array([[2]])), (x[layer], x[2 + layer])):
            assert mx.array_equal(kv.dequantize(have, dtype), kv.dequantize(kv.quantize(want), dtype))
    assert mx.array_equal(pool.read_blocks([2])[0].keys, block.keys)  # and spills them back as they were


def test_layouts_a_quantized_pool_cannot_hold_are_refused():
    assert with_kv_format(layout(), Q8).kv == Q8
    with pytest.raises(MlxkvError, match="head dim of 80 does not split into quantization groups of 64"):
        with_kv_format(layout(head_dim=80), KVFormat(8, 64))
    with pytest.raises(MlxkvError, match="groups of 64; use --kv-group-size 32"):
        with_kv_format(layout(head_dim=96), KVFormat(8, 64))
    shape = KVShape(1, 64, 1, 64)
    mixed = GroupLayout((KVGroup(0, None, (0, 1), shape=shape, pack=2), KVGroup(1, None, (2,), shape=shape)),
                        3, 1, page=PageFormat(2, 64, 2, 64))
    with pytest.raises(MlxkvError, match="holds layers of one K/V shape"):
        with_kv_format(dataclasses.replace(layout(), groups=mixed), Q8)
    states_only = KVLayout(0, 1, 1, 1, 4, mx.float32)
    assert with_kv_format(states_only, Q8).kv == FULL  # nothing to quantize: said, and kept


def test_a_write_does_not_copy_a_quantized_pool():
    pool = KVPool(KVLayout(1, 8, 128, 128, 16, mx.float16, kv=KVFormat(8, 64)), 512)
    mx.eval(pool.arrays)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    batch = PagedBatch.build([[7]], [0], 1, block_size=16)
    for _ in range(3):
        new = mx.random.normal((1, 8, 1, 128)).astype(mx.float16)
        pool.write(0, batch.groups[0].write_blocks, batch.write_offsets, new, new)
        mx.eval(pool.arrays)
    assert mx.get_peak_memory() - base < pool.keys[0].nbytes / 16
    assert np.array(pool.keys[0][7, :, 0]).any()
