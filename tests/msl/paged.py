"""Paged-attention test cases, the numpy oracle and the reference path.

A case is a pool with random K/V (full precision, or quantized with
`mx.quantize` into the records a quantized pool holds, cache/kv_format.py), block tables that scatter
each sequence over shuffled blocks, and one decode query per sequence, or
the last few tokens of each (a speculative verify step). Three answers are
compared: the kernel's (through the harness, or the GPU on Metal), the
pure-MLX reference path's (`attention.paged_attention` in reference mode,
exactly as the engine calls it; a quantized pool's reference path is the
pool's own, so here it runs on the dequantized values) and a float64 numpy
oracle computed from the same (already rounded) inputs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import numpy as np

from mlxkv.attention import dispatch as attention, kernels, oracle as oracle64
from mlxkv.cache.kv_pool import KVLayout, KVPool
from mlxkv.kv_format import KVFormat
from mlxkv.attention.paged_cache import GroupTables, PagedBatch, PagedKVCache

# Relative tolerances of the acceptance criteria. The absolute floor is the
# same fraction of the largest expected magnitude, so values near zero are
# held to the output's scale rather than to their own.
RTOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}


@dataclass
class Case:
    queries: mx.array  # [B, Hq, L, D]: the last L tokens of each row
    k_pool: mx.array  # [blocks, Hkv, block_size, D], or a quantized pool's uint32 records of it
    v_pool: mx.array
    tables: list[list[int]]  # block ids per sequence
    context_lens: list[int]
    scale: float
    window: int | None = None  # a sliding window, in tokens (the query's own included)
    sinks: mx.array | None = None  # [Hq] attention-sink logits
    chunk: int | None = None  # chunked attention (Llama 4): a query sees only its own chunk

    @property
    def n_queries(self) -> int:
        return self.queries.shape[2]

    @property
    def window_starts(self) -> list[int]:
        """Each row's first visible token (of its first query)."""
        return kernels.window_starts(self.context_lens, self.window, self.n_queries, self.chunk)

    @property
    def quantized(self) -> bool:
        return self.k_pool.dtype == mx.uint32

    @property
    def block_size(self) -> int:
        return self.k_pool.shape[2]

    @property
    def dtype(self):
        return self.queries.dtype

    def batch(self, attention_mode: str = "reference") -> PagedBatch:
        # The step's batch: the last L tokens are the ones being attended from.
        L = self.n_queries
        offsets = [n - L for n in self.context_lens]
        group = GroupTables.build(self.tables, [0] * len(offsets), offsets, L, self.block_size, self.window,
                                  self.chunk)
        return PagedBatch.of_groups((group,), offsets, L, self.block_size, attention_mode)

    @property
    def block_tables(self) -> mx.array:
        """As the engine hands them to the kernels."""
        return self.batch().groups[0].kernel_tables


def make_case(dtype=mx.float32, head_dim: int = 64, group: int = 2, n_kv_heads: int = 2,
              block_size: int = 16, context_lens=(37,), seed: int = 0, shuffle: bool = True,
              spare_blocks: int = 3, window: int | None = None, sinks: bool = False, queries: int = 1,
              kv_bits: int | None = None, kv_group_size: int = 64, chunk: int | None = None) -> Case:
    """A case of `queries` query tokens per row (the last of each context), over a pool
    quantized with mx.quantize at `kv_bits` (None: full precision)."""
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

    def pool():
        pages = normal(n_blocks, n_kv_heads, block_size, head_dim)
        return KVFormat(kv_bits, kv_group_size).page(pages) if kv_bits else pages

    return Case(
        queries=normal(B, H, queries, head_dim),
        k_pool=pool(),
        v_pool=pool(),
        tables=tables,
        context_lens=list(context_lens),
        scale=head_dim ** -0.5,
        window=window,
        chunk=chunk,
        # Sinks of the scores' own size, so they weigh in without swamping them.
        sinks=normal(H) * 2 if sinks else None,
    )


def _f64(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32)).astype(np.float64)


def oracle(case: Case) -> np.ndarray:
    """Softmax attention in float64 from the rounded inputs (a quantized pool's dequantized
    values exactly): [B, Hq, L, D] (mlxkv.attention.oracle, the self-check's)."""
    out, _ = oracle64.attention(case.queries, case.k_pool, case.v_pool, case.tables, case.context_lens,
                                case.scale, case.window, case.sinks, case.chunk)
    return out


def dequantized_pool(pages, head_dim: int, dtype):
    """A quantized page layer as mx.dequantize gives it back, in the activation dtype."""
    fmt = kernels.quantized_format(pages, head_dim, dtype)
    if fmt is None:
        return pages
    kv = KVFormat(*fmt)
    return kv.dequantize(kv.parts(pages, head_dim, dtype), dtype)


def reference(case: Case) -> mx.array:
    """The pure-MLX reference path, as a step of the engine runs it (on a quantized pool's
    dequantized values)."""
    k_pool, v_pool = (dequantized_pool(p, case.queries.shape[-1], case.dtype) for p in (case.k_pool, case.v_pool))
    n_blocks, n_kv, bs, D = k_pool.shape
    pool = KVPool(KVLayout(1, n_kv, D, D, bs, case.dtype), n_blocks)
    pool.keys[0], pool.values[0] = k_pool, v_pool
    batch = case.batch("reference")
    cache = PagedKVCache(pool, 0, batch)
    length = batch.context_lens[0] if batch.batch_size == 1 else None
    keys, values = pool.gather(0, batch.block_tables, length)
    mask = cache.make_mask(case.n_queries)
    return attention.paged_attention(case.queries, keys, values, cache, case.scale, mask, case.sinks)


def assert_close(actual, expected, dtype, what: str = "") -> None:
    """Within the dtype's relative tolerance (see RTOL)."""
    a = _f64(actual) if isinstance(actual, mx.array) else np.asarray(actual, np.float64)
    e = _f64(expected) if isinstance(expected, mx.array) else np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    rtol = RTOL[dtype]
    np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * float(np.abs(e).max()),
                               err_msg=what)


@dataclass(frozen=True)
class Instantiation:
    """One compiled decode kernel: its kind (one query per row, or several), template
    (dtype, head dim, rows, block size) and pool format (bits; None: full precision).
    rows: one query, the group size it is built for; several, query rows per simdgroup."""

    dtype: object
    head_dim: int
    rows: int
    block_size: int
    multi: bool = False
    bits: int | None = None

    @property
    def id(self) -> str:
        rows = f"r{self.rows}" if self.multi else f"g{self.rows}"
        kind = "-multi" if self.multi else ""
        pool = f"-q{self.bits}" if self.bits else ""
        return f"{str(self.dtype).removeprefix('mlx.core.')}-d{self.head_dim}-{rows}-b{self.block_size}{kind}{pool}"

    @property
    def shape(self) -> tuple[int, int]:
        """(query heads per kv head, query tokens per row) of a case it serves: for several
        queries, a partial last row set and simdgroups left without rows."""
        if not self.multi:
            return self.rows, 1
        return {1: (1, 3), 2: (3, 3), 4: (3, 7), 8: (6, 7)}[self.rows]

    @property
    def quant_group(self) -> int | None:
        """A quantization group the head dim allows (the group is a runtime value)."""
        return None if self.bits is None else next(g for g in kernels.QUANT_GROUPS if self.head_dim % g == 0)

    def case(self, **kw) -> Case:
        group, queries = self.shape
        kw.setdefault("queries", queries)
        return make_case(self.dtype, self.head_dim, group, block_size=self.block_size, kv_bits=self.bits,
                         kv_group_size=self.quant_group or 64, **kw)


def decode_instantiations(multi: bool | None = None, quantized: bool | None = None) -> list[Instantiation]:
    """Every decode instantiation (of one kind and pool format, if given)."""
    found = []
    for is_multi in (False, True):
        rows = kernels.ROWS_PER_SIMDGROUP if is_multi else kernels.GROUP_SIZES
        for bits in (None, *kernels.QUANT_BITS):
            if multi not in (None, is_multi) or quantized not in (None, bits is not None):
                continue
            for dtype, head_dim, r, block_size in itertools.product(kernels.DTYPES, kernels.HEAD_DIMS, rows,
                                                                    kernels.BLOCK_SIZES):
                if bits is None or any(head_dim % g == 0 for g in kernels.QUANT_GROUPS):
                    found.append(Instantiation(dtype, head_dim, r, block_size, is_multi, bits))
    return found


def instantiation_launches(instantiations=None) -> dict:
    """One launch per kernel instantiation the engine can dispatch (or of `instantiations`),
    by instantiation, and the reduce's by dtype.

    Lengths and batch are runtime values, so a tiny case per instantiation stands for
    every call of it.
    """
    launches = {}
    for inst in instantiations or decode_instantiations():
        c = inst.case(n_kv_heads=1, context_lens=(8,))
        launches[inst] = launch_of(c)
    for dtype in kernels.DTYPES:
        partials = mx.zeros((1, 1, 2, 66), mx.float32)
        launches[("paged_reduce", dtype)] = kernels.reduce_launch(partials, dtype)
    return launches


def run_kernels(case: Case, partition: int | None = None, kernels_by_name: dict | None = None) -> mx.array:
    """The kernels' answer to `case`, as dispatch calls them (kernels.run_launch runs them)."""
    return kernels.paged_decode(case.queries, case.k_pool, case.v_pool, case.block_tables, case.context_lens,
                                case.scale, partition=partition, kernels=kernels_by_name, window=case.window,
                                sinks=case.sinks, chunk=case.chunk)


def check_case(case: Case, partition: int | None = None) -> mx.array:
    """The kernels' answer to `case`, once compared with the float64 oracle and the reference path."""
    out = run_kernels(case, partition)
    what = (f"{case.dtype} D={case.queries.shape[-1]} L={case.n_queries} lens={case.context_lens} "
            f"part={partition} window={case.window} chunk={case.chunk} sinks={case.sinks is not None} quantized={case.quantized}")
    assert_close(out, oracle(case), case.dtype, f"kernel vs oracle, {what}")
    assert_close(out, reference(case), case.dtype, f"kernel vs reference path, {what}")
    return out


def launch_of(case: Case, partition: int = 0, decode_kernel=None):
    """The first launch of `case` (mlxkv_paged_decode or _multi), as paged_decode makes it."""
    B, H, L, D = case.queries.shape
    queries = case.queries if L > 1 else case.queries.reshape(B, H, D)
    return kernels.decode_launch(queries, case.k_pool, case.v_pool, case.block_tables, case.context_lens,
                                 case.scale, partition, decode_kernel, case.window_starts, case.sinks,
                                 case.window, case.chunk)


def instantiation_id(dtype, head_dim: int, group: int, block_size: int) -> str:
    return Instantiation(dtype, head_dim, group, block_size).id
