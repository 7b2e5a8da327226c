"""Recurrent-state checkpoints: how a hybrid model's state layers get prefix hits.

A recurrent layer's state (mlx-lm's `ArraysCache`: gated delta net, Mamba,
short convolutions) after n tokens stands for all n of them; it cannot be
cut per block. A checkpoint is every recurrent slot's state at a block
boundary b of one chain of blocks, named by the hash of block b - 1 (which
stands for the whole prefix) and kept under `checkpoint_key` of it. The
models assign new arrays to their caches and never write one in place, so
keeping the references a step made is the copy, and a checkpoint never
changes.

- `CheckpointStore` holds checkpoints in bytes against their share of the
  pool's budget, least recently used out first, to `on_evict` (the tiers).
  It also remembers, per checkpoint, its chain's *anchor*: the boundary of
  the newest checkpoint before it known to be on disk (the write policy's
  input, see groups/recurrent.py).
- `CheckpointIndex` knows at which boundaries checkpoints exist, so a
  lookup tries only those: O(checkpoints), not a hash and a tier's `stat`
  per block boundary of the prompt.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import mlx.core as mx

from mlxkv.cache.hashing import BlockHash

# What a step keeps of each recurrent slot: its state arrays, batch of one.
States = tuple[tuple[mx.array, ...], ...]


def checkpoint_key(block_hash: BlockHash) -> BlockHash:
    """The key of the checkpoint at the end of the block whose hash this is."""
    return hashlib.sha256(block_hash + b"\0state\0").digest()


def states_nbytes(states: States) -> int:
    return sum(a.nbytes for slot in states for a in slot if a is not None)


class CheckpointRef(NamedTuple):
    """Where a checkpoint sits: after the block with this hash, at this boundary (tokens)."""

    block_hash: BlockHash
    boundary: int

    @property
    def key(self) -> BlockHash:
        return checkpoint_key(self.block_hash)


@dataclass(frozen=True, eq=False)
class Checkpoint:
    ref: CheckpointRef
    states: States
    key: BlockHash = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "key", self.ref.key)
        object.__setattr__(self, "nbytes", states_nbytes(self.states))

    @property
    def boundary(self) -> int:
        return self.ref.boundary


@dataclass
class CheckpointStats:
    held: int = 0
    bytes_held: int = 0
    stores: int = 0
    hits: int = 0
    evictions: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class CheckpointStore:
    """Checkpoints by key, least recently used first, within `budget_bytes`."""

    def __init__(self, budget_bytes: int, on_evict: Callable[[Checkpoint], None] | None = None):
        self.budget_bytes = budget_bytes
        self.on_evict = on_evict
        self._held: OrderedDict[BlockHash, Checkpoint] = OrderedDict()
        self._anchors: dict[BlockHash, int] = {}  # key -> its chain's last on-disk boundary (tokens)
        self._stats = CheckpointStats()
        self.generation = 0  # bumped when the held set changes

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def get(self, key: BlockHash) -> Checkpoint | None:
        """The checkpoint, now the most recently used; None if not held."""
        checkpoint = self._held.get(key)
        if checkpoint is not None:
            self._held.move_to_end(key)
            self._stats.hits += 1
        return checkpoint

    def held(self, keys) -> list[Checkpoint]:
        """Those of these checkpoints still held, in the keys' order (no use counted:
        a write to a tier is not a hit)."""
        return [self._held[key] for key in keys if key in self._held]

    def put(self, checkpoint: Checkpoint) -> bool:
        """Keep a checkpoint, pushing older ones out past the budget; False if it alone is too big."""
        key = checkpoint.key
        if key in self._held:
            self._held.move_to_end(key)
            return True
        if checkpoint.nbytes > self.budget_bytes:
            return False
        self._held[key] = checkpoint
        self._stats.held += 1
        self._stats.bytes_held += checkpoint.nbytes
        self._stats.stores += 1
        self.generation += 1
        while self._stats.bytes_held > self.budget_bytes:
            old_key, old = self._held.popitem(last=False)
            self._anchors.pop(old_key, None)
            self._stats.held -= 1
            self._stats.bytes_held -= old.nbytes
            self._stats.evictions += 1
            if self.on_evict is not None:
                self.on_evict(old)
        return True

    def anchor(self, key: BlockHash) -> int:
        """The boundary of the last on-disk checkpoint in the chain of a held one (0: none known)."""
        return self._anchors.get(key, 0)

    def set_anchor(self, key: BlockHash, anchor: int) -> None:
        if key in self._held:
            self._anchors[key] = anchor

    def stats(self) -> dict[str, int]:
        return {**self._stats.as_dict(), "budget_bytes": self.budget_bytes}


# Boundaries remembered at most; the oldest are forgotten first (a miss, never a wrong hit).
INDEX_LIMIT = 1 << 16


class CheckpointIndex:
    """The checkpoints known to exist (held, or in a tier), by boundary.

    A hint, checked before use: a tier may have dropped one since; the
    lookup then forgets it and tries the next.
    """

    def __init__(self, limit: int = INDEX_LIMIT):
        self.limit = limit
        self._refs: OrderedDict[CheckpointRef, None] = OrderedDict()
        self._at: dict[int, set[BlockHash]] = {}
        self._boundaries: list[int] = []  # sorted
        self.generation = 0  # bumped when a checkpoint is learned or forgotten

    def __len__(self) -> int:
        return len(self._refs)

    def add(self, ref: CheckpointRef) -> None:
        if ref in self._refs:
            self._refs.move_to_end(ref)
            return
        self._refs[ref] = None
        self.generation += 1
        if ref.boundary not in self._at:
            self._at[ref.boundary] = set()
            bisect.insort(self._boundaries, ref.boundary)
        self._at[ref.boundary].add(ref.block_hash)
        while len(self._refs) > self.limit:
            self.discard(next(iter(self._refs)))

    def discard(self, ref: CheckpointRef) -> None:
        if ref not in self._refs:
            return
        del self._refs[ref]
        self.generation += 1
        at = self._at[ref.boundary]
        at.discard(ref.block_hash)
        if not at:
            del self._at[ref.boundary]
            self._boundaries.pop(bisect.bisect_left(self._boundaries, ref.boundary))

    def candidates(self, hashes: list[BlockHash], limit: int, block_size: int) -> Iterator[CheckpointRef]:
        """Known checkpoints of this chain at boundaries up to block `limit`, the largest first."""
        top = bisect.bisect_right(self._boundaries, limit * block_size)
        for boundary in reversed(self._boundaries[:top]):
            if boundary % block_size:
                continue
            block_hash = hashes[boundary // block_size - 1]
            if block_hash in self._at.get(boundary, ()):
                yield CheckpointRef(block_hash, boundary)
