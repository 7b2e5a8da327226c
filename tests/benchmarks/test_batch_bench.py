"""`mlxkv bench batch` runs end to end on a tiny model and reports every row."""

from __future__ import annotations

import pytest

from mlxkv.benchmarks.batch import run_batch_benchmark
from mlxkv.benchmarks.rows import format_rows
from mlxkv.errors import MlxkvError


def test_batch_bench_rows(llama_dir):
    rows = run_batch_benchmark(prefix=32, decode_tokens=4, model=llama_dir, log=lambda m: None)
    names = [r["name"] for r in rows]
    assert names[:4] == ["decode x1", "decode x4", "decode x8", "decode x16"]
    kv = next(r for r in rows if r["name"].startswith("KV bytes"))
    assert kv["met"]  # a shared prefix held once is never more than a padded batch cache
    assert "greedy tokens equal for 16/16" in next(r for r in rows if r["name"].startswith("aggregate"))["note"]
    assert "sequences in 1 GiB" in format_rows(rows)


def test_a_prefix_longer_than_the_context_is_refused_before_the_pool_is_sized(llama_dir):
    # It used to ask for a pool of 12,207 GiB and name flags this command does not have.
    with pytest.raises(MlxkvError, match="--prefix 100000000 plus new tokens exceeds the model's context of"):
        run_batch_benchmark(prefix=100_000_000, decode_tokens=4, model=llama_dir, log=lambda m: None)
