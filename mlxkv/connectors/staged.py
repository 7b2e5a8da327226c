"""A tier's load read into numpy memory on the loader thread, handed to the engine thread as MLX.

The SSD and remote tiers' load jobs (cache/connector.py's `LoadJob`):
their `read` runs on the loader thread and returns verified `Staged`
stretches, numpy views of the bytes read (no MLX there); `take`, on the
engine thread, turns the next few into MLX runs, one copy each, so no
step copies more than about `max_bytes`. `throttle` (bytes/s) slows the
read to a slow disk's speed: the bench's and the tests' knob, never set
by a user's config.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxkv.cache.block_kv import KVRun
from mlxkv.cache.connector import LoadedBlock
from mlxkv.cache.hashing import BlockHash

log = logging.getLogger(__name__)


@dataclass
class Staged:
    """Verified blocks of one run read into numpy memory: `hashes[i]` is block `first + i` of keys/values."""

    keys: np.ndarray  # [num_layers, n, heads, block_size, head_dim], as stored (bfloat16 as uint16)
    values: np.ndarray
    first: int
    hashes: list[BlockHash]
    group: int = 0

    @property
    def nbytes(self) -> int:
        n = self.keys.shape[1]
        return (self.keys.nbytes + self.values.nbytes) * len(self.hashes) // max(n, 1)


class StagedLoad:
    def __init__(self, tier: str, mx_dtype: mx.Dtype, read: Callable[[], list[Staged]],
                 throttle: float | None = None, on_taken: Callable[[list[BlockHash]], None] | None = None):
        self.tier, self.mx_dtype, self._read, self.throttle = tier, mx_dtype, read, throttle
        self.on_taken = on_taken  # a tier's bookkeeping of what was hydrated (engine thread)
        self.reads: list[tuple[str, int, float]] = []
        self._staged: deque[Staged] = deque()

    def run(self) -> None:
        """Loader thread: read and verify into numpy memory."""
        start = time.perf_counter()
        staged = self._read()
        nbytes = sum(s.nbytes for s in staged)
        if self.throttle:
            time.sleep(max(0.0, nbytes / self.throttle - (time.perf_counter() - start)))
        self._staged = deque(staged)
        self.reads.append((self.tier, nbytes, time.perf_counter() - start))

    @property
    def staged_blocks(self) -> int:
        """Blocks read and verified (after `run`), not yet taken."""
        return sum(len(s.hashes) for s in self._staged)

    def take(self, max_bytes: int) -> list[LoadedBlock]:
        """Engine thread: the next stretches, at least one, until about `max_bytes`, as MLX views."""
        out: list[LoadedBlock] = []
        used = 0
        while self._staged and (not out or used + self._staged[0].nbytes <= max_bytes):
            batch = self._one_block_stretch(max_bytes - used) if len(self._staged[0].hashes) == 1 else []
            batch = batch or [self._staged.popleft()]
            out += self._as_mlx(batch)
            used += sum(s.nbytes for s in batch)
        if out and self.on_taken is not None:
            self.on_taken([b.block_hash for b in out])
        return out

    def _one_block_stretch(self, budget: int) -> list[Staged]:
        """Leading one-block stretches of one group (the remote tier's values), to copy as one run."""
        batch, used, group = [], 0, self._staged[0].group
        while (self._staged and len(self._staged[0].hashes) == 1 and self._staged[0].group == group
               and (not batch or used + self._staged[0].nbytes <= budget)):
            used += self._staged[0].nbytes
            batch.append(self._staged.popleft())
        return batch

    def _as_mlx(self, batch: list[Staged]) -> list[LoadedBlock]:
        if len(batch) == 1:
            s = batch[0]
            wanted = slice(s.first, s.first + len(s.hashes))  # not the whole file's run: the step's budget counts these
            run, first = KVRun(self._mx(s.keys[:, wanted]), self._mx(s.values[:, wanted])), 0
        else:
            run = KVRun(self._mx(np.concatenate([s.keys[:, s.first : s.first + 1] for s in batch], axis=1)),
                        self._mx(np.concatenate([s.values[:, s.first : s.first + 1] for s in batch], axis=1)))
            first = 0
        hashes = [(h, s.group) for s in batch for h in s.hashes]
        return [LoadedBlock(h, run.block(first + i, group), self.tier) for i, (h, group) in enumerate(hashes)]

    def _mx(self, a: np.ndarray) -> mx.array:
        out = mx.array(a)
        return out.view(self.mx_dtype) if out.dtype != self.mx_dtype else out  # bfloat16 from its uint16 bits
