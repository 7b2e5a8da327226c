"""Paged attention in float64: what the Metal kernels are checked against.

From the same (already rounded) inputs the kernels get: queries, the page
layers (full precision, or a quantized pool's records of `mx.quantize`'s
values, whose dequantized values `scale * q + bias` are computed exactly
here), block tables and context lengths. Query j of L in a row sits at
position n - L + j and sees the row's tokens up to its own, with a sliding
window only its last `window`, with chunked attention only those of its own
chunk; a sink is one more logit per head, with no value.

Besides the outputs it gives each output row's accumulation slack, in
units of the fp32 roundoff, which `self_check.tolerance` turns into what
rounding allows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxkv.attention import kernels
from mlxkv.kv_format import KVFormat


def f64(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32), np.float64)


def dequantized(pages, head_dim: int, dtype) -> np.ndarray:
    """A page layer's values in float64: as stored, or a quantized one's scale * q + bias
    (its records' scales in `dtype`)."""
    fmt = kernels.quantized_format(pages, head_dim, dtype)
    if fmt is None:
        return f64(pages)
    bits, group = fmt
    packed, scales, biases = KVFormat(bits, group).parts(pages, head_dim, dtype)
    words = np.array(packed).astype(np.int64)
    shifts = bits * np.arange(32 // bits)
    q = ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*words.shape[:-1], head_dim)
    return q * np.repeat(f64(scales), group, -1) + np.repeat(f64(biases), group, -1)


def attention(queries, k_pool, v_pool, tables, context_lens, scale: float, window: int | None = None,
              sinks=None, chunk: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The outputs [B, Hq, L, D] of queries [B, Hq, L, D] and each row's slack [B, Hq, L].

    Row b's keys are the first context_lens[b] tokens of its table's blocks. The slack
    bounds fp32 accumulation: 4 per visible token and 4 per head-dim term of the row's
    largest |score|, times max |V|.
    """
    q = f64(queries)
    B, H, L, D = q.shape
    k, v = dequantized(k_pool, D, queries.dtype), dequantized(v_pool, D, queries.dtype)
    sink = None if sinks is None else f64(sinks)
    n_kv = k.shape[1]
    out, slack = np.zeros((B, H, L, D)), np.zeros((B, H, L))
    for b, (table, n) in enumerate(zip(tables, context_lens)):
        keys = k[table].transpose(1, 0, 2, 3).reshape(n_kv, -1, D)[:, :n]
        values = v[table].transpose(1, 0, 2, 3).reshape(n_kv, -1, D)[:, :n]
        heads = np.arange(H) // (H // n_kv)
        qs = q[b] * scale  # [H, L, D]
        scores = np.einsum("hld,htd->hlt", qs, keys[heads])
        magnitude = np.einsum("hld,htd->hlt", np.abs(qs), np.abs(keys[heads]))
        visible = _visible(n, L, window, chunk)  # [L, n]
        top = np.where(visible, scores, -np.inf).max(-1)
        if sink is not None:
            top = np.maximum(top, sink[:, None])
        p = np.where(visible, np.exp(scores - top[..., None]), 0.0)
        total = p.sum(-1) + (0.0 if sink is None else np.exp(sink[:, None] - top))
        out[b] = np.einsum("hlt,htd->hld", p, values[heads]) / total[..., None]
        largest = np.where(visible, magnitude, 0.0).max(-1)
        slack[b] = np.abs(values[heads]).max((1, 2))[:, None] * 4 * (visible.sum(-1) + D * largest)
    return out, slack


def _visible(n: int, L: int, window: int | None, chunk: int | None = None) -> np.ndarray:
    """[L, n]: whether query j (at position n - L + j) sees token t."""
    t = np.arange(n)
    position = n - L + np.arange(L)[:, None]
    seen = t <= position
    if chunk:
        seen = seen & (position // chunk == t // chunk)
    return seen if window is None else seen & (position - t < window)
