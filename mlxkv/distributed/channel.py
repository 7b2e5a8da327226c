"""Rank 0's step plans to every other rank, over the group's own collectives.

One `all_gather` per step carries the plan: every rank passes a row of the
same size, and rank 0's holds the encoded plan. An all_gather, not an
all_sum of rank 0's bytes and the others' zeros: on a ring it is one pass
round the ranks where a sum is two, and a plan is small enough that the
passes, not the bytes, are its cost. Every rank must pass a row of the same
size, or MLX returns a wrong answer with no error, so the size is agreed,
never measured per rank: the row has a fixed capacity and a length header,
and a plan longer than the capacity (one that brings new prompts) is
finished by a second all_gather whose size every rank reads from the header.
The capacity never grows: a step with nothing new (most decode steps) costs
one small fixed-size collective.

Each rank's row also carries its own numbers: how long it spent in its last
exchange, so every rank can tell the collective itself (the fastest rank's
time) from waiting for a slower rank; and, when the last plan asked for it,
its report (rank_report.py). Nothing costs a collective of its own.
"""

from __future__ import annotations

import hashlib
import time

import mlx.core as mx
import numpy as np

from mlxkv.distributed.cluster import Cluster
from mlxkv.errors import MlxkvError, first_line

HEADER = 8  # the plan's length, little-endian
PLAN_BYTES = 256  # the plan's room in every row: an empty plan is 0 bytes, a cancel a few dozen
TIMING = 8  # every row's first bytes: that rank's last exchange's seconds, float64
REPORT_BYTES = 1024  # then its report, in an exchange the last plan asked reports for


class RankLost(MlxkvError):
    """A peer died or became unreachable: the set cannot go on."""


class PlanMismatch(MlxkvError):
    """Two ranks hold different plans or states for one step: continuing would be a silent wrong answer."""


class PlanChannel:
    def __init__(self, cluster: Cluster, capacity: int = PLAN_BYTES):
        if capacity <= 0:
            raise ValueError(f"capacity {capacity} must be positive")
        self.cluster = cluster
        self.capacity = capacity
        self.collectives = 0  # all_gather calls made (the bench's per-step count; never an all_sum)
        self.bytes_moved = 0
        self.seconds = 0.0  # spent in them, waiting for the slowest rank included
        self.wait_seconds = 0.0  # of which, in plan exchanges, waiting for a slower rank to reach them
        self.exchanges = 0
        self.reports: list[bytes] = []  # every rank's last report, in rank order
        self._last_s = 0.0  # this rank's time in its last exchange, sent with the next
        self._report: bytes | None = None  # this rank's report, for the next exchange

    def attach(self, report: bytes) -> None:
        """Send `report` with the next exchange. Every rank attaches one before the same
        exchange (a plan says so to all), or the ranks' buffers would differ in size."""
        if len(report) > REPORT_BYTES:
            raise ValueError(f"a rank's report is {len(report)} bytes; the slot holds {REPORT_BYTES}")
        self._report = report

    def exchange(self, plan: bytes | None) -> bytes:
        """Rank 0 passes the encoded plan, the others None; every rank returns rank 0's bytes."""
        if self.cluster.leader != (plan is not None):
            raise ValueError("exactly rank 0 supplies the plan")
        began = time.perf_counter()
        reported = self._report is not None
        rows = self._gather_rows(self._row(plan))
        self._read_rows(rows, reported)
        at = TIMING + (REPORT_BYTES if reported else 0)
        length = int.from_bytes(rows[0, at : at + HEADER].tobytes(), "little")
        body = rows[0, at + HEADER : at + HEADER + min(length, self.capacity)].tobytes()
        if (rest := length - len(body)) > 0:
            tail = np.zeros(rest, dtype=np.uint8)
            if plan is not None:
                tail[:] = np.frombuffer(plan[len(body):], dtype=np.uint8)
            body += self._gather_rows(tail)[0].tobytes()
        self.exchanges += 1
        self._last_s = time.perf_counter() - began
        return body

    def _row(self, plan: bytes | None) -> np.ndarray:
        """This rank's row: its last exchange's time, its report if attached, and (rank 0's
        only) the plan's length and head; every rank's row has the same size."""
        report = self._report
        row = np.zeros(TIMING + (REPORT_BYTES if report is not None else 0) + HEADER + self.capacity, dtype=np.uint8)
        row[:TIMING] = np.frombuffer(np.float64(self._last_s).tobytes(), dtype=np.uint8)
        at = TIMING
        if report is not None:
            row[at : at + len(report)] = np.frombuffer(report, dtype=np.uint8)
            at += REPORT_BYTES
        if plan is not None:
            row[at : at + HEADER] = np.frombuffer(len(plan).to_bytes(HEADER, "little"), dtype=np.uint8)
            head = plan[: self.capacity]
            row[at + HEADER : at + HEADER + len(head)] = np.frombuffer(head, dtype=np.uint8)
        return row

    def _read_rows(self, rows: np.ndarray, reported: bool) -> None:
        last = rows[:, :TIMING].copy().view(np.float64).ravel()
        # The rank that came last waited for nobody: its time is the collective's own cost.
        self.wait_seconds += float(last[self.cluster.rank] - last.min())
        if reported:
            self.reports = [row[TIMING : TIMING + REPORT_BYTES].tobytes().rstrip(b"\0") for row in rows]
            self._report = None

    def agree(self, what: str, data: bytes) -> None:
        """Stop with PlanMismatch unless every rank passes equal `data` (compared by digest)."""
        digests = self.gather(hashlib.sha256(data).digest()[:8])
        for rank, digest in enumerate(digests):
            if digest != digests[0]:
                raise PlanMismatch(f"ranks disagree on {what}: rank {rank} differs from rank 0")

    def gather(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order. Each rank must pass the same length (a digest),
        which the caller guarantees: a length that differs would gather garbage."""
        return [row.tobytes() for row in self._gather_rows(np.frombuffer(data, dtype=np.uint8))]

    def _gather_rows(self, row: np.ndarray) -> np.ndarray:
        mine = mx.array(row)
        return self._collective(lambda: mx.distributed.all_gather(mine, group=self.cluster.group)).reshape(
            self.cluster.size, len(row))

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
