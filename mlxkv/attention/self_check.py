"""The kernel path checks itself before it serves a decode.

Apple's compiler has never been shown the kernels by us, and a kernel that
is wrong on real hardware would break every decode. So before a model
decodes on the kernels, the instantiation it needs runs every path a
decode can take, on a small random case, against a float64 oracle:

- the single-pass store (one partition writes the output), and the
  partitioned path with its reduce, some partitions empty;
- rows of many tiles (a tile is one token per simdgroup), so that the
  online softmax rescales and the simdgroups merge;
- a sliding window that starts mid-block, and attention sinks; and the
  plain case, neither.

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

from mlxkv.attention import kernels

log = logging.getLogger(__name__)

# Unit roundoff of the output dtype; the kernels accumulate in fp32.
UNIT_ROUNDOFF = {mx.float32: 2.0 ** -24, mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8}
_FP32 = UNIT_ROUNDOFF[mx.float32]
_CONTEXT = (300, 21, 1)  # many tiles; ending mid-block; one token
_WINDOW = 277  # starts mid-block in the long row, covers the others
_PARTITION = 64  # the long row in 5 partitions of 8 tiles; the others leave 4 empty
_CALLS = (  # (what, partition, window and sinks)
    ("single pass", 0, True),
    ("partitioned", _PARTITION, True),
    ("partitioned, no window or sinks", _PARTITION, False),
)


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
    """Run the decode kernels of this shape on every path against the float64 oracle."""
    group = n_heads // n_kv_heads
    name = describe(dtype, head_dim, block_size, kernels.group_size_for(group) or group)
    try:
        case = _case(dtype, head_dim, block_size, n_heads, n_kv_heads)
        for what, partition, windowed in _CALLS:
            window, sinks = (_WINDOW, case["sinks"]) if windowed else (None, None)
            got = kernels.paged_decode(case["queries"], case["k_pool"], case["v_pool"], case["block_tables"],
                                       list(_CONTEXT), case["scale"], partition=partition, window=window,
                                       sinks=sinks, run=run)
            got = np.array(got.astype(mx.float32), np.float64)[:, :, 0]  # waits for the GPU
            problem = _compare(got, case, window, sinks, dtype)
            if problem:
                return KernelCheck(name, False, f"{what}: {problem}")
    except Exception as e:  # a compile or run failure: the reason goes to the warning
        return KernelCheck(name, False, failure(e))
    return KernelCheck(name, True)


def failure(e: Exception) -> str:
    """An exception as one line: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def _compare(got: np.ndarray, case: dict, window, sinks, dtype) -> str:
    """Why `got` [B, Hq, D] is not the oracle's answer within tolerance, or ""."""
    starts = kernels.window_starts(_CONTEXT, window)
    want, slack = oracle(case["queries"], case["k_pool"], case["v_pool"], case["tables"], _CONTEXT,
                         case["scale"], starts, sinks)
    allowed = tolerance(want, slack, dtype)
    excess = np.abs(got - want) - allowed
    if np.all(excess <= 0):  # NaN fails too
        return ""
    b, h, d = np.unravel_index(np.nanargmax(np.where(np.isnan(excess), np.inf, excess)), excess.shape)
    return (f"differs from the float64 oracle by {abs(got[b, h, d] - want[b, h, d]):.3g} "
            f"(tolerance {allowed[b, h, d]:.3g}) at row {b}, head {h}")


def tolerance(want: np.ndarray, slack: np.ndarray, dtype) -> np.ndarray:
    """Per element: the output rounded once to `dtype` (twice its unit roundoff, as the
    oracle's inputs were rounded too), plus fp32 accumulation over the row (`slack`)."""
    return 2 * UNIT_ROUNDOFF[dtype] * np.abs(want) + _FP32 * slack[..., None]


def oracle(queries, k_pool, v_pool, tables, context_lens, scale: float, starts, sinks=None):
    """Decode attention in float64 from the (rounded) inputs: the outputs [B, Hq, D] and
    each row's accumulation slack [B, Hq] (in units of the fp32 roundoff).

    Row b sees tokens starts[b] .. context_lens[b] - 1 of its table's blocks; a sink is
    one more logit per head, with no value. The slack bounds fp32 accumulation: 4 per
    token of the row and 4 per head-dim term of its largest |score|, times max |V|.
    """
    q, k, v = (np.array(x.astype(mx.float32), np.float64) for x in (queries, k_pool, v_pool))
    q = q.reshape(q.shape[0], q.shape[1], -1)
    sink = None if sinks is None else np.array(sinks.astype(mx.float32), np.float64)
    B, H, D = q.shape
    n_kv = k.shape[1]
    out, slack = np.zeros((B, H, D)), np.zeros((B, H))
    for b, (table, n, lo) in enumerate(zip(tables, context_lens, starts)):
        keys = k[table].transpose(1, 0, 2, 3).reshape(n_kv, -1, D)[:, lo:n]
        values = v[table].transpose(1, 0, 2, 3).reshape(n_kv, -1, D)[:, lo:n]
        for h in range(H):
            kv = h // (H // n_kv)
            terms = keys[kv] * (q[b, h] * scale)
            s = terms.sum(-1)
            top = s.max() if sink is None else max(s.max(), sink[h])
            p = np.exp(s - top)
            total = p.sum() + (0.0 if sink is None else np.exp(sink[h] - top))
            out[b, h] = p @ values[kv] / total
            slack[b, h] = np.abs(values[kv]).max() * 4 * (len(s) + D * np.abs(terms).sum(-1).max())
    return out, slack


def _case(dtype, head_dim: int, block_size: int, n_heads: int, n_kv_heads: int) -> dict:
    """Rows over shuffled blocks, random queries, K, V and sinks, from numpy (no GPU work)."""
    rng = np.random.default_rng(1)
    needs = [-(-n // block_size) for n in _CONTEXT]
    n_blocks = sum(needs) + 1
    order = [int(i) for i in rng.permutation(n_blocks)]
    tables, at = [], 0
    for need in needs:
        tables.append(order[at : at + need])
        at += need
    width = kernels.table_width(len(tables), max(needs))

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    shape = (n_blocks, n_kv_heads, block_size, head_dim)
    return {
        "queries": normal(len(_CONTEXT), n_heads, 1, head_dim),
        "k_pool": normal(*shape),
        "v_pool": normal(*shape),
        "sinks": normal(n_heads) * 2,  # the scores' own size: they weigh in without swamping them
        "tables": tables,
        "block_tables": mx.array([t + [t[0]] * (width - len(t)) for t in tables], dtype=mx.int32),
        "scale": head_dim ** -0.5,
    }
