"""The memory tier in front of the SSD tier.

What the memory tier pushes out goes to SSD; an SSD hit is promoted into
memory. Newly full blocks are written through to SSD at registration, so a
restart finds everything the previous process computed, not only what it
happened to evict. This connector makes its memory tier, so the tier's
hooks into the SSD tier are set by their owner when it is made.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxkv.cache.checkpoints import Checkpoint
from mlxkv.cache.connector import LoadedBlock, LoadedCheckpoint
from mlxkv.cache.hashing import BlockHash
from mlxkv.connectors.memory import InMemoryKVCacheConnector


class TieredKVCacheConnector:
    def __init__(self, disk, memory_bytes: int, block_size: int, memory_bits: int | None = None):
        self.disk = disk
        self.memory = InMemoryKVCacheConnector(memory_bytes, block_size, memory_bits, on_evict=self._spill_to_disk,
                                               on_evict_checkpoint=disk.evict_checkpoint)

    def _spill_to_disk(self, block_hash: BlockHash, kv) -> None:
        if not self.disk.contains(block_hash):
            self.disk.store(block_hash, kv, spill=True)

    def has_checkpoint(self, key: BlockHash) -> bool:
        return self.memory.has_checkpoint(key) or self.disk.has_checkpoint(key)

    def load_checkpoint(self, key: BlockHash) -> LoadedCheckpoint | None:
        return self.memory.load_checkpoint(key) or self.disk.load_checkpoint(key)

    def cache_checkpoint(self, checkpoint: Checkpoint) -> None:
        self.disk.cache_checkpoint(checkpoint)  # written through, as blocks are

    def evict_checkpoint(self, checkpoint: Checkpoint) -> None:
        self.memory.evict_checkpoint(checkpoint)

    def checkpoint_refs(self):
        return self.disk.checkpoint_refs()

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        n = self.memory.get_computed_blocks(block_hashes)
        return n + self.disk.get_computed_blocks(block_hashes[n:])

    def load_blocks(self, block_hashes: Sequence[BlockHash]) -> list[LoadedBlock]:
        loaded = self.memory.load_blocks(block_hashes)
        if len(loaded) < len(block_hashes):
            from_disk = self.disk.load_blocks(block_hashes[len(loaded):])
            for block in from_disk:
                self.memory.store(block.block_hash, block.kv)  # promote
            loaded += from_disk
        return loaded

    def cache_blocks(self, block_hashes, read) -> None:
        self.disk.cache_blocks(block_hashes, read)

    def evict_blocks(self, block_hashes, read) -> None:
        self.memory.evict_blocks(block_hashes, read)

    def stats(self) -> dict[str, dict[str, int]]:
        return {**self.memory.stats(), **self.disk.stats()}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the disk tier's queued writes; False on timeout."""
        return self.disk.flush(timeout)

    def close(self) -> None:
        self.disk.close()
