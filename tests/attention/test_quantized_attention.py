"""Attention over a quantized pool on the reference path: quantized matmuls over the pages,
equal to SDPA over the same values dequantized, and no dequantized copy of the context."""

from __future__ import annotations

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import pytest

from mlxkv.attention import dispatch
from mlxkv.attention.mirror import KVMirror
from mlxkv.attention.paged_cache import PagedBatch, PagedKVCache
from mlxkv.attention.quantized import quantized_attention
from mlxkv.cache.kv_format import KVFormat
from mlxkv.cache.kv_pool import KVLayout, KVPool

BLOCK = 16


def filled_pool(kv: KVFormat, rows: list[int], n_kv=2, dim=64, seed=0) -> tuple[KVPool, list[list[int]]]:
    """A pool holding `rows` contexts (their token counts) of random K/V, and their block tables."""
    per_row = [-(-n // BLOCK) for n in rows]
    pool = KVPool(KVLayout(1, n_kv, dim, dim, BLOCK, mx.float32, kv=kv), sum(per_row) + 1)
    tables, at = [], 1
    for n, nb in zip(rows, per_row):
        tables.append(list(range(at, at + nb))[::-1])  # not in order: the tables say where
        at += nb
        batch = PagedBatch.build([tables[-1]], [0], n, BLOCK)
        key = mx.random.key(seed + at)
        kv_new = mx.random.normal((2, 1, n_kv, n, dim), key=key)
        PagedKVCache(pool, 0, batch).update_and_fetch(kv_new[0], kv_new[1])
    mx.eval(pool.arrays)
    return pool, tables


def attend(pool, tables, contexts, queries, mirror=None, sinks=None):
    """One step of the last `queries.shape[2]` tokens of each row (they are written first)."""
    L = queries.shape[2]
    batch = PagedBatch.build(tables, [n - L for n in contexts], L, BLOCK, mirror=mirror)
    cache = PagedKVCache(pool, 0, batch)
    new = mx.random.normal((2, len(tables), pool.layout.n_kv_heads, L, pool.layout.head_dim), key=mx.random.key(5))
    keys, values = cache.update_and_fetch(new[0], new[1])
    mask = cache.make_mask(L)
    out = dispatch.paged_attention(queries, keys, values, cache, 0.125, mask, sinks)
    want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=mask, sinks=sinks)
    return out, want


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("contexts", "queries"), [([40, 17, 33], 1), ([40, 21], 3), ([70], 1), ([70], 4)])
def test_quantized_steps_equal_sdpa_over_the_dequantized_values(bits, contexts, queries):
    pool, tables = filled_pool(KVFormat(bits, 32), contexts)
    q = mx.random.normal((len(contexts), 4, queries, 64), key=mx.random.key(2))
    out, want = attend(pool, tables, contexts, q)
    assert mx.allclose(out, want, atol=1e-5).item()


def test_sinks_and_the_mirror_of_a_lone_row():
    pool, tables = filled_pool(KVFormat(8, 64), [50])
    mirror = KVMirror(1)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    for step in range(3):  # the first fills the mirror from the pool, the others append
        q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(step))
        out, want = attend(pool, tables, [48 + step], q, mirror=mirror, sinks=sinks)
        assert mx.allclose(out, want, atol=1e-5).item()
    assert isinstance(mirror.keys[0], tuple) and mirror.keys[0][0].dtype == mx.uint32  # it holds the pages


def test_a_decode_step_reads_the_pages_not_a_dequantized_context(monkeypatch):
    calls = []
    monkeypatch.setattr(dispatch, "quantized_attention", lambda *a, **k: calls.append(1) or quantized_attention(*a, **k))
    contexts = [6000, 6000]
    pool, tables = filled_pool(KVFormat(8, 64), contexts, n_kv=8, dim=128)
    q = mx.random.normal((2, 8, 1, 128))
    batch = PagedBatch.build(tables, [n - 1 for n in contexts], 1, BLOCK)
    cache = PagedKVCache(pool, 0, batch)
    new = mx.random.normal((1, 2, 8, 1, 128))
    keys, values = cache.update_and_fetch(new[0], new[0])
    mask = cache.make_mask(1)
    mx.eval(pool.arrays, q, mask)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(dispatch.paged_attention(q, keys, values, cache, 0.1, mask))
    dequantized = 2 * keys.size * keys.dtype.size  # what a dequantized K and V would take
    assert calls and mx.get_peak_memory() - base < dequantized


def test_a_model_that_changes_its_fetched_keys_is_attended_as_it_asks():
    pool, tables = filled_pool(KVFormat(4, 32), [30])
    batch = PagedBatch.build(tables, [29], 1, BLOCK)
    cache = PagedKVCache(pool, 0, batch)
    keys, values = cache.update_and_fetch(mx.ones((1, 2, 1, 64)), mx.ones((1, 2, 1, 64)))
    assert cache.quantized_pages(keys) is not None
    changed = keys * 2
    q = mx.random.normal((1, 4, 1, 64))
    out = dispatch.paged_attention(q, changed, values, cache, 0.125, None)
    assert cache.quantized_pages(changed) is None
    assert mx.allclose(out, mx.fast.scaled_dot_product_attention(q, changed, values, scale=0.125, mask=None)).item()


def _decode(pool, tables, contexts, queries, new, mirror=None):
    """One decode step of the rows `tables`, their new K/V `new [2, B, H, 1, D]` written first."""
    batch = PagedBatch.build(tables, [n - 1 for n in contexts], 1, BLOCK, mirror=mirror)
    cache = PagedKVCache(pool, 0, batch)
    keys, values = cache.update_and_fetch(new[0], new[1])
    return dispatch.paged_attention(queries, keys, values, cache, 0.125, cache.make_mask(1))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_of_a_batched_step_equals_its_solo_step_bit_for_bit(bits):
    """A batch's row (its context padded to the longest, masked) attends as its solo step does
    (its mirror, unpadded, unmasked), to the last bit: 8 bits would turn any last-bit difference
    into another grid step of the next layer's K/V (issue 48, item 8; docs/quantized-kv.md)."""
    contexts = [40, 17, 33]
    pool, tables = filled_pool(KVFormat(bits, 32), contexts)
    q = mx.random.normal((3, 4, 1, 64), key=mx.random.key(2))
    new = mx.random.normal((2, 3, 2, 1, 64), key=mx.random.key(3))
    batched = _decode(pool, tables, contexts, q, new)
    for b, n in enumerate(contexts):
        alone = _decode(pool, [tables[b]], [n], q[b : b + 1], new[:, b : b + 1], mirror=KVMirror(1))
        assert mx.array_equal(batched[b : b + 1], alone).item(), f"row {b}"
