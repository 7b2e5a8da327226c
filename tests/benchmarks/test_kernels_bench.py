"""`mlxkv bench kernels` rows, at a size that runs in a second."""

from __future__ import annotations

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import pytest

from mlxkv.benchmarks.kernels import GOAL, format_rows, run_kernel_benchmark


def test_rows_pair_the_paged_path_with_contiguous_sdpa():
    rows = run_kernel_benchmark(contexts=(64, 100), batches=(1, 2), budget_s=0.01)
    assert [(r["context"], r["batch"]) for r in rows] == [(64, 1), (64, 2), (100, 1), (100, 2)]
    expected_path = "kernel" if mx.metal.is_available() else "reference"
    for r in rows:
        assert r["path"] == expected_path
        assert r["paged_ms"] > 0 and r["sdpa_ms"] > 0
        assert r["ratio"] == pytest.approx(r["paged_ms"] / r["sdpa_ms"])
    table = format_rows(rows)
    assert "paged/sdpa" in table and f"{GOAL:.2f}x" in table
