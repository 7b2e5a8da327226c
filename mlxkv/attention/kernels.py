"""Metal paged-attention kernels: sources, instantiations and dispatch sizes.

The sources ship in the `metal` package: `common.metal` is the header of
every kernel, the other files are kernel bodies whose signatures
`mx.fast.metal_kernel` generates from the input and output names. Kernel
objects are built on first use; building one needs no GPU, which is how the
MSL test harness (tests/msl) gets at the generated source on Linux.

Decode attention is one `mlxkv_paged_decode` launch, plus one
`mlxkv_paged_reduce` when sequences are split into partitions to give the
GPU enough threadgroups. Every call describes itself as a `Launch` and goes
through `run_launch`: the kernel itself on Metal, a CPU runner in the
harness tests.

Instantiations: one per (dtype, head dim, GQA group size, block size), the
group size rounded up to 1, 2, 4 or 8; the block size is a template
constant so that a token's block and slot are a shift and a mask. Context
lengths, partitioning, the real group size, a sliding window's start and
attention sinks are runtime values: they only set where the token loop
starts and what the softmax starts from, and each instantiation is one
more compile on a Mac's first decode. Inputs under 8 elements would reach
the kernel in the `constant` address space, which changes the generated
signature, so the small index inputs are padded to 8: Python lists here,
block tables where they are built (paged_cache.GroupTables.kernel_tables),
never with an MLX op per call.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

import mlx.core as mx

from mlxkv.errors import MlxkvError

DTYPES = (mx.float16, mx.bfloat16, mx.float32)
HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_SIZES = (16, 32)
GROUP_SIZES = (1, 2, 4, 8)  # built for these; 3, 5, 6, 7 round up
SIMDGROUPS = 8
THREADS = 32 * SIMDGROUPS  # per decode threadgroup
REDUCE_THREADS = 64
# Simdgroups that keep an Apple GPU busy: what MLX's sdpa_vector launches
# for Llama-3-8B at batch 1 (32 heads x 1024 threads). Sequences are split
# into partitions until the grid has this many...
TARGET_SIMDGROUPS = 1024
# ...but no partition under this many tokens (8 per simdgroup): each one
# costs a row of partials written and read again by the reduce.
MIN_PART_TOKENS = 64
MIN_ELEMENTS = 8  # MLX passes smaller inputs in the constant address space

_SIGNATURES = {
    "paged_decode": (
        ["queries", "k_pool", "v_pool", "block_tables", "context_lens", "window_starts", "sinks", "scale",
         "params"],
        ["out", "partials"],
    ),
    "paged_reduce": (["partials", "params"], ["out"]),
}


def kernel_source(name: str) -> str:
    """The text of metal/<name>.metal, from the installed package."""
    return resources.files("mlxkv.metal").joinpath(f"{name}.metal").read_text()


def make_kernel(name: str, body: str | None = None, header: str | None = None):
    """An `mx.fast.metal_kernel` for one of `_SIGNATURES`, from the shipped
    source unless `body` / `header` replace it (the harness tests plant bugs)."""
    input_names, output_names = _SIGNATURES[name]
    return mx.fast.metal_kernel(
        name=f"mlxkv_{name}",
        input_names=input_names,
        output_names=output_names,
        source=kernel_source(name) if body is None else body,
        header=kernel_source("common") if header is None else header,
    )


@functools.cache
def kernel(name: str):
    return make_kernel(name)


@dataclass(frozen=True)
class Launch:
    """One kernel call: everything `mx.fast.metal_kernel` is called with."""

    kernel: Any
    inputs: tuple[mx.array, ...]
    template: tuple[tuple[str, Any], ...]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[mx.Dtype, ...]

    def __call__(self, inputs=None, verbose: bool = False) -> list[mx.array]:
        return self.kernel(
            inputs=list(self.inputs if inputs is None else inputs),
            template=list(self.template),
            grid=self.grid,
            threadgroup=self.threadgroup,
            output_shapes=list(self.output_shapes),
            output_dtypes=list(self.output_dtypes),
            verbose=verbose,
        )


def run_launch(launch: Launch) -> list[mx.array]:
    """Run a launch on the GPU. Tests replace this to run it elsewhere."""
    if not mx.metal.is_available():
        raise MlxkvError("the attention kernels need a Metal GPU; use attention=reference "
                         "(MLXKV_ATTENTION=reference)")
    return launch()


def group_size_for(group: int) -> int | None:
    """The instantiated group size serving `group` query heads per kv head."""
    return next((g for g in GROUP_SIZES if g >= group), None)


def supports(dtype, head_dim: int, v_head_dim: int, block_size: int, group: int) -> bool:
    """Whether decode attention of this shape can run on the kernels."""
    return (
        dtype in DTYPES
        and head_dim in HEAD_DIMS
        and v_head_dim == head_dim
        and block_size in BLOCK_SIZES
        and group_size_for(group) is not None
    )


def partition_size(batch: int, n_kv_heads: int, max_span: int) -> int:
    """Tokens per partition, or 0 for one pass over each sequence.

    Chosen by occupancy: a grid of batch x kv heads threadgroups is split
    until it holds about TARGET_SIMDGROUPS simdgroups, in partitions of at
    least MIN_PART_TOKENS of the longest row's `max_span` visible tokens.
    """
    wanted = -(-TARGET_SIMDGROUPS // (batch * n_kv_heads * SIMDGROUPS))
    n_parts = min(wanted, max_span // MIN_PART_TOKENS)
    return -(-max_span // n_parts) if n_parts > 1 else 0


def table_width(n_rows: int, longest: int) -> int:
    """Columns of a block table of `n_rows` rows: the longest row's blocks, and at
    least MIN_ELEMENTS entries in all (see the module docstring)."""
    return max(longest, -(-MIN_ELEMENTS // n_rows))


def _padded(values: list) -> list:
    return list(values) + [0] * (MIN_ELEMENTS - len(values))


def decode_launch(queries, k_pool, v_pool, block_tables, context_lens, scale: float,
                  partition: int = 0, decode_kernel=None, window_starts=None, sinks=None) -> Launch:
    """The first (or only) launch of paged decode attention.

    queries [B, Hq, D]; pools [blocks, Hkv, block_size, D]; block_tables
    [B, nb] int32 (rows padded with any valid id); context_lens: B ints;
    partition: tokens per partition, 0 for a single pass; window_starts:
    B ints, each row's first visible token (None: all from 0); sinks: [Hq]
    logits that join every softmax (None: no sinks).
    """
    B, n_heads, D = queries.shape
    _, n_kv_heads, block_size, _ = k_pool.shape
    group = n_heads // n_kv_heads
    if n_heads % n_kv_heads or not supports(queries.dtype, D, v_pool.shape[3], block_size, group):
        raise MlxkvError(f"no paged-attention kernel for {queries.dtype}, head dim {D}, "
                         f"block size {block_size}, {n_heads} over {n_kv_heads} kv heads")
    window_starts = list(window_starts) if window_starts is not None else [0] * B
    max_span = max(n - s for n, s in zip(context_lens, window_starts))
    n_parts = 1 if partition == 0 else math.ceil(max_span / partition)
    part_tokens = partition if n_parts > 1 else max(max_span, 1)
    has_sinks = sinks is not None
    # Sinks of under 8 heads (tiny models only) reach the kernel as constant memory.
    sinks = sinks.astype(mx.float32) if has_sinks else mx.array(_padded([0.0] * n_heads), dtype=mx.float32)
    params = [n_heads, n_kv_heads, group, block_tables.shape[1], part_tokens, n_parts, int(has_sinks)]
    partials_shape = (B, n_heads, n_parts, D + 2) if n_parts > 1 else (1,)
    return Launch(
        kernel=decode_kernel or kernel("paged_decode"),
        inputs=(
            queries,
            k_pool,
            v_pool,
            block_tables.astype(mx.int32),
            mx.array(_padded(context_lens), dtype=mx.int32),
            mx.array(_padded(window_starts), dtype=mx.int32),
            sinks,
            mx.array(scale, dtype=mx.float32),
            mx.array(_padded(params), dtype=mx.int32),
        ),
        template=(("T", queries.dtype), ("D", D), ("G", group_size_for(group)), ("BS", block_size),
                  ("NSG", SIMDGROUPS)),
        grid=(THREADS * n_parts, n_kv_heads, B),
        threadgroup=(THREADS, 1, 1),
        output_shapes=((B, n_heads, D), partials_shape),
        output_dtypes=(queries.dtype, mx.float32),
    )


def window_starts(context_lens, window: int | None) -> list[int]:
    """Each row's first visible token: the last `window` of its context, or all of it."""
    return [0 if window is None else max(0, n - window) for n in context_lens]


def reduce_launch(partials: mx.array, dtype, reduce_kernel=None) -> Launch:
    """The second pass: merge partials [B, Hq, parts, D + 2] into [B, Hq, D]."""
    B, n_heads, n_parts, row = partials.shape
    D = row - 2
    return Launch(
        kernel=reduce_kernel or kernel("paged_reduce"),
        inputs=(partials, mx.array([n_heads, D, n_parts], dtype=mx.int32)),
        template=(("T", dtype),),
        grid=(D, n_heads, B),
        threadgroup=(REDUCE_THREADS, 1, 1),
        output_shapes=((B, n_heads, D),),
        output_dtypes=(dtype,),
    )


def paged_decode(queries, k_pool, v_pool, block_tables, context_lens, scale: float,
                 partition: int | None = None, kernels: dict | None = None, window: int | None = None,
                 sinks=None, run=None) -> mx.array:
    """Decode attention `[B, Hq, 1, D]` of one query token per sequence over the pool.

    partition: tokens per partition, 0 for one pass, None to choose
    (`partition_size`). kernels: replacements for the shipped kernel objects,
    by name ("paged_decode", "paged_reduce"). window: a sliding window's
    size in tokens, the query included (None: full attention); sinks: [Hq].
    run: what runs a Launch (run_launch: the GPU).
    """
    kernels = kernels or {}
    run = run or run_launch
    B, n_heads, _, D = queries.shape
    starts = window_starts(context_lens, window)
    if partition is None:
        partition = partition_size(B, k_pool.shape[1], max(n - s for n, s in zip(context_lens, starts)))
    first = decode_launch(queries.reshape(B, n_heads, D), k_pool, v_pool, block_tables,
                          context_lens, scale, partition, kernels.get("paged_decode"), starts, sinks)
    out, partials = run(first)
    if partials.ndim > 1:
        (out,) = run(reduce_launch(partials, queries.dtype, kernels.get("paged_reduce")))
    return out.reshape(B, n_heads, 1, D)
