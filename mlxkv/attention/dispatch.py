"""Paged attention: the one function that decides how attention reads the pool.

The reference path is pure MLX: the cache gathers a sequence's blocks into a
contiguous tensor and `mx.fast.scaled_dot_product_attention` runs on it with
a length mask. It is the oracle the Metal kernels are tested against.

A batched decode step whose rows share leading blocks takes cascade
attention (mlxkv/cascade.py) on the reference path: the shared prefix is
read once for all rows, not gathered per row.

The kernel path (mlxkv/kernels.py) serves steps of up to MAX_QUERIES new
tokens per sequence (a decode step; a speculative verify step, whose rows
are padded to one length) of supported shapes, reading K/V from the pool
through the block table; longer prefill chunks and anything else stay on
the reference path. Under `auto` the kernels serve only the (queries,
batch, context) buckets where the speed gate (speed_gate.py) timed them
faster: `AttentionChoice.path_for` says which path a step takes.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import mlx.core as mx

from mlxkv.attention import gate_store, kernels, self_check
from mlxkv.attention.self_check import KernelCheck
from mlxkv.attention.speed_gate import AttentionShape, SpeedGate
from mlxkv.attention.cascade import cascade_decode
from mlxkv.cache.kv_format import FULL, KVFormat
from mlxkv.attention.quantized import quantized_attention
from mlxkv.errors import MlxkvError, MlxkvWarning
from mlxkv.models import compat
from mlxkv.attention.paged_cache import PagedKVCache

ATTENTION_ENV = "MLXKV_ATTENTION"
MODES = ("auto", "reference", "kernel")
log = logging.getLogger(__name__)


def requested_attention(mode: str | None = None) -> str:
    """The config's choice, else MLXKV_ATTENTION, else "auto"."""
    mode = mode or os.environ.get(ATTENTION_ENV) or "auto"
    if mode not in MODES:
        raise MlxkvError(f"{ATTENTION_ENV} / attention must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def resolve_attention(mode: str | None = None, metal: bool | None = None) -> str:
    """"reference" or "kernel": "auto" (`requested_attention`) picks the Metal kernels where
    Metal is available (`metal`, None: ask MLX), else the pure-MLX reference path."""
    mode = requested_attention(mode)
    if mode == "auto":
        metal = mx.metal.is_available() if metal is None else metal
        return "kernel" if metal else "reference"
    return mode


@dataclass(frozen=True)
class AttentionChoice:
    """The path a model's decode takes, what the kernels' self-check said (None: not run) and,
    under `auto`, the speed gate's buckets (None: the kernels serve every decode)."""

    path: str  # "reference" or "kernel"
    check: KernelCheck | None = None
    gate: SpeedGate | None = None

    def path_for(self, batch: int, context: int, queries: int = 1) -> str:
        """The path of a step of `batch` rows of `queries` new tokens, the longest `context` tokens
        (over MAX_QUERIES, a prefill chunk: the reference path, which keeps a lone row's mirror)."""
        if queries > kernels.MAX_QUERIES:
            return "reference"
        if self.path == "kernel" and self.gate is not None:
            return self.gate.path_for(batch, context, queries)
        return self.path

    def as_dict(self) -> dict:
        return {"path": self.path, "check": None if self.check is None else self.check.as_dict(),
                "gate": None if self.gate is None else self.gate.as_list(),
                "gate_source": None if self.gate is None else self.gate.source}


def choose_attention(mode: str | None, dtype, head_dim: int, v_head_dim: int, block_size: int,
                     n_heads: int, n_kv_heads: int, run=None, timer=None, metal: bool | None = None,
                     kv: KVFormat = FULL, store: gate_store.GateStore | None = None) -> AttentionChoice:
    """The configured path, with the kernels checked first (self_check.py): a shape they do not
    serve, or a failed check, decodes on the reference path; the failure is one warning line.
    Under `auto` the speed gate then times them on this shape (speed_gate.py; `timer`), or
    reuses what it stored for it (gate_store.py; `store`, default the cache directory's).
    `kv`: the pool's format."""
    path = resolve_attention(mode, metal)
    if path == "reference":
        return AttentionChoice("reference")
    group = n_heads // max(n_kv_heads, 1)
    fmt = (kv.bits, kv.group_size) if kv.quantized else ()
    if n_heads % max(n_kv_heads, 1) or not kernels.supports(dtype, head_dim, v_head_dim, block_size, group, 1, *fmt):
        name = self_check.describe(dtype, head_dim, block_size, group, kv)
        return AttentionChoice("reference", KernelCheck(name, False, "no kernel serves this shape"))
    check = self_check.check_kernels(dtype, head_dim, block_size, n_heads, n_kv_heads, run, kv)
    if not check.ok:
        warnings.warn(f"the Metal attention kernels failed their check ({check.instantiation}: {check.reason}); "
                      "decoding on the reference path", KernelCheckWarning, stacklevel=2)
        return AttentionChoice("reference", check)
    if requested_attention(mode) != "auto":
        return AttentionChoice("kernel", check)  # asked for: every decode
    shape = AttentionShape(dtype, head_dim, block_size, n_heads, n_kv_heads, kv)
    try:
        gate = gate_store.stored_or_measured(shape, run=run, timer=timer, store=store)
    except Exception as e:  # a GPU fault while timing: as a failed check
        log.exception("the speed gate of the Metal attention kernels failed")
        warnings.warn(f"timing the Metal attention kernels failed ({self_check.failure(e)}); "
                      "decoding on the reference path", KernelCheckWarning, stacklevel=2)
        return AttentionChoice("reference", check)
    return AttentionChoice("kernel", check, gate)


class KernelCheckWarning(MlxkvWarning):
    """The kernels failed their self-check; the model decodes on the reference path."""


def paged_attention(queries, keys, values, cache: PagedKVCache, scale: float, mask, sinks=None):
    """Attention of `queries [B, Hq, L, D]` over the pool, through the block table.

    `keys`/`values` are the gathered contiguous K/V from `update_and_fetch`;
    the reference path uses them, a kernel reads the pool directly and
    leaves that gather unevaluated, and so does cascade attention. `sinks`
    (gpt-oss): one logit per query head that joins every softmax. Over a
    quantized pool the given K/V are the dequantized fetch: a decode or
    verify step attends over the quantized pages instead (quantized.py),
    a prefill chunk over the given K/V (its score matrix would outweigh them).
    """
    n_queries = queries.shape[2]
    if cache.batch.prefix is not None and n_queries == 1 and sinks is None:
        return cascade_decode(queries, cache, scale)
    if cache.batch.attention == "kernel" and n_queries <= kernels.MAX_QUERIES:
        out = _kernel_attention(queries, cache, scale, sinks)
        if out is not None:
            return out
    pages = cache.quantized_pages(keys) if n_queries <= kernels.MAX_QUERIES else None
    if pages is not None:
        kv = cache.pool.kv
        return quantized_attention(queries, *pages, scale, mask, kv.bits, kv.group_size, sinks)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def _kernel_attention(queries, cache: PagedKVCache, scale: float, sinks=None):
    """Attention of each row's last L (up to MAX_QUERIES) tokens on the kernels, or None where
    they do not serve the shape. A page layer may be quantized: records whose scales are in the
    pool's dtype, which the kernels read as the queries' (so the two must agree).

    The kernels let query j of L see its row's tokens up to position
    context - L + j, within the window or its own chunk: what the reference path's mask keeps
    visible (PagedKVCache.make_mask), so the mask is not needed.
    """
    k_pool = cache.pool.keys[cache.layer]
    v_pool = cache.pool.values[cache.layer]
    if cache.pool.kv.quantized and queries.dtype != cache.pool.layout.dtype:
        return None
    if not kernels.serves(queries.dtype, *queries.shape[1:], k_pool, v_pool):
        return None
    t = cache.tables
    return kernels.paged_decode(queries, k_pool, v_pool, t.kernel_tables, cache.lengths, scale,
                                window=t.window, sinks=sinks, chunk=t.chunk, table_starts=t.starts,
                                memo=t.kernel_memo)


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
