"""`mlxkv bench kernels`: paged decode attention beside SDPA on a contiguous cache.

For each context and batch size, one decode step's attention of one layer:

- paged: `paged_attention` as the engine calls it, from the block pool
  through shuffled block tables. With Metal that is the paged kernel; on
  other machines it is the reference path (gather the blocks into a
  contiguous copy, then SDPA), so there the figure measures the gather.
  (The engine spares a lone sequence that gather with its contiguous
  mirror, mirror.py; at batch 1 the figure is an upper bound.)
- sdpa: `mx.fast.scaled_dot_product_attention` over the same K/V already
  laid out contiguously, as mlx-lm's own cache holds them.

The ratio is paged time over sdpa time, both measured side by side in the
same run, rounds alternated. The goal for the kernel path on Apple GPUs is
a ratio of at most GOAL. It reports; it asserts nothing.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

from mlxkv.attention.dispatch import paged_attention, resolve_attention
from mlxkv.cache.kv_pool import KVLayout, KVPool
from mlxkv.attention.paged_cache import PagedBatch, PagedKVCache

CONTEXTS = (1024, 4096, 16384)
BATCHES = (1, 8)
GOAL = 1.10  # paged over contiguous, kernel path on Apple GPUs
# Attention shaped like Llama 3 8B: 32 query heads over 8 KV heads, head dim 128.
N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK_SIZE = 16
ROUNDS = 3
BUDGET_S = 0.6  # per case and side, split over the rounds


def run_kernel_benchmark(contexts=CONTEXTS, batches=BATCHES, budget_s: float = BUDGET_S,
                         dtype=None, attention: str = "auto", seed: int = 0) -> list[dict]:
    """Rows of {context, batch, path, dtype, paged_ms, sdpa_ms, ratio, goal}.

    dtype: float16 with Metal, else float32 (the CPU back-end emulates fp16
    arithmetic, which would measure the emulation).
    """
    path = resolve_attention(attention)
    dtype = dtype or (mx.float16 if mx.metal.is_available() else mx.float32)
    rng = np.random.default_rng(seed)
    rows = []
    for context in contexts:
        for batch in batches:
            paged, sdpa = _case(context, batch, dtype, path, rng)
            paged_s, sdpa_s = _alternate(paged, sdpa, budget_s)
            rows.append({
                "context": context,
                "batch": batch,
                "path": path,
                "dtype": str(dtype).removeprefix("mlx.core."),
                "paged_ms": paged_s * 1e3,
                "sdpa_ms": sdpa_s * 1e3,
                "ratio": paged_s / sdpa_s,
                "goal": GOAL if path == "kernel" else None,
            })
            del paged, sdpa
    return rows


def _case(context: int, batch: int, dtype, path: str, rng):
    """The two timed callables for one case, their inputs evaluated."""
    per_seq = -(-context // BLOCK_SIZE)
    n_blocks = per_seq * batch
    layout = KVLayout(1, N_KV_HEADS, HEAD_DIM, HEAD_DIM, BLOCK_SIZE, dtype)
    pool = KVPool(layout, n_blocks)
    shape = (n_blocks, N_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    pool.keys[0] = mx.random.normal(shape).astype(dtype)
    pool.values[0] = mx.random.normal(shape).astype(dtype)
    order = rng.permutation(n_blocks)
    tables = [[int(b) for b in order[i * per_seq:(i + 1) * per_seq]] for i in range(batch)]
    step = PagedBatch.build(tables, [context - 1] * batch, 1, BLOCK_SIZE, path)
    cache = PagedKVCache(pool, 0, step)
    queries = mx.random.normal((batch, N_HEADS, 1, HEAD_DIM)).astype(dtype)
    scale = HEAD_DIM ** -0.5
    mask = cache.make_mask(1)
    length = context if batch == 1 else None
    keys, values = (mx.contiguous(x[:, :, :context]) for x in pool.gather(0, step.block_tables))
    mx.eval(pool.keys, pool.values, queries, keys, values, mask if mask is not None else [])

    def paged():
        # What update_and_fetch hands attention; the kernel path leaves it unevaluated.
        k, v = pool.gather(0, step.block_tables, length)
        return paged_attention(queries, k, v, cache, scale, mask)

    def sdpa():
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)

    return paged, sdpa


def _alternate(a, b, budget_s: float) -> tuple[float, float]:
    """Median seconds per call of a() and b(), rounds alternated (AB BA AB)."""
    mx.eval(a())
    mx.eval(b())  # warm-up: kernels compiled, buffers allocated
    times = {a: [], b: []}
    for r in range(ROUNDS):
        for fn in ((a, b) if r % 2 == 0 else (b, a)):
            times[fn].append(_per_call(fn, budget_s / ROUNDS))
    return statistics.median(times[a]), statistics.median(times[b])


def _per_call(fn, budget_s: float) -> float:
    calls, start = 0, time.perf_counter()
    while True:
        mx.eval(fn())
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s:
            return elapsed / calls


def format_rows(rows: list[dict]) -> str:
    """A plain-text table and what the ratio is measured against."""
    header = ("context", "batch", "path", "dtype", "paged ms", "sdpa ms", "paged/sdpa")
    table = [header] + [
        (str(r["context"]), str(r["batch"]), r["path"], r["dtype"], f"{r['paged_ms']:.3f}",
         f"{r['sdpa_ms']:.3f}", f"{r['ratio']:.2f}x")
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    if rows and rows[0]["path"] == "kernel":
        worst = max(r["ratio"] for r in rows)
        verdict = "met" if worst <= GOAL else "not met"
        lines.append(f"goal: paged/sdpa <= {GOAL:.2f}x on Apple GPUs: {verdict} (worst {worst:.2f}x)")
    else:
        lines.append(f"reference path (no Metal): the ratio is the cost of the gather; "
                     f"the kernel goal (<= {GOAL:.2f}x) needs a Mac")
    return "\n".join(lines)
