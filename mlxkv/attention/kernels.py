"""Metal paged-attention kernels: sources, instantiations and dispatch sizes.

The sources ship in the `metal` package: `common.metal` is the header of
every kernel, the other files are kernel bodies whose signatures
`mx.fast.metal_kernel` generates from the input and output names. Kernel
objects are built on first use; building one needs no GPU, which is how the
MSL test harness (tests/msl) gets at the generated source on Linux.

Decode attention is one `mlxkv_paged_decode` launch (one query token per
row) or `mlxkv_paged_decode_multi` (2 to MAX_QUERIES: a speculative verify
step), plus one `mlxkv_paged_reduce` when sequences are split into
partitions to give the GPU enough threadgroups. Every call describes itself
as a `Launch` and goes through `run_launch`: the kernel itself on Metal, a
CPU runner in the harness tests.

Instantiations: one per (dtype, head dim, GQA group size, block size) for
one query, the group size rounded up to 1, 2, 4 or 8; for several, the
group size gives way to the query rows each simdgroup holds
(`rows_per_simdgroup`). The block size is a template constant so that a
token's block and slot are a shift and a mask. A quantized pool (one
`uint32` record per K or V row: `mx.quantize`'s packed words, then scales,
then biases; kv_format.py) has its own kernels of each kind, with the bits
and the quantization group as two more template constants. Context lengths, partitioning, the real
group size and query count, a sliding window and attention sinks are
runtime values: they only set where the token loop starts, what each query
sees and what the softmax starts from, and each instantiation is one more
compile on a Mac's first decode that uses it. Inputs under 8 elements would reach
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

from mlxkv.attention import gpu_size
from mlxkv.attention.gpu_size import GPUSize
from mlxkv.errors import MlxkvError
from mlxkv.kv_format import record_format

DTYPES = (mx.float16, mx.bfloat16, mx.float32)
HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_SIZES = (16, 32)
GROUP_SIZES = (1, 2, 4, 8)  # built for these; 3, 5, 6, 7 round up
MAX_QUERIES = 8  # query tokens per row the multi-query kernel serves (as MLX's sdpa_vector)
ROWS_PER_SIMDGROUP = (1, 2, 4, 8)  # multi-query kernel: query rows in a simdgroup's registers
QUANT_BITS = (8, 4)
QUANT_GROUPS = (64, 32)
TILE = 8  # positions the multi-query kernel copies to threadgroup memory at once
# A quantized pool's: 16 rows of records start a 64-byte segment whatever their width (metal/common.metal).
QUANT_TILE = 16
SIMDGROUPS = 8
THREADS = 32 * SIMDGROUPS  # per decode threadgroup
REDUCE_THREADS = 64
# Sequences are split into partitions until the grid fills the GPU
# (gpu_size.GPUSize.target_simdgroups), but no partition under this many
# tokens (four iterations of each simdgroup's token loop): each one costs a
# merge of 1 + 2G barriers and a row of partials the reduce reads again.
MIN_PART_TOKENS = 128
MIN_ELEMENTS = 8  # MLX passes smaller inputs in the constant address space

_POOLS = ["k_pool", "v_pool"]
_INDEX = ["block_tables", "context_lens", "window_starts", "sinks", "scale", "params"]
_DECODE_OUTPUTS = ["out", "partials"]


def kernel_source(name: str) -> str:
    """The text of metal/<name>.metal, from the installed package."""
    return resources.files("mlxkv.metal").joinpath(f"{name}.metal").read_text()


def make_kernel(name: str, body: str | None = None, header: str | None = None, quantized: bool = False):
    """An `mx.fast.metal_kernel` of metal/<name>.metal ("paged_decode", "paged_decode_multi",
    "paged_reduce"), from the shipped source unless `body` / `header` replace it (the harness
    tests plant bugs); `quantized`: the decode kernel's variant reading quantized pools."""
    header = kernel_source("common") if header is None else header
    if name == "paged_reduce":
        inputs, outputs = ["partials", "params"], ["out"]
    else:
        inputs, outputs = ["queries"] + _POOLS + _INDEX, _DECODE_OUTPUTS
    return mx.fast.metal_kernel(
        name=f"mlxkv_{name}" + ("_quantized" if quantized else ""),
        input_names=inputs,
        output_names=outputs,
        source=kernel_source(name) if body is None else body,
        header=("#define MLXKV_QUANTIZED 1\n" if quantized else "") + header,
    )


def kernel(name: str, quantized: bool = False):
    """The shipped kernel object of `name`, one per process (however it is asked for)."""
    return _kernel(name, bool(quantized))


@functools.cache
def _kernel(name: str, quantized: bool):
    return make_kernel(name, quantized=quantized)


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


def rows_per_simdgroup(group: int, queries: int) -> int | None:
    """The multi-query instantiation serving `group` x `queries` query rows per kv head:
    the fewest rows a simdgroup holds with SIMDGROUPS of them covering all."""
    return next((r for r in ROWS_PER_SIMDGROUP if r * SIMDGROUPS >= group * queries), None)


def supports(dtype, head_dim: int, v_head_dim: int, block_size: int, group: int, queries: int = 1,
             bits: int | None = None, quant_group: int | None = None) -> bool:
    """Whether attention of this shape, `queries` tokens per row, can run on the kernels;
    `bits`/`quant_group`: a quantized pool's format (None: full precision)."""
    pool_format = bits is None or (bits in QUANT_BITS and quant_group in QUANT_GROUPS
                                   and head_dim % quant_group == 0)
    return (
        dtype in DTYPES
        and head_dim in HEAD_DIMS
        and v_head_dim == head_dim
        and block_size in BLOCK_SIZES
        and group_size_for(group) is not None
        and 1 <= queries <= MAX_QUERIES
        and pool_format
    )


def quantized_format(page, head_dim: int, dtype) -> tuple[int, int] | None:
    """(bits, quantization group) of a quantized page layer (`uint32` records of vectors of `head_dim`
    with scales in `dtype`, which must be the pool's: dispatch.py checks it), from its records' width;
    None for a full-precision pool."""
    if page.dtype != mx.uint32:
        return None
    kv = record_format(page.shape[-1], head_dim, dtype, QUANT_BITS, QUANT_GROUPS)
    if kv is None:
        raise MlxkvError(f"a quantized pool must hold records of mx.quantize's packed words, scales and biases at "
                         f"{' or '.join(map(str, QUANT_BITS))} bits, groups of {' or '.join(map(str, QUANT_GROUPS))}; "
                         f"got {page.shape[-1]} words a row for head dim {head_dim}, scales in {dtype}")
    return kv.bits, kv.group_size


def partition_size(batch: int, n_kv_heads: int, max_span: int, gpu: GPUSize | None = None) -> int:
    """Tokens per partition, or 0 for one pass over each sequence (one launch, no reduce).

    Chosen by occupancy: a grid of batch x kv heads threadgroups is split
    until it holds the simdgroups `gpu` (default: this machine's) needs, in
    partitions of at least MIN_PART_TOKENS of the longest row's `max_span`
    visible tokens.
    """
    target = (gpu or gpu_size.current()).target_simdgroups
    wanted = -(-target // (batch * n_kv_heads * SIMDGROUPS))
    n_parts = min(wanted, max_span // MIN_PART_TOKENS)
    return -(-max_span // n_parts) if n_parts > 1 else 0


def table_width(n_rows: int, longest: int) -> int:
    """Columns of a block table of `n_rows` rows: the longest row's blocks, and at
    least MIN_ELEMENTS entries in all (see the module docstring)."""
    return max(longest, -(-MIN_ELEMENTS // n_rows))


def _padded(values: list) -> list:
    return list(values) + [0] * (MIN_ELEMENTS - len(values))


def _index_array(memo: dict | None, values, dtype=mx.int32) -> mx.array:
    """`values` padded as an array, built once per `memo` (a step's: every layer of a step passes
    the same lengths, starts, scale and params, so only the first layer's call builds them)."""
    key = (tuple(values) if isinstance(values, (list, tuple)) else values, dtype)
    if memo is not None and key in memo:
        return memo[key]
    out = mx.array(_padded(values) if isinstance(values, (list, tuple)) else values, dtype=dtype)
    if memo is not None:
        memo[key] = out
    return out


def _sinks_f32(memo: dict | None, sinks, n_heads: int) -> mx.array:
    """The sinks as fp32 (zeros without), cast once per `memo` for each sinks array."""
    if sinks is None:
        return _index_array(memo, [0.0] * max(n_heads, MIN_ELEMENTS), mx.float32)
    key = ("sinks", id(sinks))
    if memo is not None and key in memo and memo[key][0] is sinks:
        return memo[key][1]
    cast = sinks.astype(mx.float32)
    if memo is not None:
        memo[key] = (sinks, cast)  # holding sinks keeps its id from being reused
    return cast


def window_starts(context_lens, window: int | None, queries: int = 1, chunk: int | None = None,
                  table_starts=None) -> list[int]:
    """Each row's first visible token: the last `window` of its context before its first
    query (of `queries`, the last ones of the context), or the start of that query's chunk
    of `chunk` tokens (Llama 4), or all of it. Positions count from each row's table start;
    chunks from position 0, which is `table_starts` (default 0) before the table's."""
    if chunk:
        if window is not None:
            raise MlxkvError("a layer is either chunked or windowed, not both")
        table_starts = table_starts or [0] * len(context_lens)
        firsts = [s + max(n - queries, 0) for n, s in zip(context_lens, table_starts)]
        return [p - p % chunk - s for p, s in zip(firsts, table_starts)]
    return [0 if window is None else max(0, n - queries + 1 - window) for n in context_lens]


def decode_launch(queries, k_pool, v_pool, block_tables, context_lens, scale: float, partition: int = 0,
                  decode_kernel=None, window_starts=None, sinks=None, window: int | None = None,
                  chunk: int | None = None, memo: dict | None = None) -> Launch:
    """The first (or only) launch of paged attention.

    queries [B, Hq, D] (one token per row: mlxkv_paged_decode) or [B, Hq, L, D] (L of 2 to
    MAX_QUERIES, the last L tokens of each row's context: mlxkv_paged_decode_multi); pools
    [blocks, Hkv, block_size, D], or a quantized pool's records of them (kv_format.py);
    block_tables [B, nb] int32 (rows padded with any valid id); context_lens: B ints;
    partition: tokens per partition, 0 for a single pass; window_starts: B ints, each
    row's first visible token (None: all from 0); window: a sliding window's size (several
    queries: each sees its own last `window`); chunk: chunked attention's chunk size (several
    queries: each sees from its own chunk's start, counted from window_starts, the first query's
    chunk start; one query: window_starts alone says it); sinks: [Hq] logits that join every softmax;
    memo: a step's store of the small index arrays (`_index_array`), None to build them here.
    """
    multi = queries.ndim == 4
    B, n_heads, n_queries, D = queries.shape if multi else (*queries.shape[:2], 1, queries.shape[2])
    fmt, n_kv_heads, block_size = _served(queries.dtype, n_heads, n_queries, D, k_pool, v_pool)
    group = n_heads // n_kv_heads
    window_starts = list(window_starts) if window_starts is not None else [0] * B
    tile = _tile(fmt)
    aligned = [s - s % tile for s in window_starts] if multi else window_starts
    max_span = max(n - s for n, s in zip(context_lens, aligned))
    if multi:
        partition = -(-partition // tile) * tile  # whole tiles: none is read by two partitions
    n_parts = 1 if partition == 0 else math.ceil(max_span / partition)
    part_tokens = partition if n_parts > 1 else max(max_span, 1)
    has_sinks = sinks is not None
    # Sinks of under 8 heads (tiny models only) reach the kernel as constant memory.
    sinks = _sinks_f32(memo, sinks, n_heads)
    params = [n_heads, n_kv_heads, group, block_tables.shape[1], part_tokens, n_parts, int(has_sinks)]
    params += [n_queries, window or 0, chunk or 0] if multi else []
    rows = n_heads * n_queries
    partials_shape = (B, rows, n_parts, D + 2) if n_parts > 1 else (1,)
    name = "paged_decode_multi" if multi else "paged_decode"
    template = (("T", queries.dtype), ("D", D),
                ("RS", rows_per_simdgroup(group, n_queries)) if multi else ("G", group_size_for(group)),
                ("BS", block_size), ("NSG", SIMDGROUPS)) + ((("BITS", fmt[0]), ("QG", fmt[1])) if fmt else ())
    return Launch(
        kernel=decode_kernel or kernel(name, quantized=fmt is not None),
        inputs=(
            queries,
            k_pool, v_pool,
            block_tables.astype(mx.int32),
            _index_array(memo, list(context_lens)),
            _index_array(memo, window_starts),
            sinks,
            _index_array(memo, float(scale), mx.float32),
            _index_array(memo, params),
        ),
        template=template,
        grid=(THREADS * n_parts, n_kv_heads, B),
        threadgroup=(THREADS, 1, 1),
        output_shapes=(queries.shape, partials_shape),
        output_dtypes=(queries.dtype, mx.float32),
    )


def serves(dtype, n_heads: int, n_queries: int, head_dim: int, k_pool, v_pool) -> bool:
    """Whether a kernel serves these queries over these page layers: a supported shape, K and
    V in one format (a quantized pool's records: read with scales in the queries' dtype; the
    caller knows the pool's, dispatch.py); False, not an error, for records of no format."""
    try:
        fmt = quantized_format(k_pool, head_dim, dtype)
        if quantized_format(v_pool, head_dim, dtype) != fmt:
            return False
    except MlxkvError:
        return False
    v_dim = head_dim if fmt else v_pool.shape[3]
    dtypes = {dtype} if fmt else {k_pool.dtype, v_pool.dtype}
    n_kv_heads = k_pool.shape[1]
    return (n_heads % n_kv_heads == 0 and dtypes == {dtype}
            and supports(dtype, head_dim, v_dim, k_pool.shape[2], n_heads // n_kv_heads, n_queries, *(fmt or ())))


def _tile(fmt) -> int:
    """Positions the multi-query kernel copies at once, for a pool of format `fmt`."""
    return QUANT_TILE if fmt else TILE


def _served(dtype, n_heads: int, n_queries: int, D: int, k_pool, v_pool) -> tuple:
    """(pool format, kv heads, block size) of pools a kernel `serves`, or MlxkvError."""
    fmt = quantized_format(k_pool, D, dtype)
    _, n_kv_heads, block_size, _ = k_pool.shape
    if not serves(dtype, n_heads, n_queries, D, k_pool, v_pool):
        raise MlxkvError(f"no paged-attention kernel for {dtype}, head dim {D}, block size {block_size}, "
                         f"{n_heads} over {n_kv_heads} kv heads, {n_queries} queries per row"
                         + (f", {fmt[0]}-bit pool" if fmt else ""))
    return fmt, n_kv_heads, block_size


def _reduce_params(memo: dict | None, n_rows: int, D: int, n_parts: int) -> mx.array:
    """The reduce's params, once per `memo` (3 elements: the reduce's own signature takes them so)."""
    key = ("reduce", n_rows, D, n_parts)
    if memo is None or key not in memo:
        out = mx.array([n_rows, D, n_parts], dtype=mx.int32)
        if memo is None:
            return out
        memo[key] = out
    return memo[key]


def reduce_launch(partials: mx.array, dtype, reduce_kernel=None, memo: dict | None = None) -> Launch:
    """The second pass: merge partials [B, rows, parts, D + 2] into [B, rows, D] (rows: the
    query heads x query tokens of a row)."""
    B, n_rows, n_parts, row = partials.shape
    D = row - 2
    return Launch(
        kernel=reduce_kernel or kernel("paged_reduce"),
        inputs=(partials, _reduce_params(memo, n_rows, D, n_parts)),
        template=(("T", dtype),),
        grid=(D, n_rows, B),
        threadgroup=(REDUCE_THREADS, 1, 1),
        output_shapes=((B, n_rows, D),),
        output_dtypes=(dtype,),
    )


def paged_decode(queries, k_pool, v_pool, block_tables, context_lens, scale: float,
                 partition: int | None = None, kernels: dict | None = None, window: int | None = None,
                 sinks=None, run=None, chunk: int | None = None, table_starts=None,
                 memo: dict | None = None) -> mx.array:
    """Attention `[B, Hq, L, D]` of the last L (1 to MAX_QUERIES) tokens of each sequence
    over the pool, each query seeing the row's tokens up to its own (a decode step at L = 1,
    a speculative verify step above).

    k_pool/v_pool: a page layer [blocks, Hkv, block_size, D], or a quantized one's records
    [blocks, Hkv, block_size, words] (kv_format.py), read with scales in the queries' dtype.
    partition: tokens per partition, 0 for one pass, None to choose (`partition_size`).
    kernels: replacements for the shipped kernel objects, by name ("paged_decode",
    "paged_decode_multi", "paged_reduce"). window: a sliding window's size in tokens, the
    query included (None: full attention); chunk: chunked attention's chunk size (Llama 4:
    each query sees only its own chunk, and a step may cross a chunk's end), `table_starts`
    each row's position of its table's first token (None: 0); sinks: [Hq]. run: what runs a
    Launch (run_launch: the GPU). memo: a dict the step's layers share, so that their small
    index arrays are built once per step (paged_cache.GroupTables.kernel_memo).
    """
    kernels = kernels or {}
    run = run or run_launch
    B, n_heads, n_queries, D = queries.shape
    starts = window_starts(context_lens, window, n_queries, chunk, table_starts)
    if n_queries > 1:
        tile = _tile(quantized_format(k_pool, D, queries.dtype))
        name, spans = "paged_decode_multi", [n - s + s % tile for n, s in zip(context_lens, starts)]
    else:
        name, spans, queries = "paged_decode", [n - s for n, s in zip(context_lens, starts)], queries.reshape(B, n_heads, D)
    if partition is None:
        partition = partition_size(B, k_pool.shape[1], max(spans))
    first = decode_launch(queries, k_pool, v_pool, block_tables, context_lens, scale, partition,
                          kernels.get(name), starts, sinks, window, chunk, memo)
    out, partials = run(first)
    if partials.ndim > 1:
        (out,) = run(reduce_launch(partials, queries.dtype, kernels.get("paged_reduce"), memo))
    return out.reshape(B, n_heads, n_queries, D)
