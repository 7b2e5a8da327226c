"""`mlxkv bench kernels`: paged decode attention beside SDPA on a contiguous cache.

For each context and batch size, one decode step's attention of one layer:

- paged: decode attention as the engine runs it, from the block pool
  through shuffled block tables (attention/speed_gate.py's DecodeCase).
  With Metal that is the paged kernels; on other machines it is the
  reference path (gather the blocks into a contiguous copy, then SDPA), so
  there the figure measures the gather. (The engine spares a lone sequence
  that gather with its contiguous mirror, mirror.py; at batch 1 the
  figure is an upper bound.)
- sdpa: `mx.fast.scaled_dot_product_attention` over the same K/V already
  laid out contiguously, as mlx-lm's own cache holds them.

The ratio is paged time over sdpa time, both measured side by side in the
same run, rounds alternated. The goal for the kernel path on Apple GPUs is
a ratio of at most GOAL. It reports; it asserts nothing.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxkv.attention.dispatch import resolve_attention
from mlxkv.attention.speed_gate import AttentionShape, DecodeCase, alternate

CONTEXTS = (512, 4096, 16384, 32768)
BATCHES = (1, 8)
QUERIES = (1, 4)  # a decode step; a verify step of 3 proposals (another kernel)
GOAL = 1.10  # paged over contiguous, kernel path on Apple GPUs
# Attention shaped like Llama 3 8B: 32 query heads over 8 KV heads, head dim 128.
N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK_SIZE = 16
BUDGET_S = 0.6  # per case and side, split over the rounds


def run_kernel_benchmark(contexts=CONTEXTS, batches=BATCHES, budget_s: float = BUDGET_S,
                         dtype=None, attention: str = "auto", seed: int = 0, queries=QUERIES) -> list[dict]:
    """Rows of {context, batch, queries, path, dtype, paged_ms, sdpa_ms, ratio, goal}: per query
    count (new tokens per row; several: under the causal rule among them, as a verify step).

    dtype: float16 with Metal, else float32 (the CPU back-end emulates fp16
    arithmetic, which would measure the emulation).
    """
    path = resolve_attention(attention)
    dtype = dtype or (mx.float16 if mx.metal.is_available() else mx.float32)
    shape = AttentionShape(dtype, HEAD_DIM, BLOCK_SIZE, N_HEADS, N_KV_HEADS)
    rng = np.random.default_rng(seed)
    rows = []
    for context, batch, n_queries in ((c, b, q) for c in contexts for b in batches for q in queries):
        case = DecodeCase(shape, context, batch, rng, queries=n_queries)
        mx.eval(*case.inputs(contiguous=True))
        paged_s, sdpa_s = alternate(case.paged(path), case.contiguous, budget_s)
        rows.append({
            "context": context,
            "batch": batch,
            "queries": n_queries,
            "path": path,
            "dtype": str(dtype).removeprefix("mlx.core."),
            "paged_ms": paged_s * 1e3,
            "sdpa_ms": sdpa_s * 1e3,
            "ratio": paged_s / sdpa_s,
            "goal": GOAL if path == "kernel" else None,
        })
        del case
    return rows


def format_rows(rows: list[dict]) -> str:
    """A plain-text table and what the ratio is measured against."""
    header = ("context", "batch", "queries", "path", "dtype", "paged ms", "sdpa ms", "paged/sdpa")
    table = [header] + [
        (str(r["context"]), str(r["batch"]), str(r.get("queries", 1)), r["path"], r["dtype"], f"{r['paged_ms']:.3f}",
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
