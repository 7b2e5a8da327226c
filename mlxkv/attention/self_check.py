"""The kernel path checks itself before it serves a decode.

Apple's compiler has never been shown the kernels by us, and a kernel that
is wrong on real hardware would break every decode. So before a model
decodes on the kernels, the instantiation it needs runs every path a
decode can take, on a small random case, against a float64 oracle:

- the single-pass store (one partition writes the output), and the
  partitioned path with its reduce, some partitions empty;
- rows of many tiles (a tile is one token per simdgroup), so that the
  online softmax rescales and the simdgroups merge;
- a sliding window that starts mid-block, and attention sinks; chunked
  attention (Llama 4) with a chunk boundary inside the step of several
  queries; and the plain case, none of these;
- one query token per row, and several (a speculative verify step): one
  query count for each multi-query instantiation the model can use;
- a quantized pool's format, when the model's pool is quantized.

The tolerance is what rounding allows for the dtype and the row: the output
rounded once to the dtype, plus fp32 accumulation over the row's tokens and
head dim (`tolerance`). A dropped or doubled token is far outside it.

A compile error, a run error (every GPU call and wait is inside the `try`:
MLX raises a command-buffer fault at the next wait) or a mismatch sends the
model to the reference path, with one warning line that says why; a
request never fails for it. The runner is a parameter, so tests here make
it fail or lie.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

from mlxkv.attention import kernels, oracle
from mlxkv.cache.kv_format import FULL, KVFormat

log = logging.getLogger(__name__)

# Unit roundoff of the output dtype; the kernels accumulate in fp32.
UNIT_ROUNDOFF = {mx.float32: 2.0 ** -24, mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8}
_FP32 = UNIT_ROUNDOFF[mx.float32]
_CONTEXT = (300, 21, 1)  # many tiles; ending mid-block; one token
_WINDOW = 277  # starts mid-block in the long row, covers the others
# Several queries: as above, shorter (two partitions, and a third empty in the short rows),
# the last row all new tokens; the window starts mid-tile for each query count.
_MULTI_CONTEXT = (130, 21)
_MULTI_WINDOW = 100
_PARTITION = 64  # the long row in 5 partitions of 8 tiles; the others leave 4 empty
# Chunks of 43: position 129 starts one, so the long multi-query row's step (its last 2 to 8
# tokens) crosses a boundary whatever its query count; the long one-query row starts mid-block.
_CHUNK = 43
# KV heads the check runs: the instantiation does not depend on the model's count (it is the
# grid's second axis), and two still show a head's offsets into the pool, queries and output.
# A model's eight (Llama-3-8B) would cost the check four times the work for nothing more.
_KV_HEADS = 2
_CALLS = (  # (what, partition, the visibility rule: window and sinks, chunks, or neither)
    ("single pass", 0, "window"),
    ("partitioned", _PARTITION, "window"),
    ("partitioned, no window or sinks", _PARTITION, None),
    ("chunk boundary", _PARTITION, "chunk"),
)


@dataclass(frozen=True)
class KernelCheck:
    """What the check found: `ok`, or why not."""

    instantiation: str
    ok: bool
    reason: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def describe(dtype, head_dim: int, block_size: int, group: int, kv: KVFormat = FULL) -> str:
    pool = f", {kv.bits}-bit pool in groups of {kv.group_size}" if kv.quantized else ""
    return f"{str(dtype).removeprefix('mlx.core.')}, head dim {head_dim}, block {block_size}, group {group}{pool}"


def query_counts(group: int) -> list[int]:
    """1, and for each multi-query instantiation a model of `group` query heads per kv head
    can use, the fewest query tokens it serves (the most simdgroups sharing each tile)."""
    counts = {}
    for n in range(kernels.MAX_QUERIES, 1, -1):
        counts[kernels.rows_per_simdgroup(group, n)] = n
    return [1] + sorted(counts.values())


def check_kernels(dtype, head_dim: int, block_size: int, n_heads: int, n_kv_heads: int, run=None,
                  kv: KVFormat = FULL) -> KernelCheck:
    """Run the kernels of this shape (and pool format) on every path against the float64 oracle."""
    group = n_heads // n_kv_heads
    name = describe(dtype, head_dim, block_size, kernels.group_size_for(group) or group, kv)
    try:
        kv_heads = min(n_kv_heads, _KV_HEADS)
        case = _case(dtype, head_dim, block_size, group * kv_heads, kv_heads, kv)
        for n_queries in query_counts(group):
            for what, partition, rule in _CALLS:
                problem = _check_call(case, n_queries, partition, rule, dtype, run)
                if problem:
                    queries = f"{n_queries} queries per row, " if n_queries > 1 else ""
                    return KernelCheck(name, False, f"{queries}{what}: {problem}")
    except Exception as e:  # a compile or run failure: the reason goes to the warning
        return KernelCheck(name, False, failure(e))
    return KernelCheck(name, True)


def _check_call(case: dict, n_queries: int, partition: int, rule: str | None, dtype, run) -> str:
    """Why one call of the kernels is off the oracle, or ""."""
    multi = n_queries > 1
    window, sinks = ((_MULTI_WINDOW if multi else _WINDOW), case["sinks"]) if rule == "window" else (None, None)
    chunk = _CHUNK if rule == "chunk" else None
    contexts = [*_MULTI_CONTEXT, n_queries] if multi else list(_CONTEXT)
    queries = case["queries"][:, :, :n_queries]
    got = kernels.paged_decode(queries, case["k_pool"], case["v_pool"], case["block_tables"], contexts,
                               case["scale"], partition=partition, window=window, sinks=sinks, run=run,
                               chunk=chunk)
    got = np.array(got.astype(mx.float32), np.float64)  # waits for the GPU
    want, slack = oracle.attention(queries, case["k_pool"], case["v_pool"], case["tables"], contexts,
                                   case["scale"], window, sinks, chunk)
    return _compare(got, want, slack, dtype)


def failure(e: Exception) -> str:
    """An exception as one line: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def _compare(got: np.ndarray, want: np.ndarray, slack: np.ndarray, dtype) -> str:
    """Why `got` [B, Hq, L, D] is not the oracle's answer `want` within tolerance, or ""."""
    allowed = tolerance(want, slack, dtype)
    excess = np.abs(got - want) - allowed
    if np.all(excess <= 0):  # NaN fails too
        return ""
    at = np.unravel_index(np.nanargmax(np.where(np.isnan(excess), np.inf, excess)), excess.shape)
    b, h, j = at[:3]
    query = f", query {j}" if got.shape[2] > 1 else ""
    return (f"differs from the float64 oracle by {abs(got[at] - want[at]):.3g} "
            f"(tolerance {allowed[at]:.3g}) at row {b}, head {h}{query}")


def tolerance(want: np.ndarray, slack: np.ndarray, dtype) -> np.ndarray:
    """Per element: the output rounded once to `dtype` (twice its unit roundoff, as the
    oracle's inputs were rounded too), plus fp32 accumulation over the row (`slack`)."""
    return 2 * UNIT_ROUNDOFF[dtype] * np.abs(want) + _FP32 * slack[..., None]


def _case(dtype, head_dim: int, block_size: int, n_heads: int, n_kv_heads: int, kv: KVFormat = FULL) -> dict:
    """Rows over shuffled blocks, random queries, K, V and sinks, from numpy (no GPU work but
    a quantized pool's `mx.quantize`)."""
    rng = np.random.default_rng(1)
    needs = [-(-max(n, kernels.MAX_QUERIES) // block_size) for n in _CONTEXT]  # hold the multi contexts too
    n_blocks = sum(needs) + 1
    order = [int(i) for i in rng.permutation(n_blocks)]
    tables, at = [], 0
    for need in needs:
        tables.append(order[at : at + need])
        at += need
    width = kernels.table_width(len(tables), max(needs))

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    def pool():
        pages = normal(n_blocks, n_kv_heads, block_size, head_dim)
        return kv.page(pages)

    return {
        "queries": normal(len(_CONTEXT), n_heads, kernels.MAX_QUERIES, head_dim),
        "k_pool": pool(),
        "v_pool": pool(),
        "sinks": normal(n_heads) * 2,  # the scores' own size: they weigh in without swamping them
        "tables": tables,
        "block_tables": mx.array([t + [t[0]] * (width - len(t)) for t in tables], dtype=mx.int32),
        "scale": head_dim ** -0.5,
    }
