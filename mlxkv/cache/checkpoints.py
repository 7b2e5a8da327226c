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

It also decides which checkpoints a leaving sequence writes through to the
SSD tier. A real model's state is megabytes, a chat turn's KV often less,
so writing every turn's checkpoint made the SSD bytes several times the
KV bytes. Each checkpoint remembers its chain's *anchor*, the boundary of
the newest checkpoint before it known to be on disk; a new one is written
only once the KV computed since the anchor outweighs `write_ratio` times
its own bytes. Checkpoint bytes written thus stay under 1/write_ratio of
the KV bytes, and a restart recomputes at most write_ratio x state bytes /
KV bytes per token tokens from the anchor. write_ratio 0 writes every one.
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

    def __init__(self, budget_bytes: int, on_evict: Callable[[BlockHash, States], None] | None = None,
                 write_ratio: float = 0.0):
        self.budget_bytes = budget_bytes
        self.on_evict = on_evict
        self.write_ratio = write_ratio
        self._held: OrderedDict[BlockHash, States] = OrderedDict()
        self._anchors: dict[BlockHash, int] = {}  # key -> its chain's last on-disk boundary (tokens)
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
            self._anchors.pop(old_key, None)
            self._stats.held -= 1
            self._stats.bytes_held -= states_nbytes(old)
            self._stats.evictions += 1
            if self.on_evict is not None:
                self.on_evict(old_key, old)
        return True

    def anchor(self, key: BlockHash) -> int:
        """The boundary of the last on-disk checkpoint in the chain of a held one (0: none known)."""
        return self._anchors.get(key, 0)

    def worth_writing(self, boundary: int, anchor: int, states: States, kv_bytes_per_token: int) -> bool:
        """Whether the checkpoint at `boundary` should go to the SSD tier, its chain's anchor at `anchor`."""
        kv_since = (boundary - anchor) * kv_bytes_per_token
        return self.write_ratio <= 0 or kv_since >= self.write_ratio * states_nbytes(states)

    def set_anchor(self, key: BlockHash, anchor: int) -> None:
        if key in self._held:
            self._anchors[key] = anchor

    def stats(self) -> dict[str, int]:
        return {**self._stats.as_dict(), "budget_bytes": self.budget_bytes}
