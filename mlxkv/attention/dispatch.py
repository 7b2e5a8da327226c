"""Paged attention: the one function that decides how attention reads the pool.

The reference path is pure MLX: the cache gathers a sequence's blocks into a
contiguous tensor and `mx.fast.scaled_dot_product_attention` runs on it with
a length mask. It is the oracle the Metal kernels are tested against.

A batched decode step whose rows share leading blocks takes cascade
attention (mlxkv/cascade.py) on the reference path: the shared prefix is
read once for all rows, not gathered per row.

The kernel path (mlxkv/kernels.py) serves decode steps (one new token per
sequence) of supported shapes, reading K/V from the pool through the block
table; prefill and anything else stay on the reference path.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import mlx.core as mx

from mlxkv.attention import kernels, self_check
from mlxkv.attention.self_check import KernelCheck
from mlxkv.attention.cascade import cascade_decode
from mlxkv.errors import MlxkvError, MlxkvWarning
from mlxkv.models import compat
from mlxkv.attention.paged_cache import PagedKVCache

ATTENTION_ENV = "MLXKV_ATTENTION"
MODES = ("auto", "reference", "kernel")


def resolve_attention(mode: str | None = None) -> str:
    """"reference" or "kernel": the config's choice, else MLXKV_ATTENTION, else "auto".

    "auto" picks the Metal kernels where Metal is available, else the
    pure-MLX reference path.
    """
    mode = mode or os.environ.get(ATTENTION_ENV) or "auto"
    if mode not in MODES:
        raise MlxkvError(f"{ATTENTION_ENV} / attention must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        return "kernel" if mx.metal.is_available() else "reference"
    return mode


@dataclass(frozen=True)
class AttentionChoice:
    """The path a model's decode takes, and what the kernels' self-check said (None: not run)."""

    path: str  # "reference" or "kernel"
    check: KernelCheck | None = None

    def as_dict(self) -> dict:
        return {"path": self.path, "check": None if self.check is None else self.check.as_dict()}


def choose_attention(mode: str | None, dtype, head_dim: int, v_head_dim: int, block_size: int,
                     n_heads: int, n_kv_heads: int, run=None) -> AttentionChoice:
    """The configured path, with the kernels checked first (self_check.py): a shape they do not
    serve, or a failed check, decodes on the reference path; the failure is one warning line."""
    path = resolve_attention(mode)
    if path == "reference":
        return AttentionChoice("reference")
    group = n_heads // max(n_kv_heads, 1)
    if n_heads % max(n_kv_heads, 1) or not kernels.supports(dtype, head_dim, v_head_dim, block_size, group):
        name = self_check.describe(dtype, head_dim, block_size, group)
        return AttentionChoice("reference", KernelCheck(name, False, "no kernel serves this shape"))
    check = self_check.check_kernels(dtype, head_dim, block_size, n_heads, n_kv_heads, run)
    if not check.ok:
        warnings.warn(f"the Metal attention kernels failed their check ({check.instantiation}: {check.reason}); "
                      "decoding on the reference path", KernelCheckWarning, stacklevel=2)
        return AttentionChoice("reference", check)
    return AttentionChoice("kernel", check)


class KernelCheckWarning(MlxkvWarning):
    """The kernels failed their self-check; the model decodes on the reference path."""


def paged_attention(queries, keys, values, cache: PagedKVCache, scale: float, mask, sinks=None):
    """Attention of `queries [B, Hq, L, D]` over the pool, through the block table.

    `keys`/`values` are the gathered contiguous K/V from `update_and_fetch`;
    the reference path uses them, a kernel reads the pool directly and
    leaves that gather unevaluated, and so does cascade attention. `sinks`
    (gpt-oss): one logit per query head that joins every softmax.
    """
    decode = queries.shape[2] == 1
    if cache.batch.prefix is not None and decode and sinks is None:
        return cascade_decode(queries, cache, scale)
    if cache.batch.attention == "kernel" and decode:
        out = _kernel_decode(queries, cache, scale, sinks)
        if out is not None:
            return out
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def _kernel_decode(queries, cache: PagedKVCache, scale: float, sinks=None):
    """Decode attention on the kernels, or None where they do not serve the shape.

    The kernels read each sequence's first `context_lens` tokens, which is
    what the reference path's mask keeps visible, so the mask is not needed.
    """
    k_pool = cache.pool.keys[cache.layer]
    v_pool = cache.pool.values[cache.layer]
    n_heads, n_kv_heads = queries.shape[1], k_pool.shape[1]
    if n_heads % n_kv_heads or not (queries.dtype == k_pool.dtype == v_pool.dtype):
        return None
    if not kernels.supports(queries.dtype, queries.shape[3], v_pool.shape[3], k_pool.shape[2],
                            n_heads // n_kv_heads):
        return None
    return kernels.paged_decode(queries, k_pool, v_pool, cache.tables.kernel_tables, cache.lengths, scale,
                                window=cache.window, sinks=sinks)


def route_model_attention(model) -> bool:
    """Send the model's attention for paged caches through `paged_attention`.

    Every other cache (an mlx-lm run of the same family in this process)
    stays on the original function. False when the model's module cannot be
    routed (models/compat.py logs it): the gathered K/V that
    `update_and_fetch` returns still make such a model correct, only slower.
    """

    def routed(original):
        def attention(queries, keys, values, cache, scale, mask, sinks=None):
            if isinstance(cache, PagedKVCache):
                return paged_attention(queries, keys, values, cache, scale, mask, sinks)
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

        return attention

    return compat.route_attention(model, routed)
