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

Given a hostfile (`--hostfile`, in `bench distributed` and `bench mac`), the
two ranks are the set it names, started by `mlx.launch` with mlxkv at the
same path on every machine; each rank writes the bench model itself (the
same bytes from the same seed), and the one-process run is this machine's.
"""

from __future__ import annotations

import json
import os
import shutil
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


def run_distributed_benchmark(hostfile: str | None = None, backend: str = "ring") -> list[dict]:
    """The rows: 2 ranks on loopback, or the set `hostfile` names (through mlx.launch)."""
    from mlxkv.benchmarks.distributed_rank import measure

    if hostfile is not None and not Path(hostfile).is_file():
        raise MlxkvError(f"bench distributed: no hostfile {hostfile}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = bench_model(root)
        one = measure(str(model), None)
        two = _launched(Path(hostfile), backend) if hostfile else _two_ranks(root, model)
    return _rows(one, two, shared_cpu=hostfile is None)


def _two_ranks(root: Path, model: Path) -> dict:
    hostfile = loopback_hostfile(root / "hosts.json", 2)
    procs = [subprocess.Popen(_rank_command("ring", model),
                              env=dict(os.environ, MLX_HOSTFILE=str(hostfile), MLX_RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outs = [_finished(proc, f"rank {rank}", procs) for rank, proc in enumerate(procs)]
    return _record(outs[0])


def _launched(hostfile: Path, backend: str) -> dict:
    """Rank 0's record from the set `hostfile` names, every rank started by mlx.launch."""
    launcher = shutil.which("mlx.launch", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if launcher is None:
        raise MlxkvError("bench distributed: mlx.launch is not installed beside this Python")
    proc = subprocess.Popen([launcher, "--hostfile", str(hostfile), "--backend", backend, "--",
                             *_rank_command(backend, None)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return _record(_finished(proc, f"mlx.launch --hostfile {hostfile}", [proc]))


def _rank_command(backend: str, model: Path | None) -> list[str]:
    """One rank of the bench; without `model` the rank writes the bench model itself (a remote Mac)."""
    return [sys.executable, "-m", "mlxkv.benchmarks.distributed_rank", backend, *([str(model)] if model else [])]


def _finished(proc: subprocess.Popen, what: str, procs: list[subprocess.Popen]) -> str:
    try:
        out, err = proc.communicate(timeout=RANK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise MlxkvError(f"bench distributed: {what} did not finish in {RANK_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        raise MlxkvError(f"bench distributed: {what} failed: {err.strip().splitlines()[-1:]}")
    return out


def _record(out: str) -> dict:
    """Rank 0's record: the last line of its output that is one (mlx.launch may print more)."""
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise MlxkvError("bench distributed: rank 0 printed no record")


def _rows(one: dict, two: dict, shared_cpu: bool = True) -> list[dict]:
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
            "none on 1 CPU" if shared_cpu else "-", True,
            note="both ranks share this machine's cores: no speedup to show here" if shared_cpu
            else "two machines: a tiny model, so this is the link's cost per step, not a model's speedup",
            model=model),
    ]
