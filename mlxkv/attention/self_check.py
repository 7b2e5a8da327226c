"""The kernel path checks itself before it serves a decode.

Apple's compiler has never been shown the kernels by us, and a kernel that
disagrees with the reference path on real hardware would break every
decode. So before a model decodes on the kernels, the instantiation it
needs is built and run on a small random case (a window that starts
mid-block, sinks, two partitions) and compared with the pure-MLX reference
path. A compile error, a run error or a mismatch beyond the dtype's
tolerance sends the model to the reference path, with one warning line
that says why; a request never fails for it. The runner is a parameter,
so tests here make it fail or lie.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import mlx.core as mx

from mlxkv.attention import kernels

log = logging.getLogger(__name__)

# Largest error allowed, relative to the largest output magnitude.
TOLERANCE = {mx.float32: 1e-3, mx.float16: 1e-2, mx.bfloat16: 5e-2}
_BLOCKS = 24
_CONTEXT = (300, 21)  # two rows: partitioned and not, ending mid-block
_WINDOW = 277  # starts mid-block in the long row, covers all of the short one


@dataclass(frozen=True)
class KernelCheck:
    """What the check found: `ok`, or why not."""

    instantiation: str
    ok: bool
    reason: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def describe(dtype, head_dim: int, block_size: int, group: int) -> str:
    return f"{str(dtype).removeprefix('mlx.core.')}, head dim {head_dim}, block {block_size}, group {group}"


def check_kernels(dtype, head_dim: int, block_size: int, n_heads: int, n_kv_heads: int,
                  run=None) -> KernelCheck:
    """Run the decode kernels of this shape on a random case against the reference path."""
    group = n_heads // n_kv_heads
    name = describe(dtype, head_dim, block_size, kernels.group_size_for(group) or group)
    try:
        case = _case(dtype, head_dim, block_size, n_heads, n_kv_heads)
        sinks = mx.random.normal((n_heads,), key=mx.random.key(2)).astype(dtype)
        got = kernels.paged_decode(*case, partition=256, window=_WINDOW, sinks=sinks, run=run)
        want = reference(*case, window=_WINDOW, sinks=sinks)
        mx.eval(got, want)
    except Exception as e:  # a compile or run failure: the reason goes to the warning
        return KernelCheck(name, False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": "))
    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    scale = max(mx.abs(want.astype(mx.float32)).max().item(), 1e-6)
    if not err <= TOLERANCE[dtype] * scale:  # NaN fails too
        return KernelCheck(name, False, f"differs from the reference path by {err:.3g} (scale {scale:.3g})")
    return KernelCheck(name, True)


def _case(dtype, head_dim: int, block_size: int, n_heads: int, n_kv_heads: int):
    """(queries, k_pool, v_pool, block_tables, context_lens, scale): rows over shuffled blocks."""
    k1, k2, k3, k4 = mx.random.split(mx.random.key(1), 4)
    shape = (_BLOCKS, n_kv_heads, block_size, head_dim)
    k_pool = mx.random.normal(shape, key=k1).astype(dtype)
    v_pool = mx.random.normal(shape, key=k2).astype(dtype)
    queries = mx.random.normal((len(_CONTEXT), n_heads, 1, head_dim), key=k3).astype(dtype)
    order = mx.random.permutation(_BLOCKS, key=k4).tolist()
    tables, at = [], 0
    for n in _CONTEXT:
        need = -(-n // block_size)
        tables.append(order[at : at + need])
        at += need
    width = max(len(t) for t in tables)
    block_tables = mx.array([t + [t[0]] * (width - len(t)) for t in tables], dtype=mx.int32)
    return queries, k_pool, v_pool, block_tables, list(_CONTEXT), head_dim ** -0.5


def reference(queries, k_pool, v_pool, block_tables, context_lens, scale, window, sinks):
    """The same attention on the engine's own reference path (gather, window mask, SDPA)."""
    from mlxkv.attention.dispatch import paged_attention  # dispatch imports this module
    from mlxkv.attention.paged_cache import GroupTables, PagedBatch, PagedKVCache
    from mlxkv.cache.kv_pool import KVLayout, KVPool

    n_blocks, n_kv_heads, block_size, head_dim = k_pool.shape
    pool = KVPool(KVLayout(1, n_kv_heads, head_dim, head_dim, block_size, k_pool.dtype), n_blocks)
    pool.keys[0], pool.values[0] = k_pool, v_pool
    offsets = [n - 1 for n in context_lens]
    tables = [row[: -(-n // block_size)] for row, n in zip(block_tables.tolist(), context_lens)]
    group = GroupTables.build(tables, [0] * len(offsets), offsets, 1, block_size, window)
    cache = PagedKVCache(pool, 0, PagedBatch.of_groups((group,), offsets, 1, block_size, "reference"))
    keys, values = pool.gather(0, group.block_tables)
    return paged_attention(queries, keys, values, cache, scale, cache.make_mask(1), sinks)
