"""Chunked attention (Llama 4) on the kernels: a query sees only its own chunk of C tokens.

A verify step or a short prefill chunk of L queries can cross a chunk's end: its queries
before the boundary see from one chunk start, those after it from the next. The kernels
take the chunk size and each row's table start, and every query gets its own bound.
Checked against the float64 oracle and the reference path (the engine's mask), plain and
quantized pools, one query and several, through `paged_attention` with tables that start
past position 0 (the chunked group lets go of blocks before the chunk); a planted bug in
the per-query bound, and the old rule (one window for every query of the step), must fail.
"""

from __future__ import annotations

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import numpy as np
import pytest

from mlxkv.attention import dispatch as attention, kernels
from mlxkv.attention.paged_cache import GroupTables, PagedBatch, PagedKVCache
from mlxkv.cache.kv_format import KVFormat
from mlxkv.cache.kv_pool import KVLayout, KVPool
from msl.harness import SKIP_REASON, HarnessError, clang_available, shared_harness
from msl.paged import assert_close, check_case, launch_of, make_case, oracle

slow = pytest.mark.slow
CHUNK = 32
# Rows of a step of L <= 8 queries (chunk 32): the case (offset 30: queries 30..33), a
# crossing past a partition, one starting on a chunk's first token, one inside a chunk.
CONTEXTS = (34, 132, 104, 150)


@pytest.mark.parametrize(("dtype", "queries", "partition"), [
    (mx.float32, 4, 0),
    pytest.param(mx.float16, 8, 64, marks=slow),
    pytest.param(mx.bfloat16, 3, 32, marks=slow),
])
def test_a_verify_step_across_a_chunk_boundary(on_device, dtype, queries, partition):
    case = make_case(dtype, 64, 2, context_lens=CONTEXTS, queries=queries, seed=queries, chunk=CHUNK)
    check_case(case, partition=partition)


@pytest.mark.parametrize("chunk", [5, pytest.param(16, marks=slow)])
def test_a_short_prefill_chunk_across_chunk_boundaries(on_device, chunk):
    # Eight new tokens over chunks of 5: two boundaries inside the step.
    case = make_case(mx.float16, 64, 2, n_kv_heads=1, context_lens=(8, 29, 61), queries=8, seed=chunk,
                     chunk=chunk)
    check_case(case, partition=16)


def test_one_query_sees_its_chunk(on_device):
    # The query on a chunk's first token sees only itself; the others from their chunk's start.
    case = make_case(mx.float32, 64, 4, n_kv_heads=1, context_lens=(33, 32, 65, 150), queries=1, seed=3,
                     chunk=CHUNK)
    check_case(case, partition=64)


@pytest.mark.parametrize(("bits", "queries"), [(4, 4), pytest.param(8, 1, marks=slow),
                                               pytest.param(8, 5, marks=slow)])
def test_a_quantized_pool_across_a_chunk_boundary(on_device, bits, queries):
    case = make_case(mx.float16, 64, 2, context_lens=CONTEXTS, queries=queries, seed=bits, chunk=CHUNK,
                     kv_bits=bits, kv_group_size=32)
    check_case(case, partition=32)


@pytest.mark.parametrize("quantized", [False, True])
def test_paged_attention_with_tables_past_the_first_chunk(on_device, monkeypatch, quantized):
    """As the engine calls it: tables from each row's first held block (the chunked group lets go
    of blocks before the chunk), positions counted from there."""
    fmt = KVFormat(8, 32) if quantized else None
    case = make_case(mx.float16, 64, 2, context_lens=(70, 132), queries=5, seed=9, chunk=CHUNK,
                     kv_bits=fmt and fmt.bits, kv_group_size=32)
    bs, L = case.block_size, case.n_queries
    offsets = [n - L for n in case.context_lens]
    first = [(o - o % CHUNK) // bs for o in offsets]  # the first query's chunk's block
    tables = [t[f:] for t, f in zip(case.tables, first)]
    group = GroupTables.build(tables, [f * bs for f in first], offsets, L, bs, chunk=CHUNK)
    batch = PagedBatch.of_groups((group,), offsets, L, bs, "kernel")
    pool = KVPool(KVLayout(1, 2, 64, 64, bs, mx.float16, **({"kv": fmt} if fmt else {})), 1)
    pool.keys[0], pool.values[0] = case.k_pool, case.v_pool
    cache = PagedKVCache(pool, 0, batch)
    launches = []
    run = kernels.run_launch
    monkeypatch.setattr(kernels, "run_launch", lambda launch: launches.append(launch) or run(launch))
    out = attention.paged_attention(case.queries, None, None, cache, case.scale, cache.make_mask(L))
    assert launches, "the step did not run on the kernels"
    assert_close(out, oracle(case), mx.float16)


# ---- bugs that must fail -------------------------------------------------------------------

needs_clang = pytest.mark.skipif(not clang_available(), reason=SKIP_REASON)


def _harness_output(case, decode_kernel=None, window=None):
    launch = launch_of(case, 0, decode_kernel)
    if window is not None:  # the old rule: one window for the whole step, the chunk forgotten
        launch = kernels.decode_launch(launch.inputs[0], case.k_pool, case.v_pool, case.block_tables,
                                       case.context_lens, case.scale, 0, decode_kernel,
                                       kernels.window_starts(case.context_lens, window, case.n_queries),
                                       None, window)
    (out, _) = shared_harness().run(launch)
    return out.reshape(case.queries.shape)


@needs_clang
def test_the_per_query_chunk_bound_is_needed():
    case = make_case(mx.float32, 64, 2, n_kv_heads=1, context_lens=(34,), queries=4, seed=2, chunk=CHUNK)
    expected = oracle(case)
    assert_close(_harness_output(case), expected, mx.float32)
    body = kernels.kernel_source("paged_decode_multi")
    old = "lo[i] = start + (hi[i] - 1 - start) / chunk * chunk;"
    assert body.count(old) == 1
    planted = kernels.make_kernel("paged_decode_multi", body=body.replace(old, ""))
    with pytest.raises(AssertionError):
        assert_close(_harness_output(case, planted), expected, mx.float32)
    # The rule before issue 47: the window offset % chunk + L for every query of the step.
    # Queries 30 and 31 were right; 32 and 33 saw the previous chunk.
    old_rule = _harness_output(case, window=30 % CHUNK + 4)
    np.testing.assert_allclose(np.array(old_rule[:, :, :2]), expected[:, :, :2], rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):
        assert_close(old_rule, expected, mx.float32)


def test_a_layer_both_chunked_and_windowed_is_an_error():
    with pytest.raises(Exception, match="chunked or windowed"):
        kernels.window_starts([40], 8, 1, CHUNK)


@needs_clang
@slow  # two sanitizer builds
@pytest.mark.parametrize("bits", [None, 4])
def test_chunk_boundaries_run_clean_under_the_sanitizers(bits):
    """A verify step across a chunk's end reads only its rows' blocks (AddressSanitizer) and shares
    threadgroup memory without races (ThreadSanitizer), plain and quantized; a step started one
    chunk too early, which reads before the row's block table, is caught."""
    case = make_case(mx.float16, 64, 2, n_kv_heads=1, context_lens=(34,), queries=4, seed=3, chunk=CHUNK,
                     kv_bits=bits, spare_blocks=0)
    for sanitizer in ("address", "thread"):
        shared_harness().run(launch_of(case), sanitizer=sanitizer)  # clean as shipped
    body = kernels.kernel_source("paged_decode_multi")
    old = "const int start = window_starts[seq];"
    assert body.count(old) == 1
    early = kernels.make_kernel("paged_decode_multi", body=body.replace(old, old[:-1] + " - chunk;"),
                                quantized=bits is not None)
    with pytest.raises(HarnessError, match="AddressSanitizer"):
        shared_harness().run(launch_of(case, decode_kernel=early), sanitizer="address")
