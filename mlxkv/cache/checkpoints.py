"""Recurrent-state checkpoints: how a hybrid model's state layers get prefix hits.

A recurrent layer's state (mlx-lm's `ArraysCache`: gated delta net, Mamba,
short convolutions) after n tokens stands for all n of them; it cannot be
cut per block. A checkpoint is every recurrent slot's state at a block
boundary b, kept under `checkpoint_key` of the hash of block b - 1, so a
prompt whose first b blocks match resumes there. The models assign new
arrays to their caches and never write one in place, so keeping the
references a step made is the copy, and a checkpoint never changes.

The store holds checkpoints in bytes against their share of the pool's
budget, evicting the least recently used first and handing each to
`on_evict` (the connector's tiers), as the block pool does with blocks.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass

import mlx.core as mx

from mlxkv.cache.hashing import BlockHash

# What a step keeps of each recurrent slot: its state arrays, batch of one.
States = tuple[tuple[mx.array, ...], ...]


def checkpoint_key(block_hash: BlockHash) -> BlockHash:
    """The key of the checkpoint at the end of the block whose hash this is."""
    return hashlib.sha256(block_hash + b"\0state\0").digest()


def states_nbytes(states: States) -> int:
    return sum(a.nbytes for slot in states for a in slot)


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

    def __init__(self, budget_bytes: int, on_evict: Callable[[BlockHash, States], None] | None = None):
        self.budget_bytes = budget_bytes
        self.on_evict = on_evict
        self._held: OrderedDict[BlockHash, States] = OrderedDict()
        self._stats = CheckpointStats()

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def get(self, key: BlockHash) -> States | None:
        """The checkpoint, now the most recently used; None if not held."""
        states = self._held.get(key)
        if states is not None:
            self._held.move_to_end(key)
            self._stats.hits += 1
        return states

    def put(self, key: BlockHash, states: States) -> bool:
        """Keep a checkpoint, pushing older ones out past the budget; False if it alone is too big."""
        if key in self._held:
            self._held.move_to_end(key)
            return True
        nbytes = states_nbytes(states)
        if nbytes > self.budget_bytes:
            return False
        self._held[key] = states
        self._stats.held += 1
        self._stats.bytes_held += nbytes
        self._stats.stores += 1
        while self._stats.bytes_held > self.budget_bytes:
            old_key, old = self._held.popitem(last=False)
            self._stats.held -= 1
            self._stats.bytes_held -= states_nbytes(old)
            self._stats.evictions += 1
            if self.on_evict is not None:
                self.on_evict(old_key, old)
        return True

    def stats(self) -> dict[str, int]:
        return {**self._stats.as_dict(), "budget_bytes": self.budget_bytes}
