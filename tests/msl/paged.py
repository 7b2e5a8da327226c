"""Paged-attention test cases, the numpy oracle and the reference path.

A case is a pool with random K/V, block tables that scatter each sequence
over shuffled blocks, and one decode query per sequence. Three answers are
compared: the kernel's (through the harness, or the GPU on Metal), the
pure-MLX reference path's (`attention.paged_attention` in reference mode,
exactly as the engine calls it) and a float64 numpy oracle computed from
the same (already rounded) inputs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import numpy as np

from mlxkv.attention import dispatch as attention, self_check
from mlxkv.cache.kv_pool import KVLayout, KVPool
from mlxkv.attention.paged_cache import GroupTables, PagedBatch, PagedKVCache

# Relative tolerances of the acceptance criteria. The absolute floor is the
# same fraction of the largest expected magnitude, so values near zero are
# held to the output's scale rather than to their own.
RTOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}


@dataclass
class Case:
    queries: mx.array  # [B, Hq, 1, D]
    k_pool: mx.array  # [blocks, Hkv, block_size, D]
    v_pool: mx.array
    tables: list[list[int]]  # block ids per sequence
    context_lens: list[int]
    scale: float
    window: int | None = None  # a sliding window, in tokens (the query's own included)
    sinks: mx.array | None = None  # [Hq] attention-sink logits

    @property
    def window_starts(self) -> list[int]:
        """Each row's first visible token."""
        return [0 if self.window is None else max(0, n - self.window) for n in self.context_lens]

    @property
    def block_size(self) -> int:
        return self.k_pool.shape[2]

    @property
    def dtype(self):
        return self.queries.dtype

    def batch(self, attention_mode: str = "reference") -> PagedBatch:
        # The decode step's batch: the last token is the one being attended from.
        offsets = [n - 1 for n in self.context_lens]
        group = GroupTables.build(self.tables, [0] * len(offsets), offsets, 1, self.block_size, self.window)
        return PagedBatch.of_groups((group,), offsets, 1, self.block_size, attention_mode)

    @property
    def block_tables(self) -> mx.array:
        """As the engine hands them to the kernels."""
        return self.batch().groups[0].kernel_tables


def make_case(dtype=mx.float32, head_dim: int = 64, group: int = 2, n_kv_heads: int = 2,
              block_size: int = 16, context_lens=(37,), seed: int = 0, shuffle: bool = True,
              spare_blocks: int = 3, window: int | None = None, sinks: bool = False) -> Case:
    rng = np.random.default_rng(seed)
    needed = [-(-n // block_size) for n in context_lens]
    n_blocks = sum(needed) + spare_blocks
    ids = rng.permutation(n_blocks) if shuffle else np.arange(n_blocks)
    tables, at = [], 0
    for n in needed:
        tables.append([int(i) for i in ids[at:at + n]])
        at += n
    B, H = len(context_lens), group * n_kv_heads

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    return Case(
        queries=normal(B, H, 1, head_dim),
        k_pool=normal(n_blocks, n_kv_heads, block_size, head_dim),
        v_pool=normal(n_blocks, n_kv_heads, block_size, head_dim),
        tables=tables,
        context_lens=list(context_lens),
        scale=head_dim ** -0.5,
        window=window,
        # Sinks of the scores' own size, so they weigh in without swamping them.
        sinks=normal(H) * 2 if sinks else None,
    )


def _f64(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32)).astype(np.float64)


def oracle(case: Case) -> np.ndarray:
    """Softmax attention in float64 from the rounded inputs: [B, Hq, 1, D] (the
    self-check's oracle: a window keeps the row's last `window` tokens; a sink is one
    more logit in the softmax, with no value)."""
    out, _ = self_check.oracle(case.queries, case.k_pool, case.v_pool, case.tables, case.context_lens,
                               case.scale, case.window_starts, case.sinks)
    return out[:, :, None, :]


def reference(case: Case) -> mx.array:
    """The pure-MLX reference path, as a decode step of the engine runs it."""
    n_blocks, n_kv, bs, D = case.k_pool.shape
    pool = KVPool(KVLayout(1, n_kv, D, D, bs, case.dtype), n_blocks)
    pool.keys[0], pool.values[0] = case.k_pool, case.v_pool
    batch = case.batch("reference")
    cache = PagedKVCache(pool, 0, batch)
    length = batch.context_lens[0] if batch.batch_size == 1 else None
    keys, values = pool.gather(0, batch.block_tables, length)
    mask = cache.make_mask(1)
    return attention.paged_attention(case.queries, keys, values, cache, case.scale, mask, case.sinks)


def assert_close(actual, expected, dtype, what: str = "") -> None:
    """Within the dtype's relative tolerance (see RTOL)."""
    a = _f64(actual) if isinstance(actual, mx.array) else np.asarray(actual, np.float64)
    e = _f64(expected) if isinstance(expected, mx.array) else np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    rtol = RTOL[dtype]
    np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * float(np.abs(e).max()),
                               err_msg=what)


def instantiation_launches() -> dict[tuple, object]:
    """One launch per kernel instantiation the engine can dispatch, by template.

    Lengths and batch are runtime values, so a tiny case per (dtype, head
    dim, group size, block size) stands for every call of that instantiation.
    """
    from mlxkv.attention import kernels

    launches = {}
    for dtype, head_dim, group, block_size in decode_instantiations():
        c = make_case(dtype, head_dim, group, n_kv_heads=1, block_size=block_size, context_lens=(1,))
        B, H, _, D = c.queries.shape
        launch = kernels.decode_launch(c.queries.reshape(B, H, D), c.k_pool, c.v_pool,
                                       c.block_tables, c.context_lens, c.scale)
        launches[("paged_decode", dtype, head_dim, group, block_size)] = launch
    for dtype in kernels.DTYPES:
        partials = mx.zeros((1, 1, 2, 66), mx.float32)
        launches[("paged_reduce", dtype)] = kernels.reduce_launch(partials, dtype)
    return launches


def decode_instantiations() -> list[tuple]:
    """(dtype, head dim, group size, block size) of every decode instantiation."""
    from mlxkv.attention import kernels

    return list(itertools.product(kernels.DTYPES, kernels.HEAD_DIMS, kernels.GROUP_SIZES, kernels.BLOCK_SIZES))


def instantiation_id(dtype, head_dim: int, group: int, block_size: int) -> str:
    return f"{str(dtype).removeprefix('mlx.core.')}-d{head_dim}-g{group}-b{block_size}"
