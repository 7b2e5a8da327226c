"""One measurement of `mlxkv bench distributed` (distributed.py): the bench model, greedy, in
this process (`kind` None) or as one rank of a set (`python -m mlxkv.benchmarks.distributed_rank
BACKEND [MODEL]`, started with MLX_HOSTFILE and MLX_RANK; rank 0 prints the record, the others
follow). Without MODEL the rank writes the bench model itself, as on another machine."""

from __future__ import annotations

import json
import sys
import time

import mlx.core as mx

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine

CACHE = dict(block_size=16, num_blocks=256, memory_tier_bytes=0, disk_tier=None)


class AllSumBytes:
    """Counts the bytes every `mx.distributed.all_sum` of this process is given (the model's
    sharded layers call it by that name), for as long as it is installed: a bench's probe."""

    def __init__(self):
        self.nbytes = 0
        self._real = mx.distributed.all_sum

    def __enter__(self):
        def counted(x, *args, **kwargs):
            self.nbytes += x.nbytes
            return self._real(x, *args, **kwargs)

        mx.distributed.all_sum = counted
        return self

    def __exit__(self, *exc):
        mx.distributed.all_sum = self._real


def measure(model: str, kind: str | None, backend: str = "ring") -> dict | None:
    """The record of one greedy generation; None on a rank other than 0."""
    from mlxkv.benchmarks.distributed import DECODE_TOKENS, prompt

    with AllSumBytes() as probe:
        engine = Engine.load(model, CacheConfig(**CACHE), distributed=kind, backend=backend) if kind \
            else Engine.load(model, CacheConfig(**CACHE))
        core = engine.core
        if kind and not core.channel.cluster.leader:
            core.follow()
            return None
        engine.generate([5, 6, 7, 8], max_tokens=4)  # warm-up: first-call costs out of the timing
        before, summed = _counters(engine), probe.nbytes
        began = time.perf_counter()
        result = engine.generate(prompt(), max_tokens=DECODE_TOKENS, seed=0)
        seconds = time.perf_counter() - began
        after, summed = _counters(engine), probe.nbytes - summed
        engine.close()
    delta = {k: after[k] - before[k] for k in after}
    config, dtype_bytes = engine.loaded.config, engine.kv_layout.dtype.size
    tokens = len(prompt()) + len(result.tokens) - 1  # forwarded: the last token is sampled, never fed back
    return {"model": f"llama {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
                     f"{config['num_attention_heads']} heads",
            "tokens": result.tokens, "decode_tps": result.stats.decode_tokens_per_s, "seconds": seconds,
            "layers": config["num_hidden_layers"], "hidden": config["hidden_size"], "dtype_bytes": dtype_bytes,
            "allreduce_bytes_per_token": summed / tokens, **delta}  # the plan channel gathers, never sums


def _counters(engine) -> dict:
    stats = engine.stats().get("distributed")
    if stats is None:
        return {}
    return {k: stats[k] for k in ("steps", "step_s", "plan_s", "plan_wait_s", "plan_exchanges", "plan_collectives",
                                  "plan_bytes")}


if __name__ == "__main__":
    import mlxkv  # noqa: F401  (before mlx's first use: the BLAS choice)

    import tempfile
    from pathlib import Path

    from mlxkv.benchmarks.distributed import bench_model

    with tempfile.TemporaryDirectory() as tmp:
        model = sys.argv[2] if len(sys.argv) > 2 else str(bench_model(Path(tmp)))
        record = measure(model, "tensor", sys.argv[1])
    if record is not None:
        print(json.dumps(record), flush=True)
