"""Start N ranks of a script over MLX's ring back-end on 127.0.0.1, as a user would with
MLX_HOSTFILE and MLX_RANK: ports are asked of the OS (unique per test worker), every
rank has a deadline, and a rank that hangs dumps its stacks before it is killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from mlxkv.distributed.loopback import loopback_hostfile


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str

    def records(self) -> list[dict]:
        """The JSON lines the rank printed."""
        return [json.loads(line) for line in self.stdout.splitlines() if line.startswith("{")]


def run_ranks(script: Path, tmp_path: Path, n: int = 2, timeout: float = 60, args: tuple = ()) -> list[RankResult]:
    hostfile = loopback_hostfile(tmp_path / "hosts.json", n)
    procs = []
    for rank in range(n):
        env = dict(os.environ, MLX_HOSTFILE=str(hostfile), MLX_RANK=str(rank),
                   PYTHONFAULTHANDLER="1", RANK_DEADLINE=str(timeout - 5))
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += f"\n[rank {rank} killed after {timeout}s]"
        results.append(RankResult(rank, proc.returncode, out, err))
    return results


def rank_preamble() -> None:
    """Called first by a rank script: a hang dumps every thread's stack before the test's kill."""
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("RANK_DEADLINE", "55")), exit=True)
