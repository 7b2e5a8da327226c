"""`mlxkv bench memory`'s quantized-pool rows at a tiny size: well formed, and right where
they are exact. No speed is asserted."""

from __future__ import annotations

import math

import pytest

from mlxkv import cli
from mlxkv.benchmarks.kv_formats import FormatSizes
from mlxkv.benchmarks.memory import run_memory_benchmark
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model

pytestmark = pytest.mark.slow  # two models through every row, both formats
TINY = FormatSizes(peak_context=96, decode_contexts=(80,), decode_tokens=4, rounds=1, restore_tokens=64,
                   text_tokens=96, reply_tokens=8)


def test_the_quantized_rows_at_a_tiny_size(tmp_path):
    model = str(write_tiny_model(tmp_path / "bench", TinyModelSpec(head_dim=64, seed=5)))
    rows = run_memory_benchmark(model, lambda *_: None, TINY, quality_model=model)
    names = [r["name"] for r in rows]
    assert names == ["peak memory, 64 + 32 tok, default config"] + [name for fmt in ("q8g64", "q4g64") for name in (
        f"KV bytes/token, {fmt} / float16", f"4096-tok sequences in a 1 GiB pool, {fmt}")] + [
        name for fmt in ("q8g64", "q4g64") for name in (
            f"peak memory, 96 ctx + 4 tok, {fmt}", f"decode @ 80 ctx, {fmt}", f"warm TTFT, 64-tok prefix from SSD, {fmt}")
    ] + [name for fmt in ("q8g64", "q4g64") for name in (
        f"perplexity, 96 tok of text, {fmt}", f"greedy agreement, {fmt}")]
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0 and r["model"], r
    # exact, whatever the model: the format's bytes, and the pool sizing
    assert by_name["KV bytes/token, q8g64 / float16"]["ratio"] == 17 / 32
    assert by_name["KV bytes/token, q4g64 / float16"]["ratio"] == 9 / 32
    assert by_name["4096-tok sequences in a 1 GiB pool, q4g64"]["ratio"] > 3.5
    # both sides quantize from the first token: mlx-lm is the oracle
    assert by_name["decode @ 80 ctx, q8g64"]["tokens_identical"]
    restore = by_name["warm TTFT, 64-tok prefix from SSD, q4g64"]
    assert restore["hydrated_tokens"] == 64 and restore["file_bytes"] < restore["baseline_file_bytes"] / 3
    agreement = by_name["greedy agreement, q8g64"]
    assert agreement["positions"] == 4 * 8 and 0 <= agreement["ours"] <= 1


def test_quick_is_a_flag_of_the_memory_suite(capsys):
    assert cli.main(["bench", "engine", "--quick"]) == 2
    assert capsys.readouterr().err.strip() == "mlxkv: error: --quick is a flag of `mlxkv bench memory`"
