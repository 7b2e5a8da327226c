"""What the SSD tier holds: files in LRU order, where each block is, writes in
flight, and the tier's counters.

This is the tier's only shared state, and its lock is the tier's only lock:
the engine thread (lookups, loads, queued writes), the reader threads and
the writer thread all meet here. Every method takes the lock; callers hold
none, and no method does I/O while holding it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from mlxkv.cache.hashing import BlockHash
from mlxkv.cache.connector import TierStats


@dataclass(slots=True)
class FileEntry:
    size: int
    block_hashes: tuple[BlockHash, ...]


class DiskIndex:
    def __init__(self):
        self.lock = threading.Condition()
        self.files: OrderedDict[BlockHash, FileEntry] = OrderedDict()  # file (last hash) -> run; LRU first
        self._where: dict[BlockHash, tuple[BlockHash, int]] = {}  # block hash -> (file, position)
        self._pending: dict[BlockHash, int] = {}  # block hash -> bytes of the write holding it
        self.pending_bytes = 0
        self.stats = TierStats()
        self.dropped_writes = 0  # the queue was full (or the tier closed)
        self.low_space_skips = 0  # free space under the floor (also write_errors)
        self.last_error: str | None = None
        self._found_refs: list = []  # checkpoints found in files, not yet told (checkpoint_refs)

    # -- files and blocks -------------------------------------------------------

    def add(self, name: BlockHash, size: int, block_hashes: tuple[BlockHash, ...]) -> None:
        with self.lock:
            self._drop(name)
            self.files[name] = FileEntry(size, block_hashes)
            for pos, block_hash in enumerate(block_hashes):
                self._where[block_hash] = (name, pos)
            self.stats.bytes_held += size
            self.stats.blocks_held = len(self._where)

    def learn(self, ref) -> None:
        """A checkpoint's file was found (a scan, another process's write)."""
        with self.lock:
            self._found_refs.append(ref)

    def take_refs(self) -> list:
        with self.lock:
            refs, self._found_refs = self._found_refs, []
            return refs

    def forget(self, name: BlockHash) -> int:
        """Unindex a file; returns how many blocks it was the place of."""
        with self.lock:
            return self._drop(name)

    def forget_all(self) -> None:
        with self.lock:
            for name in list(self.files):
                self._drop(name)

    def _drop(self, name: BlockHash) -> int:
        entry = self.files.pop(name, None)
        if entry is None:
            return 0
        dropped = 0
        for block_hash in entry.block_hashes:
            if self._where.get(block_hash, (None,))[0] == name:
                del self._where[block_hash]
                dropped += 1
        self.stats.bytes_held -= entry.size
        self.stats.blocks_held = len(self._where)
        return dropped

    def has_file(self, name: BlockHash) -> bool:
        with self.lock:
            return name in self.files

    def entry(self, name: BlockHash) -> FileEntry | None:
        with self.lock:
            return self.files.get(name)

    def contains(self, block_hash: BlockHash) -> bool:
        """True if the block is on disk (written and indexed), not merely queued."""
        with self.lock:
            return block_hash in self._where

    def locate(self, block_hash: BlockHash) -> tuple[BlockHash, int] | None:
        """(file, position in its run) of a block on disk."""
        with self.lock:
            return self._where.get(block_hash)

    def touch(self, name: BlockHash) -> None:
        """The file was used: most recently used now."""
        with self.lock:
            if name in self.files:
                self.files.move_to_end(name)

    def lru_victim(self, budget: int) -> tuple[BlockHash, int] | None:
        """Unindex the least recently used file while over `budget` bytes: (its name, its blocks)."""
        with self.lock:
            if self.stats.bytes_held <= budget or not self.files:
                return None
            victim = next(iter(self.files))
            return victim, self._drop(victim)

    def pop_lru(self) -> tuple[BlockHash, int, int] | None:
        """Unindex the least recently used file: (its name, its blocks, its size), or None if there is none."""
        with self.lock:
            if not self.files:
                return None
            victim = next(iter(self.files))
            size = self.files[victim].size
            return victim, self._drop(victim), size

    # -- writes in flight -------------------------------------------------------

    def wants(self, block_hash: BlockHash, max_pending: int) -> bool:
        """Neither on disk nor queued, and room in the queue (else a dropped write is counted)."""
        with self.lock:
            if block_hash in self._where or block_hash in self._pending:
                return False
            if self.pending_bytes >= max_pending:
                self.dropped_writes += 1  # skip even the read
                return False
        return True

    def fresh(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Positions of the hashes neither on disk nor queued; the files of those on disk are touched."""
        with self.lock:
            for h in block_hashes:
                if h in self._where:
                    self.files.move_to_end(self._where[h][0])
            return [i for i, h in enumerate(block_hashes) if h not in self._where and h not in self._pending]

    def reserve(self, block_hashes: Sequence[BlockHash], nbytes: int, max_pending: int) -> bool:
        """Mark a write of these blocks queued; False (a dropped write) if the queue is full."""
        with self.lock:
            if self.pending_bytes + nbytes > max_pending:
                self.dropped_writes += 1
                return False
            for h in block_hashes:
                self._pending[h] = nbytes
            self.pending_bytes += nbytes
        return True

    def settle(self, block_hashes: Sequence[BlockHash], nbytes: int) -> None:
        """A queued write is done (or failed): its blocks are no longer in flight."""
        with self.lock:
            for h in block_hashes:
                self._pending.pop(h, None)
            self.pending_bytes -= nbytes
            self.lock.notify_all()

    def wait_settled(self, timeout: float | None) -> bool:
        """Wait until no write is in flight; False on timeout."""
        with self.lock:
            return self.lock.wait_for(lambda: not self._pending, timeout)

    # -- counters ---------------------------------------------------------------

    def count(self, **increments: int) -> None:
        """Add to TierStats fields (lookups=1, hit_blocks=n, ...)."""
        with self.lock:
            for name, n in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    def note_dropped(self) -> None:
        """A write not done: the queue was full, the tier closed, or the run is over the budget."""
        with self.lock:
            self.dropped_writes += 1

    def note_error(self, message: str, *, low_space: bool = False) -> None:
        """A write that failed or was skipped for lack of space, and why."""
        with self.lock:
            self.stats.write_errors += 1
            self.low_space_skips += int(low_space)
            self.last_error = message

    def note_corrupt(self, name: BlockHash, why: str) -> None:
        with self.lock:
            self._drop(name)
            self.stats.corrupt += 1
            self.last_error = f"corrupt block file {name.hex()[:16]}: {why}"

    def stats_dict(self) -> dict[str, int]:
        with self.lock:
            return self.stats.as_dict()

    def health(self) -> dict:
        with self.lock:
            return {
                "pending_writes": len(self._pending),
                "pending_bytes": self.pending_bytes,
                "dropped_writes": self.dropped_writes,
                "low_space_skips": self.low_space_skips,
                "last_error": self.last_error,
            }
