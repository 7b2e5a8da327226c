"""`mlxkv bench distributed`: one model split over 2 ranks on loopback, against one process.

Side by side in one run, on a tiny llama written for the bench (tensor
parallel needs its heads to split; the demo model's 9 do not): the same
prompt, greedy, once in this process and once on two ranks over MLX's ring
back-end on 127.0.0.1 (distributed_rank.py). The rows:

- greedy tokens identical;
- the plan's collective, as a share of the time in steps (goal <= 5%): the
  collective itself, not rank 0's wait for a rank still in the step before
  (channel.py tells them apart; the note gives the wait);
- bytes the model all-reduces per token, against 2 x layers x hidden x
  dtype (two all-reduces per layer: attention's output and the MLP's);
- decode tokens per second, 2 ranks against 1. Two ranks on one CPU
  share its cores and add loopback round trips: no speedup to show here;
  on two Macs the same row is the one to read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mlxkv.benchmarks.rows import format_rows, row  # noqa: F401  (format_rows: the suite's printer)
from mlxkv.distributed.loopback import loopback_hostfile
from mlxkv.errors import MlxkvError

PROMPT_TOKENS, DECODE_TOKENS = 256, 64
PLAN_SHARE_GOAL = 0.05
RANK_TIMEOUT_S = 300


def bench_model(root: Path) -> Path:
    from mlxkv.models.tiny import TinyModelSpec, write_tiny_model

    return write_tiny_model(root / "llama", TinyModelSpec(family="llama", num_layers=4, hidden_size=256, num_heads=8,
                                                          num_kv_heads=4, vocab_size=1024, seed=7))


def prompt() -> list[int]:
    return [3 + (i * 37) % 1000 for i in range(PROMPT_TOKENS)]


def run_distributed_benchmark() -> list[dict]:
    from mlxkv.benchmarks.distributed_rank import measure

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = bench_model(root)
        one = measure(str(model), None)
        two = _two_ranks(root, model)
    return _rows(one, two)


def _two_ranks(root: Path, model: Path) -> dict:
    hostfile = loopback_hostfile(root / "hosts.json", 2)
    procs = [subprocess.Popen([sys.executable, "-m", "mlxkv.benchmarks.distributed_rank", str(model)],
                              env=dict(os.environ, MLX_HOSTFILE=str(hostfile), MLX_RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outs = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise MlxkvError(f"bench distributed: rank {rank} did not finish in {RANK_TIMEOUT_S} s") from None
        if proc.returncode != 0:
            raise MlxkvError(f"bench distributed: rank {rank} failed: {err.strip().splitlines()[-1:]}")
        outs.append(out)
    return json.loads(outs[0].strip().splitlines()[-1])


def _rows(one: dict, two: dict) -> list[dict]:
    model = two["model"]
    same = two["tokens"] == one["tokens"]
    collective_s = two["plan_s"] - two["plan_wait_s"]
    share = collective_s / two["step_s"] if two["step_s"] else float("nan")
    expected = 2 * two["layers"] * two["hidden"] * two["dtype_bytes"]
    return [
        row("greedy tokens, 2 ranks", "tokens equal", float(same), 1.0, "1 process", "identical", same,
            note=f"{len(two['tokens'])} tokens", model=model),
        row("plan collective / step time", "share", share, PLAN_SHARE_GOAL, "goal", f"<= {PLAN_SHARE_GOAL:.0%}",
            share <= PLAN_SHARE_GOAL, note=f"{two['plan_collectives']} collectives ({two['plan_exchanges']} plans, "
            f"{two['plan_bytes'] / max(two['plan_collectives'], 1):.0f} B each on average) over {two['steps']} steps; "
            f"{collective_s * 1000:.1f} ms in them, and {two['plan_wait_s'] * 1000:.1f} ms waiting for rank 1, "
            f"of {two['step_s'] * 1000:.1f} ms in steps", model=model),
        row("all-reduced bytes per token", "bytes", two["allreduce_bytes_per_token"], expected,
            "2 x layers x hidden x dtype", "= expected", abs(two["allreduce_bytes_per_token"] - expected) < 1,
            note="per token forwarded (the prompt's and each decode step's)",
            model=model),
        row("decode tok/s, 2 ranks vs 1", "tok/s", two["decode_tps"], one["decode_tps"], "1 process",
            "none on 1 CPU", True, note="both ranks share this machine's cores: no speedup to show here",
            model=model),
    ]
