"""`mlxkv bench kernels` rows, at a size that runs in a second."""

from __future__ import annotations

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import pytest

from mlxkv.benchmarks.kernels import GOAL, format_rows, run_kernel_benchmark


def test_rows_pair_the_paged_path_with_contiguous_sdpa():
    rows = run_kernel_benchmark(contexts=(64, 100), batches=(1, 2), budget_s=0.01)
    assert [(r["context"], r["batch"], r["queries"]) for r in rows] == [
        (c, b, q) for c in (64, 100) for b in (1, 2) for q in (1, 4)]  # decode and verify steps
    expected_path = "kernel" if mx.metal.is_available() else "reference"
    for r in rows:
        assert r["path"] == expected_path
        assert r["paged_ms"] > 0 and r["sdpa_ms"] > 0
        assert r["ratio"] == pytest.approx(r["paged_ms"] / r["sdpa_ms"])
    table = format_rows(rows)
    assert "paged/sdpa" in table and f"{GOAL:.2f}x" in table


def test_the_mac_report_shows_kernel_rows_and_the_speed_gate():
    from mlxkv.benchmarks.report import markdown

    gate = [{"batch": 1, "context": 512, "kernel_ms": 0.2, "reference_ms": 0.1, "queries": 1, "path": "reference"},
            {"batch": 8, "context": 512, "kernel_ms": 0.3, "reference_ms": 0.6, "queries": 4, "path": "kernel"}]
    rows = [{"context": 1024, "batch": b, "queries": 1, "path": "kernel", "dtype": "float16", "paged_ms": ms, "sdpa_ms": 0.1,
             "ratio": ms / 0.1, "goal": GOAL} for b, ms in ((1, 0.105), (8, 0.125))]
    machine = {"chip": "Apple M3", "memory_gib": 16, "os": "macOS", "macos": "15.1", "mlx": "0.32", "mlx_lm": "0.32",
               "mlxkv": "0.1", "attention": {"path": "kernel", "check": None, "gate": gate, "why": "passed",
                                             "gate_source": "stored in /c/gate.json (timed 2026-12-07)"}}
    text = markdown({"date": "today", "machine": machine,
                     "suites": {"kernels": rows, "tiers": [], "engine": [], "memory": []}})
    assert "| 1024 | 8 | 1 | kernel | 0.125 | 0.100 | 1.250x | <= 1.1 |" in text
    assert "Worst kernel/SDPA ratio 1.250x: the goal (<= 1.1x) is NOT met." in text
    assert "| 1 | 1 | 512 | 0.200 | 0.100 | 2.000x | reference |" in text
    assert "| 4 | 8 | 512 | 0.300 | 0.600 | 0.500x | kernel |" in text
    assert "Choices stored in /c/gate.json (timed 2026-12-07)." in text
    machine["attention"] = {"path": "reference", "check": None, "gate": None, "why": "no Metal GPU"}
    assert "Not run: no Metal GPU." in markdown({"date": "today", "machine": machine,
                                                  "suites": {"kernels": [], "tiers": [], "engine": [], "memory": []}})


def test_the_mac_report_runs_the_kernel_sizes_the_issue_asks_for():
    """Issue 47: kernel against SDPA at 512, 4k, 16k and 32k tokens, batch 1 and 8, 1 and 4 queries."""
    from mlxkv.benchmarks.report import ReportSizes

    sizes = ReportSizes()
    assert sizes.kernel_contexts == (512, 4096, 16384, 32768)
    assert (sizes.kernel_batches, sizes.kernel_queries) == ((1, 8), (1, 4))
