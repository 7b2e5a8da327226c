"""Quantized pools (a record per K or V row: mx.quantize's packed words, scales, biases) on
the decode kernels, one query per row and several.

The pools here are built with mx.quantize, in the layout the quantized KVPool holds
(cache/kv_format.py). Checked against the float64 oracle of the dequantized values, and against the
full-precision kernels run on the same values dequantized; planted bugs in the
dequantization must fail, and the sanitizers see an out-of-range block and no race.
"""

from __future__ import annotations

import dataclasses

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import pytest

from mlxkv.attention import dispatch as attention, kernels
from mlxkv.attention.paged_cache import PagedKVCache
from mlxkv.cache.kv_format import KVFormat
from mlxkv.cache.kv_pool import KVLayout, KVPool
from mlxkv.errors import MlxkvError
from msl.harness import SKIP_REASON, HarnessError, clang_available, shared_harness
from msl.paged import assert_close, check_case, dequantized_pool, launch_of, make_case, oracle, run_kernels

slow = pytest.mark.slow
FORMATS = [(8, 64), (8, 32), (4, 64), (4, 32)]


@pytest.mark.slow  # over a second or many params: the not-slow suite's 2 minutes
@pytest.mark.parametrize(("bits", "group", "head_dim", "queries"), [
    pytest.param(b, g, d, q, id=f"q{b}-g{g}-d{d}-L{q}", marks=() if d in (64, 128) else slow)
    for b, g in FORMATS for d in (64, 96, 128, 256) for q in (1, 4) if d % g == 0])  # mx.quantize's groups
def test_every_format_and_head_dim(on_device, bits, group, head_dim, queries):
    case = make_case(mx.float16, head_dim, 2, context_lens=(70, 9, 4), queries=queries, seed=head_dim + bits,
                     kv_bits=bits, kv_group_size=group, window=50, sinks=True)
    check_case(case, partition=32)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("queries", [1, 3])
def test_the_quantized_kernels_equal_the_full_precision_ones_on_the_same_values(on_device, bits, queries):
    # float32 activations: mx.dequantize's values are the kernels' own, exactly.
    case = make_case(mx.float32, 128, 4, context_lens=(300, 17), queries=queries, kv_bits=bits, kv_group_size=32,
                     seed=bits)
    plain = dataclasses.replace(case, k_pool=dequantized_pool(case.k_pool, 128, mx.float32),
                                v_pool=dequantized_pool(case.v_pool, 128, mx.float32))
    assert_close(run_kernels(case), run_kernels(plain), mx.float32)


def test_a_verify_step_on_a_quantized_pool_runs_on_the_kernels_through_paged_attention(on_device):
    case = make_case(mx.bfloat16, 64, 2, context_lens=(40, 9), queries=3, kv_bits=4, kv_group_size=32, seed=4)
    pool = KVPool(KVLayout(1, 2, 64, 64, 16, mx.bfloat16, kv=KVFormat(4, 32)), 1)
    assert all(a.shape[1:] == b.shape[1:] and a.dtype == b.dtype  # the pool's own layout is the kernels'
               for a, b in zip((pool.keys[0], pool.values[0]), (case.k_pool, case.v_pool)))
    pool.keys[0], pool.values[0] = case.k_pool, case.v_pool
    cache = PagedKVCache(pool, 0, case.batch("kernel"))
    out = attention.paged_attention(case.queries, None, None, cache, case.scale, cache.make_mask(3))
    assert_close(out, oracle(case), mx.bfloat16)


def test_records_of_no_format_are_not_served_rather_than_an_error():
    """`serves` answers whether a kernel can read the pools: records of a width no format has (scales
    in another dtype than the queries', a stray uint32 array) are a no, which sends the layer to the
    reference path, not an exception in the middle of a step; paged_decode itself still refuses them."""
    odd = mx.zeros((4, 2, 16, 23), mx.uint32)  # 23 words a row: no bits and group at head dim 64
    assert not kernels.serves(mx.float16, 4, 1, 64, odd, odd)
    with pytest.raises(MlxkvError, match="23 words a row"):
        kernels.quantized_format(odd, 64, mx.float16)
    fp32 = KVFormat(4, 64).record_words(64, mx.float32)  # as wide as float16 scales in groups of 32
    assert kernels.quantized_format(mx.zeros((1, 1, 16, fp32), mx.uint32), 64, mx.float16) == (4, 32)


def test_queries_of_another_dtype_than_the_pools_stay_on_the_reference_path(monkeypatch):
    # The kernels read a record's scales in the queries' dtype; a float32 pool's 8-bit records
    # in groups of 64 are as wide as float16's in groups of 32, so they would be misread.
    case = make_case(mx.float32, 64, 2, context_lens=(40, 9), queries=1, kv_bits=8, kv_group_size=64, seed=5)
    pool = KVPool(KVLayout(1, 2, 64, 64, 16, mx.float32, kv=KVFormat(8, 64)), 1)
    pool.keys[0], pool.values[0] = case.k_pool, case.v_pool
    assert kernels.quantized_format(case.k_pool, 64, mx.float16) == (8, 32)  # what the kernels would take

    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernels were asked to read a pool of another dtype")

    monkeypatch.setattr(kernels, "paged_decode", no_kernel)
    batch = case.batch("kernel")
    keys, values = (x.astype(mx.float16) for x in pool.gather(0, batch.block_tables))
    cache = PagedKVCache(pool, 0, batch)
    out = attention.paged_attention(case.queries.astype(mx.float16), keys, values, cache, case.scale,
                                    cache.make_mask(1))
    assert_close(out, oracle(case), mx.float16)


def test_a_pool_the_kernels_cannot_read_is_a_clear_error():
    case = make_case(mx.float16, 64, 2, context_lens=(20,), kv_bits=8, kv_group_size=64)
    two_bit = mx.zeros((4, 2, 16, 64 * 2 // 32 + 1), mx.uint32)  # 2 bits in groups of 64: 5 words a row
    with pytest.raises(MlxkvError, match="quantized pool must hold records of mx.quantize's packed words, scales "
                                         "and biases at 8 or 4 bits.*got 5 words a row for head dim 64"):
        run_kernels(dataclasses.replace(case, k_pool=two_bit, v_pool=two_bit))
    four_bit = make_case(mx.float16, 64, 2, context_lens=(20,), kv_bits=4, kv_group_size=64).v_pool
    with pytest.raises(MlxkvError, match="no paged-attention kernel for mlx.core.float16, head dim 64"):
        run_kernels(dataclasses.replace(case, v_pool=four_bit))  # K at 8 bits, V at 4
    with pytest.raises(MlxkvError, match="no paged-attention kernel"):  # K quantized, V not
        run_kernels(dataclasses.replace(case, v_pool=dequantized_pool(case.v_pool, 64, mx.float16)))


# ---- planted bugs ----------------------------------------------------------------------

needs_clang = pytest.mark.skipif(not clang_available(), reason=SKIP_REASON)


def planted(name: str, old: str, new: str):
    """A quantized decode kernel with one line of the shared header changed."""
    header = kernels.kernel_source("common")
    assert header.count(old) == 1, old
    return kernels.make_kernel(name, header=header.replace(old, new), quantized=True)


def harness_output(case, decode_kernel=None):
    out, _ = shared_harness().run(launch_of(case, 0, decode_kernel))
    return out.reshape(case.queries.shape)


@needs_clang
@pytest.mark.parametrize(("queries", "head_dim", "bits", "old", "new"), [
    # the elements of a word taken in the wrong order
    (1, 128, 4, "return float((word >> ((k * BITS) % 32)) & ((1u << BITS) - 1u));",
     "return float((word >> (32 - BITS - (k * BITS) % 32)) & ((1u << BITS) - 1u));"),
    (3, 128, 4, "return float((word >> ((k * BITS) % 32)) & ((1u << BITS) - 1u));",
     "return float((word >> (32 - BITS - (k * BITS) % 32)) & ((1u << BITS) - 1u));"),
    # the bias left out
    (1, 64, 8, "out[e] = s * mlxkv_quant<BITS>(w, e) + b;", "out[e] = s * mlxkv_quant<BITS>(w, e);"),
    # a lane's 64 bits: the first word read for both
    (3, 256, 8, "return uint2(rec[bit0 / 32], rec[bit0 / 32 + 1]);", "return uint2(rec[bit0 / 32], rec[bit0 / 32]);"),
    # the groups of 64 taken for 32
    (1, 128, 8, "const float s = float(scales[d0 / QG]);", "const float s = float(scales[d0 / 64]);"),
    (3, 128, 8, "const float b = float(biases[d0 / QG]);", "const float b = float(biases[d0 / 64]);"),
    # the scales read a word early in the record (where its last packed word is)
    (1, 64, 4, "(const threadgroup T*)(rec + D * BITS / 32);", "(const threadgroup T*)(rec + D * BITS / 32 - 1);"),
    (3, 64, 8, "(const threadgroup T*)(rec + D * BITS / 32);", "(const threadgroup T*)(rec + D * BITS / 32 - 1);"),
    # head dim 96: a lane's 12 bits read without their half-byte shift
    (1, 96, 4, "return uint2(x >> (bit0 % 8), 0u);", "return uint2(x, 0u);"),
], ids=["nibble-order", "multi-nibble-order", "no-bias", "multi-64-bits-first-word-only", "group-64-for-32",
        "multi-group-64-for-32", "scales-a-word-early", "multi-scales-a-word-early", "d96-no-shift"])
def test_planted_dequantization_bugs_fail_the_comparison(queries, head_dim, bits, old, new):
    case = make_case(mx.float32, head_dim, 2, n_kv_heads=1, context_lens=(40, 9), queries=queries, seed=8,
                     kv_bits=bits, kv_group_size=32)
    name = "paged_decode_multi" if queries > 1 else "paged_decode"
    expected = oracle(case)
    assert_close(harness_output(case), expected, mx.float32)
    with pytest.raises(AssertionError):
        assert_close(harness_output(case, planted(name, old, new)), expected, mx.float32)


@needs_clang
@pytest.mark.parametrize("queries", [1, 3])
def test_out_of_range_block_id_is_caught_by_address_sanitizer(queries):
    case = make_case(mx.float32, 64, 1, n_kv_heads=1, context_lens=(40,), spare_blocks=0, queries=queries,
                     kv_bits=4, kv_group_size=32)
    shared_harness().run(launch_of(case), sanitizer="address")  # clean as shipped
    case.tables[0][1] = case.k_pool.shape[0]  # one past the last block
    with pytest.raises(HarnessError, match="AddressSanitizer: heap-buffer-overflow"):
        shared_harness().run(launch_of(case), sanitizer="address")


@needs_clang
def test_the_quantized_multi_query_kernel_has_no_race():
    case = make_case(mx.float32, 64, 3, n_kv_heads=1, context_lens=(13,), queries=3, kv_bits=8, kv_group_size=32)
    shared_harness().run(launch_of(case), sanitizer="thread")
