"""Cascade attention: the shared prefix read once, each row's tail on its own.

The oracle is `mx.fast.scaled_dot_product_attention` over each row's whole
gathered context; in the engine, a batch whose rows share a multi-block
prefix must give each row its solo run's tokens.
"""

from __future__ import annotations

import mlxkv  # noqa: F401  (loads the BLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from mlxkv.attention import dispatch as attention
from mlxkv.cache.block_pool import Block
from mlxkv.attention.cascade import cascade_attention
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.cache.kv_pool import KVLayout, KVPool
from mlxkv.models.loader import load_model
from mlxkv.cache.sequence import Sequence
from mlxkv.attention.shared_prefix import SharedPrefix, shared_blocks

BLOCK = 8


def _sdpa_whole(q, pk, pv, tk, tv, tail_lens, scale):
    B, P = q.shape[0], pk.shape[2]
    k = mx.concatenate([mx.broadcast_to(pk, (B, *pk.shape[1:])), tk], axis=2)
    v = mx.concatenate([mx.broadcast_to(pv, (B, *pv.shape[1:])), tv], axis=2)
    mask = mx.arange(k.shape[2]) < (P + tail_lens)[:, None, None, None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@pytest.mark.parametrize("dtype, tol", [(mx.float32, 1e-5), (mx.float16, 3e-3)])
@pytest.mark.parametrize("n_heads, n_kv_heads", [(8, 2), (4, 4)])
def test_cascade_equals_sdpa_on_the_whole_context(dtype, tol, n_heads, n_kv_heads):
    mx.random.seed(3)
    B, D, P, T = 5, 16, 24, 16
    q = mx.random.normal((B, n_heads, 1, D)).astype(dtype)
    pk, pv = (mx.random.normal((1, n_kv_heads, P, D)).astype(dtype) for _ in range(2))
    tk, tv = (mx.random.normal((B, n_kv_heads, T, D)).astype(dtype) for _ in range(2))
    tail_lens = mx.array([1, 16, 5, 9, 2])  # 1: only the new token past the prefix
    out = cascade_attention(q, pk, pv, tk, tv, tail_lens, scale=0.25)
    ref = _sdpa_whole(q, pk, pv, tk, tv, tail_lens, 0.25)
    assert out.dtype == dtype and out.shape == ref.shape
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32)), atol=tol)


def test_an_empty_tail_is_the_prefix_alone():
    mx.random.seed(4)
    q = mx.random.normal((2, 4, 1, 8))
    pk, pv = mx.random.normal((1, 2, 16, 8)), mx.random.normal((1, 2, 16, 8))
    tk, tv = mx.random.normal((2, 2, 8, 8)), mx.random.normal((2, 2, 8, 8))
    out = cascade_attention(q, pk, pv, tk, tv, mx.array([0, 3]), scale=0.3)
    ref = _sdpa_whole(q, pk, pv, tk, tv, mx.array([0, 3]), 0.3)
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=1e-5)


# -- which blocks are shared, and their copy -----------------------------------

def _hashed(n, start=0):
    return [Block(start + i, ref_count=2, block_hash=bytes([start + i])) for i in range(n)]


def test_shared_blocks_stop_at_the_first_difference_and_the_write_position():
    common, a, b = _hashed(3), _hashed(2, 10), _hashed(2, 20)
    assert shared_blocks([common + a, common + b], 26, BLOCK) == common
    # A row writes into the third block: only two lie wholly before it.
    assert shared_blocks([common + a, common], 20, BLOCK) == common[:2]
    unhashed = [Block(30), Block(31)]
    assert shared_blocks([unhashed, unhashed], 16, BLOCK) == []
    assert shared_blocks([a, b], 16, BLOCK) == []


LAYOUT = KVLayout(num_layers=2, n_kv_heads=2, head_dim=8, v_head_dim=8, block_size=BLOCK, dtype=mx.float16)


def _filled_pool(num_blocks=8):
    pool = KVPool(LAYOUT, num_blocks)
    for layer in range(LAYOUT.num_layers):
        pool.keys[layer] = mx.random.normal(pool.keys[layer].shape).astype(mx.float16)
        pool.values[layer] = mx.random.normal(pool.values[layer].shape).astype(mx.float16)
    return pool


def _gather_widths(pool, monkeypatch):
    widths = []
    gather = pool.gather

    def counted(layer, tables, length=None):
        widths.append(tables.shape[1])
        return gather(layer, tables, length)

    monkeypatch.setattr(pool, "gather", counted)
    return widths


def _assert_copy_is(prefix, pool, blocks):
    table = mx.array([[b.block_id for b in blocks]])
    for layer in range(LAYOUT.num_layers):
        k, v = KVPool.gather(pool, layer, table)
        assert prefix.keys[layer].dtype == mx.float32
        np.testing.assert_array_equal(np.array(prefix.keys[layer]), np.array(k.astype(mx.float32)))
        np.testing.assert_array_equal(np.array(prefix.values[layer]), np.array(v.astype(mx.float32)))


def test_prefix_copy_is_reused_extended_shrunk_and_rebuilt_by_key(monkeypatch):
    pool = _filled_pool()
    widths = _gather_widths(pool, monkeypatch)
    blocks = _hashed(4)
    prefix = SharedPrefix(LAYOUT.num_layers)
    prefix.update(blocks[:2], pool, {1, 2})
    assert widths == [2, 2] and prefix.num_tokens == 2 * BLOCK  # one gather per layer
    _assert_copy_is(prefix, pool, blocks[:2])
    prefix.update(blocks[:2], pool, {1, 2})  # next step, same key: nothing read
    assert widths == [2, 2] and prefix.gathers == 1
    prefix.update(blocks, pool, {1, 2})  # extended: only the two new blocks
    assert widths[2:] == [2, 2] and prefix.gathers == 2
    _assert_copy_is(prefix, pool, blocks)
    prefix.update(blocks[:3], pool, {1, 3})  # shrunk: a slice, no read
    assert len(widths) == 4
    _assert_copy_is(prefix, pool, blocks[:3])
    other = _hashed(2, start=5)
    prefix.update(other, pool, {1, 3})  # other content: gathered anew
    assert widths[4:] == [2, 2] and prefix.gathers == 3
    _assert_copy_is(prefix, pool, other)
    # Content, not ids: block 5 now holds other content under a new hash.
    recycled = [Block(5, ref_count=2, block_hash=b"new"), other[1]]
    prefix.update(recycled, pool, {1, 3})
    assert widths[6:] == [2, 2]
    assert not prefix.release(1) and prefix.release(3)  # the last row gone: drop it


# -- in the engine ---------------------------------------------------------------

def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % 500 + 3 for i in range(n)]


PREFIX = prompt_of(4 * BLOCK + 3, salt=60)  # four full shared blocks and a partial one
# Tails of different lengths; the first request computes the prefix, the others hit it.
SHARED_PROMPTS = [PREFIX + prompt_of(n, salt=s) for s, n in enumerate([0, 1, 5, 9, 13, 20, 2, 30, 6])]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def loaded(request, model_dirs):
    return load_model(model_dirs[request.param])


def engine_for(loaded, num_blocks=96) -> Engine:
    return Engine(loaded, CacheConfig(block_size=BLOCK, num_blocks=num_blocks, memory_tier_bytes=0))


def _count_cascade(monkeypatch) -> list[int]:
    calls = []
    original = attention.cascade_decode

    def counted(queries, cache, scale):
        calls.append((cache.batch.batch_size, cache.batch.prefix.num_blocks))
        return original(queries, cache, scale)

    monkeypatch.setattr(attention, "cascade_decode", counted)
    return calls


def test_batch_sharing_a_prefix_takes_cascade_and_equals_solo(loaded, monkeypatch):
    solo = [engine_for(loaded).generate(p, max_tokens=10).tokens for p in SHARED_PROMPTS]
    calls = _count_cascade(monkeypatch)
    engine = engine_for(loaded)
    results = engine.generate_batch(SHARED_PROMPTS, max_tokens=10)
    assert [r.tokens for r in results] == solo
    assert max(calls) == (len(SHARED_PROMPTS), 4)  # all rows at once, on the four shared blocks
    assert engine.runner._prefix is None  # dropped with the last row


def test_prefix_copy_is_gathered_once_while_the_batch_decodes(loaded):
    engine = engine_for(loaded)
    loop = engine.loop
    for p in SHARED_PROMPTS[:4]:
        loop.add(engine.make_request(p, lambda r: None, max_tokens=12))
    seen = set()
    while loop.has_work:
        loop.step()
        prefix = engine.runner._prefix
        if prefix is not None:
            seen.add((id(prefix), prefix.gathers, prefix.num_blocks))
    assert len(seen) == 1 and next(iter(seen))[1:] == (1, 4)
    assert engine.runner._prefix is None


def test_a_row_sharing_nothing_drops_the_copy_until_it_leaves(loaded):
    engine = engine_for(loaded)
    loop = engine.loop
    outs = [[] for _ in range(4)]
    for i, p in enumerate(SHARED_PROMPTS[:3]):
        loop.add(engine.make_request(p, outs[i].append, max_tokens=16))
    copies, joined = [], None  # the runner's copy after each step (objects kept: ids recycle)
    while loop.has_work:
        loop.step()
        if joined is None and len(outs[0]) >= 4:  # mid-decode, an unrelated prompt joins
            loop.add(engine.make_request(prompt_of(11, salt=99), outs[3].append, max_tokens=3))
            joined = len(copies)
        copies.append(engine.runner._prefix)
    held = [c for i, c in enumerate(copies) if c is not None and (i == 0 or c is not copies[i - 1])]
    assert None in copies[joined:]  # dropped while that row decodes
    assert len(held) == 2 and all(c.gathers == 1 and c.num_blocks == 4 for c in held)  # then gathered anew
    assert [len(o) for o in outs] == [16, 16, 16, 3]
