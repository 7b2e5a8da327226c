"""Cascade (shared-prefix) attention for batched decode on the reference path.

Why: B rows that share a P-token prefix (a system prompt, one document with
many questions) each gathered their whole context from the pool, per layer,
per step, and ran SDPA over B padded contexts: the shared prefix was copied
and read B times. Cascade attention splits each row's context in two:

1. the shared prefix, read once for all rows from its contiguous copy
   (shared_prefix.py): the B x Hq queries go in one batched matmul, grouped
   per KV head for GQA (`[B, Hq, 1, D]` -> `[1, Hkv, B*rep, D]`);
2. the row's own tail (its blocks after the prefix, gathered per step, a
   few blocks), padded to the longest and masked by the row's length;
3. the two partial softmaxes merged through their maxima and sums, the
   split-softmax (flash-decoding) merge, so the result is the softmax over
   the whole context.

Computed in float32 and cast back to the query dtype. Quantized parts
give quantized matmuls, as in quantized.py, but the engine gives a
quantized pool's batch no cascade (model_runner.py): the merge rounds a
row otherwise than its solo step, and 8 bits make that a grid step. The
Metal kernels read the pool per row and do not use this.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.cache.kv_format import FULL, KVFormat

# The row max of an all-masked (empty) tail: finite, so its weight in the
# merge comes out exp(-huge) = 0 rather than NaN.
_EMPTY_MAX = -1e30


def cascade_decode(queries: mx.array, cache, scale: float) -> mx.array:
    """Decode attention `[B, Hq, 1, Dv]` of a `PagedKVCache` whose batch has a shared prefix."""
    b, layer, pool = cache.batch, cache.layer, cache.pool
    prefix = b.prefix
    tables = b.block_tables[:, prefix.num_blocks :]
    tail_k, tail_v = pool.gather_quantized(layer, tables) if pool.kv.quantized else pool.gather(layer, tables)
    tail_lens = mx.array(b.context_lens) - prefix.num_tokens
    return cascade_attention(
        queries, prefix.keys[layer], prefix.values[layer], tail_k, tail_v, tail_lens, scale, pool.kv
    )


def cascade_attention(queries, prefix_k, prefix_v, tail_k, tail_v, tail_lens, scale: float,
                      kv: KVFormat = FULL) -> mx.array:
    """softmax(q K^T * scale) V over [shared prefix; each row's tail].

    queries `[B, Hq, 1, D]`; prefix K/V `[1, Hkv, P, D]`; tail K/V
    `[B, Hkv, T, D]` of which row b's first `tail_lens[b]` keys are real;
    in format `kv` (quantized: each a tuple of mx.quantize's parts).
    """
    B, n_heads, _, D = queries.shape
    n_kv = (prefix_k[0] if kv.quantized else prefix_k).shape[1]
    q = (queries.astype(mx.float32) * scale).reshape(B, n_kv, n_heads // n_kv, D)
    shared = _partial(_group_rows(q), _f32(prefix_k), _f32(prefix_v), kv)
    shared = tuple(_ungroup_rows(x, B) for x in shared)
    mask = mx.arange((tail_k[0] if kv.quantized else tail_k).shape[2]) < tail_lens[:, None, None, None]
    own = _partial(q, _f32(tail_k), _f32(tail_v), kv, mask)
    return _merge(shared, own).reshape(B, n_heads, 1, -1).astype(queries.dtype)


def _partial(q, k, v, kv: KVFormat, mask=None):
    """Unnormalized softmax(q k^T) v over some keys, with the row max and sum it used."""
    scores = _matmul(q, k, kv, transpose=True)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    row_max = mx.maximum(scores.max(axis=-1, keepdims=True), _EMPTY_MAX)
    p = mx.exp(scores - row_max)
    return _matmul(p, v, kv, transpose=False), row_max, p.sum(axis=-1, keepdims=True)


def _matmul(x: mx.array, w, kv: KVFormat, transpose: bool) -> mx.array:
    """x @ w (w^T with `transpose`), for w an array or quantized parts."""
    if kv.quantized:
        return mx.quantized_matmul(x, *w, transpose=transpose, group_size=kv.group_size, bits=kv.bits)
    return x @ (w.swapaxes(-1, -2) if transpose else w)


def _merge(a, b) -> mx.array:
    (out_a, max_a, sum_a), (out_b, max_b, sum_b) = a, b
    top = mx.maximum(max_a, max_b)
    wa, wb = mx.exp(max_a - top), mx.exp(max_b - top)
    return (out_a * wa + out_b * wb) / (sum_a * wa + sum_b * wb)


def _group_rows(q: mx.array) -> mx.array:
    """`[B, Hkv, rep, X]` -> `[1, Hkv, B*rep, X]`: every row's queries of a KV head together."""
    B, n_kv, rep, X = q.shape
    return q.transpose(1, 0, 2, 3).reshape(1, n_kv, B * rep, X)


def _ungroup_rows(x: mx.array, B: int) -> mx.array:
    """The inverse of `_group_rows`."""
    _, n_kv, n, X = x.shape
    return x.reshape(n_kv, B, n // B, X).transpose(1, 0, 2, 3)


def _f32(x):
    """x in float32; quantized parts as they are (their products come out float32 for float32 queries)."""
    if isinstance(x, tuple):
        return x
    return x if x.dtype == mx.float32 else x.astype(mx.float32)
