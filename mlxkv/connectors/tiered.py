"""The tiers behind the pool, in the order a lookup tries them: memory, SSD, remote.

Each is optional; build.py makes this connector when more than one is on.

- Lookup and hydrate: each tier is asked for what the ones before it
  lacked. An SSD hit is promoted into memory; a remote hit into the SSD
  tier (or memory, with no SSD tier), so it survives a restart without the
  network.
- Writes: newly full blocks are written through to the SSD and remote
  tiers, read from the pool once for both. What memory pushes out goes to
  SSD and is offered to the remote tier too: whatever the SSD tier is
  given, the remote one is also offered (it skips what it sent already).
- Checkpoints go the same ways.

This connector makes its memory tier, so the memory tier's hooks into the
tiers behind it are set by their owner when it is made.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxkv.cache.checkpoints import Checkpoint
from mlxkv.cache.connector import (
    CheckpointLoad, LoadJob, LoadedBlock, LoadedCheckpoint, ReadKV, SyncCheckpointLoad, SyncLoad, begin_checkpoint_load,
    begin_load,
)
from mlxkv.cache.hashing import BlockHash
from mlxkv.connectors.memory import InMemoryKVCacheConnector


def _once(read: ReadKV) -> ReadKV:
    """`read`, but the pool is read at most once however many tiers ask."""
    got = []

    def read_once():
        if not got:
            got.append(read())
        return got[0]

    return read_once


class TieredKVCacheConnector:
    def __init__(self, disk, memory_bytes: int, block_size: int, memory_bits: int | None = None, *, remote=None):
        self.disk, self.remote = disk, remote
        self.memory = None
        if memory_bytes:
            self.memory = InMemoryKVCacheConnector(memory_bytes, block_size, memory_bits, on_evict=self._spill,
                                                   on_evict_checkpoint=self._spill_checkpoint)
        self.tiers = [t for t in (self.memory, disk, remote) if t is not None]
        self._behind = [t for t in (disk, remote) if t is not None]  # what keeps blocks past this process

    # -- spills from memory --------------------------------------------------------

    def _spill(self, block_hash: BlockHash, kv) -> None:
        if self.disk is not None and not self.disk.contains(block_hash):
            self.disk.store(block_hash, kv, spill=True)
        if self.remote is not None:
            self.remote.evict_blocks([block_hash], lambda: [kv])

    def _spill_checkpoint(self, checkpoint: Checkpoint) -> None:
        for tier in self._behind:
            tier.evict_checkpoint(checkpoint)

    # -- lookup and hydrate --------------------------------------------------------

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        n = 0
        for tier in self.tiers:
            if n == len(block_hashes):
                break
            n += tier.get_computed_blocks(block_hashes[n:])
        return n

    def load_blocks(self, block_hashes: Sequence[BlockHash]) -> list[LoadedBlock]:
        loaded: list[LoadedBlock] = []
        for tier in self.tiers:
            if len(loaded) == len(block_hashes):
                break
            found = tier.load_blocks(block_hashes[len(loaded):])
            if found:
                self._promote(tier, found)
            loaded += found
        return loaded

    def tiers_of(self, block_hashes: Sequence[BlockHash]) -> list[str]:
        """The tier each leading block a lookup would find comes from (as get_computed_blocks counts them)."""
        names: list[str] = []
        for tier in self.tiers:
            if len(names) == len(block_hashes):
                break
            names += [tier.tier_name] * tier.get_computed_blocks(block_hashes[len(names):])
        return names

    def begin_load(self, block_hashes: Sequence[BlockHash]) -> TieredLoad:
        return TieredLoad(self, list(block_hashes))

    def _promote(self, tier, found: list[LoadedBlock]) -> None:
        if tier is self.disk and self.memory is not None:
            for block in found:
                self.memory.store(block.block_hash, block.kv)
        elif tier is self.remote:
            into = self.disk or self.memory
            if into is self.disk:
                self.disk.cache_blocks([b.block_hash for b in found], lambda: [b.kv for b in found])
            elif into is not None:
                for block in found:
                    into.store(block.block_hash, block.kv)

    def has_checkpoint(self, key: BlockHash) -> bool:
        return any(tier.has_checkpoint(key) for tier in self.tiers)

    def load_checkpoint(self, key: BlockHash) -> LoadedCheckpoint | None:
        for tier in self.tiers:
            loaded = tier.load_checkpoint(key)
            if loaded is not None:
                return loaded
        return None

    def begin_checkpoint_load(self, key: BlockHash) -> CheckpointLoad | SyncCheckpointLoad:
        """Memory's copy on the engine thread (a copy in RAM); else the SSD's, then the remote's,
        read on the loader thread."""
        if self.memory is not None and self.memory.has_checkpoint(key):
            return SyncCheckpointLoad(self.memory, key)
        return _FirstCheckpoint([begin_checkpoint_load(tier, key) for tier in self._behind])

    def checkpoint_refs(self):
        return [ref for tier in self._behind for ref in tier.checkpoint_refs()]

    # -- writes --------------------------------------------------------------------

    def cache_blocks(self, block_hashes, read) -> None:
        read = _once(read)
        for tier in self._behind:
            tier.cache_blocks(block_hashes, read)

    def wants_spill(self, block_hash: BlockHash) -> bool:
        if self.memory is not None:
            return self.memory.wants_spill(block_hash)
        return any([tier.wants_spill(block_hash) for tier in self._behind])

    def evict_blocks(self, block_hashes, read) -> None:
        if self.memory is not None:
            self.memory.evict_blocks(block_hashes, read)
            return
        read = _once(read)
        for tier in self._behind:
            tier.evict_blocks(block_hashes, read)

    def cache_checkpoint(self, checkpoint: Checkpoint) -> None:
        for tier in self._behind:  # written through, as blocks are
            tier.cache_checkpoint(checkpoint)

    def evict_checkpoint(self, checkpoint: Checkpoint) -> None:
        if self.memory is not None:
            self.memory.evict_checkpoint(checkpoint)
        else:
            self._spill_checkpoint(checkpoint)

    # -- state ---------------------------------------------------------------------

    def stats(self) -> dict[str, dict]:
        return {name: s for tier in self.tiers for name, s in tier.stats().items()}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the SSD and remote tiers' queued writes; False on timeout."""
        return all([tier.flush(timeout) for tier in self._behind])

    def close(self) -> None:
        for tier in self._behind:
            tier.close()


class _FirstCheckpoint:
    """A checkpoint load across the tiers behind memory: the first that has it, on the loader thread."""

    def __init__(self, jobs: list):
        self._jobs, self._found = jobs, None

    def run(self) -> None:
        for job in self._jobs:
            job.run()
            if getattr(job, "staged", True):
                self._found = job
                return

    def take(self) -> LoadedCheckpoint | None:
        return self._found.take() if self._found is not None else None


class TieredLoad:
    """A load across the tiers, in lookup order: what memory holds is taken on the engine
    thread (a copy in RAM); the SSD tier's part, then the remote tier's for what is left, are
    read on the loader thread. Each part starts where the one before it ended, and a part
    that falls short ends the load there (a hit is a leading run)."""

    def __init__(self, tiered: TieredKVCacheConnector, block_hashes: list[BlockHash]):
        self.tiered, self.block_hashes = tiered, block_hashes
        memory = tiered.memory
        # Counted, not looked up: the lookup that led here (tiers_of) already counted this one.
        m = memory.leading(block_hashes) if memory is not None else 0
        self._parts: list[tuple[object, LoadJob, int]] = []  # (tier, job, blocks wanted of it)
        if m:
            self._parts.append((memory, SyncLoad(memory, block_hashes[:m]), m))
        self._start = m  # where the loader thread's parts begin
        self.reads: list[tuple[str, int, float]] = []  # the loader thread's; a memory read is not timed

    def run(self) -> None:
        at = self._start
        for tier in self.tiered._behind:
            if at == len(self.block_hashes):
                break
            job = begin_load(tier, self.block_hashes[at:])
            job.run()
            self.reads += job.reads
            got = getattr(job, "staged_blocks", 0)
            self._parts.append((tier, job, got))
            at += got

    def take(self, max_bytes: int) -> list[LoadedBlock]:
        while self._parts:
            tier, job, wanted = self._parts[0]
            found = job.take(max_bytes)
            if found:
                if tier is not self.tiered.memory:
                    self.tiered._promote(tier, found)
                self._parts[0] = (tier, job, wanted - len(found))
                return found
            self._parts.pop(0)
            if wanted > 0:  # this part fell short: the parts after it do not follow on
                self._parts.clear()
        return []
