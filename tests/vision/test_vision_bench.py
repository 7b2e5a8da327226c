"""`mlxkv bench vision` runs and reports its three ratios (no speed asserted)."""

import math

import pytest

from mlxkv.benchmarks import SUITES
from mlxkv.benchmarks.vision import run_vision_benchmark

pytestmark = pytest.mark.slow  # writes a model, runs two engines


def test_the_vision_bench_reports_each_case_against_its_cold_run():
    rows = run_vision_benchmark(rounds=1, image_size=56, hidden=64, layers=1, log=lambda message: None)
    assert [r["name"] for r in rows] == ["second turn, warm", "new conversation, image from the encoder cache",
                                         "second turn after a restart (SSD tier)"]
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 and r["baseline_name"] == "cold" for r in rows)
    assert "vision" in SUITES
