"""Rank 0's step plans to every other rank, over the group's own collectives.

One `all_sum` per step carries the plan: rank 0 writes the encoded plan into a
byte buffer, the others contribute zeros, so the sum is rank 0's bytes on every
rank. Every rank must pass a buffer of the same size, or MLX returns a wrong
sum with no error, so the size is agreed, never measured per rank: the buffer
has a fixed capacity and a length header, and a plan longer than the capacity
is finished by a second collective whose size every rank reads from the header;
then all ranks grow the capacity the same way.
"""

from __future__ import annotations

import hashlib
import time

import mlx.core as mx
import numpy as np

from mlxkv.distributed.cluster import Cluster
from mlxkv.errors import MlxkvError, first_line

HEADER = 8  # the plan's length, little-endian


class RankLost(MlxkvError):
    """A peer died or became unreachable: the set cannot go on."""


class PlanMismatch(MlxkvError):
    """Two ranks hold different plans or states for one step: continuing would be a silent wrong answer."""


class PlanChannel:
    def __init__(self, cluster: Cluster, capacity: int = 4096):
        if capacity <= HEADER:
            raise ValueError(f"capacity {capacity} must exceed the {HEADER}-byte header")
        self.cluster = cluster
        self.capacity = capacity
        self.collectives = 0  # all_sum / all_gather calls made (the bench's per-step count)
        self.bytes_moved = 0
        self.seconds = 0.0  # spent in them, waiting for the slowest rank included

    def exchange(self, plan: bytes | None) -> bytes:
        """Rank 0 passes the encoded plan, the others None; every rank returns rank 0's bytes."""
        if self.cluster.leader != (plan is not None):
            raise ValueError("exactly rank 0 supplies the plan")
        first = np.zeros(self.capacity, dtype=np.uint8)
        if plan is not None:
            first[:HEADER] = np.frombuffer(len(plan).to_bytes(HEADER, "little"), dtype=np.uint8)
            head = plan[: self.capacity - HEADER]
            first[HEADER : HEADER + len(head)] = np.frombuffer(head, dtype=np.uint8)
        received = self._sum(first)
        length = int.from_bytes(received[:HEADER].tobytes(), "little")
        body = received[HEADER : HEADER + length].tobytes()
        rest = length - len(body)
        if rest > 0:
            tail = np.zeros(rest, dtype=np.uint8)
            if plan is not None:
                tail[:] = np.frombuffer(plan[len(body):], dtype=np.uint8)
            body += self._sum(tail).tobytes()
            self._grow(length)
        return body

    def agree(self, what: str, data: bytes) -> None:
        """Stop with PlanMismatch unless every rank passes equal `data` (compared by digest)."""
        digests = self.gather(hashlib.sha256(data).digest()[:8])
        for rank, digest in enumerate(digests):
            if digest != digests[0]:
                raise PlanMismatch(f"ranks disagree on {what}: rank {rank} differs from rank 0")

    def gather(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order. Each rank must pass the same length (a digest),
        which the caller guarantees: a length that differs would gather garbage."""
        mine = mx.array(np.frombuffer(data, dtype=np.uint8))
        rows = self._collective(lambda: mx.distributed.all_gather(mine, group=self.cluster.group))
        return [row.tobytes() for row in rows.reshape(self.cluster.size, len(data))]

    def _grow(self, length: int) -> None:
        # Every rank saw the same length, so every rank picks the same new capacity.
        while self.capacity < length + HEADER:
            self.capacity *= 2

    def _sum(self, buffer: np.ndarray) -> np.ndarray:
        return self._collective(lambda: mx.distributed.all_sum(mx.array(buffer), group=self.cluster.group))

    def _collective(self, op) -> np.ndarray:
        began = time.perf_counter()
        try:
            out = op()
            mx.eval(out)
        except RuntimeError as e:  # the ring back-end: "[ring] connection to a peer was lost"
            raise RankLost(f"{self.cluster.describe()}: a peer was lost ({first_line(e)})") from None
        self.seconds += time.perf_counter() - began
        self.collectives += 1
        self.bytes_moved += out.nbytes
        return np.array(out)
