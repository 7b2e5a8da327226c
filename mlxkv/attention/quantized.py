"""Attention over quantized K/V, on the reference path: no dequantized copy of the context.

A decode or verify step of a quantized pool multiplies its queries with
the packed keys (`mx.quantized_matmul`, the dequantization in the inner
loop), takes the softmax, and multiplies that with the packed values the
same way: mlx-lm's quantized SDPA, with the mask forms `PagedKVCache`
makes and gpt-oss's sinks. A step of many queries (a prefill chunk) would
materialize a score matrix larger than the context itself, so it runs the
fused SDPA over the dequantized context instead (dispatch.py).
"""

from __future__ import annotations

import mlx.core as mx


def quantized_attention(queries: mx.array, k_parts: tuple, v_parts: tuple, scale: float, mask, bits: int,
                        group_size: int, sinks=None) -> mx.array:
    """softmax(q K^T * scale) V of `queries [B, Hq, L, D]` over quantized K/V `[B, Hkv, T, ...]`
    (mx.quantize's packed words, scales and biases). `mask`: None, "causal" (the last L of T
    tokens), or a boolean or additive array broadcasting to `[B, Hq, L, T]`; `sinks`: `[Hq]`."""
    B, n_heads, L, D = queries.shape
    n_kv = k_parts[0].shape[1]
    rep = n_heads // n_kv
    q = (queries * scale).reshape(B, n_kv, rep, L, D)  # a KV head's query heads side by side
    k_parts = tuple(mx.expand_dims(p, 2) for p in k_parts)
    v_parts = tuple(mx.expand_dims(p, 2) for p in v_parts)
    scores = mx.quantized_matmul(q, *k_parts, transpose=True, group_size=group_size, bits=bits)
    scores = _masked(scores, mask)
    if sinks is not None:
        sink = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, n_kv, rep, 1, 1), (*scores.shape[:-1], 1))
        scores = mx.concatenate([sink, scores], axis=-1)
    weights = mx.softmax(scores, axis=-1, precise=True)
    if sinks is not None:
        weights = weights[..., 1:]
    out = mx.quantized_matmul(weights, *v_parts, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(B, n_heads, L, -1)


def _masked(scores: mx.array, mask) -> mx.array:
    """Scores `[B, Hkv, rep, L, T]` with `mask` applied (its head axis, if any, is 1 or Hq)."""
    if mask is None:
        return scores
    L, T = scores.shape[-2:]
    if isinstance(mask, str):  # "causal": the queries are the last L of the T positions
        mask = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
    if mask.ndim == 4:  # [B, H, L, T], H 1 or every query head: split as the scores' heads are
        b, h = mask.shape[:2]
        n_kv = scores.shape[1]
        mask = mask.reshape(b, 1 if h == 1 else n_kv, 1 if h == 1 else h // n_kv, *mask.shape[2:])
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask
