"""Joining the set of ranks that serve one model.

Every rank runs the same command. It is started either by `mlx.launch`
(which sets the rank and hostfile for each process) or by hand with
`MLX_HOSTFILE` and `MLX_RANK`. mlxkv adds no transport of its own: the
group is MLX's, over its ring (TCP) or JACCL (Thunderbolt RDMA) back-end.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from mlxkv.errors import MlxkvError, first_line

BACKENDS = ("ring", "jaccl", "any")

# What mlx.launch or a user sets for each process: without one of them, a
# distributed start would silently become a set of one.
_LAUNCH_ENV = ("MLX_HOSTFILE", "MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR")


@dataclass(frozen=True)
class Cluster:
    """This process's place in the set: `group` is None for a single process."""

    rank: int
    size: int
    group: object | None = None

    @property
    def leader(self) -> bool:
        """Rank 0 decides every step and is the only one to bind the HTTP port."""
        return self.rank == 0

    def describe(self) -> str:
        return f"rank {self.rank} of {self.size}"


SINGLE = Cluster(rank=0, size=1)


def launched(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process was started as one rank of several."""
    return "MLX_RANK" in env and any(key in env for key in _LAUNCH_ENV)


def join(backend: str = "any", env: Mapping[str, str] = os.environ) -> Cluster:
    """The cluster this process belongs to; a one-line error when it was not started as a
    rank, or the back-end cannot connect (a wrong hostfile, a peer that is not up)."""
    if backend not in BACKENDS:
        raise MlxkvError(f"unknown distributed back-end {backend!r}: use one of {', '.join(BACKENDS)}")
    if not launched(env):
        raise MlxkvError("--distributed needs every rank started by `mlx.launch --hostfile FILE`, "
                         "or with MLX_HOSTFILE and MLX_RANK set (docs/distributed.md)")
    import mlx.core as mx  # here, not at import: the command line's flags name BACKENDS

    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except Exception as e:  # MLX raises RuntimeError or ValueError with a multi-line text
        raise MlxkvError(f"could not join the distributed set ({backend}): {first_line(e)}") from None
    if group.size() < 2:
        raise MlxkvError(f"the distributed set has {group.size()} rank; --distributed needs 2 or more")
    return Cluster(rank=group.rank(), size=group.size(), group=group)
