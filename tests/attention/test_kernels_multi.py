"""Several query tokens per row (a speculative verify step: the row's last token and its
proposals), on mlxkv_paged_decode_multi.

Query j of L sits at position n - L + j of a row of n tokens and sees the row's tokens up to
its own, with a sliding window only its last `window`. Checked against the float64 oracle,
the reference path (the engine's mask), and the one-query kernel at each query's position;
planted bugs in that rule, in the sinks, the tiles and the merge must fail, and
AddressSanitizer and ThreadSanitizer see an out-of-range block and each missing barrier.
"""

from __future__ import annotations

import dataclasses

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import pytest

from mlxkv.attention import dispatch as attention, kernels
from mlxkv.attention.paged_cache import PagedKVCache
from mlxkv.cache.kv_pool import KVLayout, KVPool
from msl.harness import SKIP_REASON, HarnessError, clang_available, shared_harness
from msl.paged import assert_close, check_case, launch_of, make_case, oracle, run_kernels


slow = pytest.mark.slow


def fast_only(*fast):
    """Marks for parametrized ids: those in `fast` run in the fast suite, the rest only in the full one."""
    return lambda *values: pytest.param(*values, marks=() if values in fast else slow)


# ---- the causal rule -------------------------------------------------------------------


@pytest.mark.parametrize("window", [pytest.param(None, marks=slow), 7, pytest.param(40, marks=slow)],
                         ids=["full", "window-7", "window-40"])
def test_each_query_sees_what_a_decode_at_its_position_sees(on_device, window):
    case = make_case(mx.float32, 64, 2, context_lens=(70, 9, 5), queries=5, seed=1, window=window, sinks=True)
    several = run_kernels(case)
    for j in range(case.n_queries):
        at = [n - case.n_queries + j + 1 for n in case.context_lens]
        one = dataclasses.replace(case, queries=case.queries[:, :, j:j + 1], context_lens=at)
        assert_close(several[:, :, j:j + 1], run_kernels(one), mx.float32, f"query {j}")


@pytest.mark.parametrize(("queries", "group"), [
    fast_only((2, 1), (5, 3))(q, g) for q in (2, 3, 5, 8) for g in (1, 3, 4, 8)])
def test_query_counts_and_gqa(on_device, queries, group):
    # 1 x 2 rows to 8 x 8: one row per simdgroup with several streams, up to 8 rows each;
    # partitions chosen by occupancy; a row whose context is all new.
    case = make_case(mx.float16, 64, group, n_kv_heads=2, context_lens=(300, 40, queries), queries=queries,
                     seed=10 * queries + group)
    check_case(case)


@pytest.mark.parametrize(("window", "sinks", "partition"), [
    fast_only((1, False, 0), (19, True, 64))(w, s, p) for w in (1, 5, 16, 19, 300) for s in (False, True)
    for p in (0, 64)])
def test_sliding_windows_and_sinks(on_device, window, sinks, partition):
    # Windows of one token (each query sees only itself), shorter than the queries, a block,
    # mid-block, longer than some rows; rows shorter and longer than the window.
    case = make_case(mx.float16, 64, 2, n_kv_heads=2, block_size=16, context_lens=(4, 7, 16, 35, 330),
                     queries=4, seed=window, window=window, sinks=sinks)
    check_case(case, partition=partition)


@pytest.mark.parametrize("context", [fast_only((129,))(c) for c in (63, 64, 65, 127, 128, 129)])
def test_partition_boundaries(on_device, context):
    # The window starts mid-tile; partitions of 64 from its tile's start.
    case = make_case(mx.float32, 64, 1, n_kv_heads=1, block_size=32, context_lens=(context,), queries=3,
                     window=context - 5, seed=context)
    check_case(case, partition=64)


def test_a_verify_step_runs_on_the_kernels_through_paged_attention(on_device):
    case = make_case(mx.float16, 64, 2, context_lens=(40, 9), queries=5, seed=11)
    n_blocks, n_kv, bs, D = case.k_pool.shape
    pool = KVPool(KVLayout(1, n_kv, D, D, bs, mx.float16), n_blocks)
    pool.keys[0], pool.values[0] = case.k_pool, case.v_pool
    cache = PagedKVCache(pool, 0, case.batch("kernel"))
    keys, values = pool.gather(0, cache.batch.block_tables)
    out = attention.paged_attention(case.queries, keys, values, cache, case.scale, cache.make_mask(5))
    assert_close(out, oracle(case), mx.float16)


# ---- planted bugs ----------------------------------------------------------------------

needs_clang = pytest.mark.skipif(not clang_available(), reason=SKIP_REASON)


def planted(old: str, new: str = ""):
    body = kernels.kernel_source("paged_decode_multi")
    assert body.count(old) == 1, old
    return kernels.make_kernel("paged_decode_multi", body=body.replace(old, new))


def harness_output(case, partition, decode_kernel=None):
    harness = shared_harness()
    out, partials = harness.run(launch_of(case, partition, decode_kernel))
    if partials.ndim > 1:
        (out,) = harness.run(kernels.reduce_launch(partials, case.dtype))
    return out.reshape(case.queries.shape)


@pytest.mark.slow  # over a second or many params: the not-slow suite's 2 minutes
@needs_clang
@pytest.mark.parametrize(("old", "new", "group", "queries"), [
    # a query sees the later proposals
    ("hi[i] = r < rows ? ctx - q_len + j + 1 : 0;", "hi[i] = r < rows ? ctx : 0;", 2, 5),
    # the causal offset off by one, either way
    ("hi[i] = r < rows ? ctx - q_len + j + 1 : 0;", "hi[i] = r < rows ? ctx - q_len + j + 2 : 0;", 2, 5),
    ("hi[i] = r < rows ? ctx - q_len + j + 1 : 0;", "hi[i] = r < rows ? ctx - q_len + j : 0;", 2, 5),
    # every query takes the last query's window
    ("lo[i] = window > 0 ? max(0, hi[i] - window) : 0;", "lo[i] = window > 0 ? max(0, ctx - window) : 0;", 2, 5),
    # a sink counted once per stream, or once per partition
    ("has_sinks && part == 0 && stream == 0 && r < rows", "has_sinks && part == 0 && r < rows", 1, 2),
    ("has_sinks && part == 0 && stream == 0 && r < rows", "has_sinks && stream == 0 && r < rows", 2, 5),
    # partitions not aligned to tiles: a tile straddles two blocks
    ("const int base = start - start % TILE + part * part_tokens;",
     "const int base = start + part * part_tokens;", 2, 5),
    # the streams merged without rescaling to the set's maximum
    ("o_s[sg * D + dims[e]] = o[i][e] * own;", "o_s[sg * D + dims[e]] = o[i][e];", 1, 2),
], ids=["sees-later-proposals", "offset-plus-one", "offset-minus-one", "one-window-for-all", "sink-per-stream",
        "sink-per-partition", "unaligned-partitions", "merge-without-rescale"])
def test_planted_bugs_fail_the_comparison(old, new, group, queries):
    case = make_case(mx.float32, 64, group, n_kv_heads=1, context_lens=(150, 37), queries=queries, seed=6,
                     window=100, sinks=True)
    expected = oracle(case)
    assert_close(harness_output(case, 64), expected, mx.float32)
    with pytest.raises(AssertionError):
        assert_close(harness_output(case, 64, planted(old, new)), expected, mx.float32)


@needs_clang
def test_out_of_range_block_id_is_caught_by_address_sanitizer():
    case = make_case(mx.float32, 64, 1, n_kv_heads=1, context_lens=(40,), spare_blocks=0, queries=3)
    shared_harness().run(launch_of(case), sanitizer="address")  # clean as shipped
    case.tables[0][1] = (case.k_pool.shape[0])  # one past the last block
    with pytest.raises(HarnessError, match="AddressSanitizer: heap-buffer-overflow"):
        shared_harness().run(launch_of(case), sanitizer="address")


@needs_clang
@pytest.mark.parametrize("barrier", [
    "    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tile is in\n",
    "    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tile is free\n",
    "  threadgroup_barrier(mem_flags::mem_threadgroup);  // maxima visible\n",
    "    threadgroup_barrier(mem_flags::mem_threadgroup);  // row i of every set visible\n",
    "    threadgroup_barrier(mem_flags::mem_threadgroup);  // o_s free for the next row\n",
], ids=["tile-in", "tile-free", "maxima", "row-visible", "next-row"])
def test_missing_barrier_is_caught_by_thread_sanitizer(barrier):
    # 3 x 3 rows: two per simdgroup (the merge runs twice), five sets; two tiles.
    case = make_case(mx.float32, 64, 3, n_kv_heads=1, context_lens=(13,), queries=3)
    shared_harness().run(launch_of(case), sanitizer="thread")  # no race as shipped
    with pytest.raises(HarnessError, match="ThreadSanitizer: data race"):
        shared_harness().run(launch_of(case, decode_kernel=planted(barrier)), sanitizer="thread")
