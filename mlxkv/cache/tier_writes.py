"""What the pool hands the tiers: registered blocks stored, evicted blocks spilled.

Every write to the connector (cache/connector.py) from the attention
groups goes through here; the recurrent manager writes its checkpoints
itself. Stores read the bytes lazily (`reader`), so a tier that drops or
already holds a block never costs a pool read; spills ask the tier first
(`wants_spill`), read at eviction, and reach the tier after the allocation. A failed write loses a
cached copy, never a request: it is logged and the step goes on.
"""

from __future__ import annotations

import logging

from mlxkv.cache.block_pool import Block
from mlxkv.cache.connector import KVCacheConnector, NoopKVCacheConnector
from mlxkv.cache.groups.base import AttentionManager
from mlxkv.cache.kv_pool import KVPool

log = logging.getLogger(__name__)


class TierWrites:
    def __init__(self, connector: KVCacheConnector, kv_pool: KVPool | None):
        self.connector, self.kv_pool = connector, kv_pool
        self._spills: list[tuple[list, list]] = []  # (hashes, their K/V) read at eviction, not yet handed over

    def reader(self, blocks: list[Block]):
        """A call that reads these blocks' K/V from the pool, when a tier wants the bytes."""
        ids, groups = [b.block_id for b in blocks], [b.group for b in blocks]
        return lambda: self.kv_pool.read_blocks(ids, groups)

    def spill(self, blocks: list[Block]) -> None:
        """The pool's eviction hook: cached blocks leave the pool for the tiers.

        Runs inside `BlockPool.allocate`, so it only reads the bytes the tiers
        want (they must be read before the pool reuses the blocks) and queues
        them; `drain` hands them over once the allocation is done. A tier's
        write never runs inside an allocation, so a slow or failing tier
        cannot hold or break one.
        """
        if type(self.connector) is NoopKVCacheConnector or self.kv_pool is None:
            return  # the default stores nothing: no bytes to read
        wants = getattr(self.connector, "wants_spill", None)
        wanted = [b for b in blocks if wants(b.block_hash)] if wants is not None else list(blocks)
        if not wanted:
            return
        # Read in reverse: a freed sequence's blocks are evicted last first,
        # so reversed they are in prefix order, one run a hydrate copies in
        # stretches; handed over in eviction order, for the tiers' LRU.
        kvs = self.reader(wanted[::-1])()[::-1]
        self._spills.append(([b.block_hash for b in wanted], kvs))

    def drain(self) -> None:
        """Hand the queued spills to the tiers (whose own threads write them)."""
        spills, self._spills = self._spills, []
        for hashes, kvs in spills:
            try:
                self.connector.evict_blocks(hashes, lambda kvs=kvs: kvs)
            except Exception:  # a failed spill loses cached copies, never a request
                log.exception("the connector could not spill %d blocks", len(hashes))

    def store(self, managers: list[AttentionManager], request_id: int) -> None:
        """Offer every group's registered, unstored blocks of the sequence to the tiers."""
        for manager in managers:
            self.store_group(manager, request_id)

    def store_group(self, manager: AttentionManager, request_id: int) -> None:
        blocks = manager.tables.take_unstored(request_id)
        if not blocks:
            return
        try:
            self.connector.cache_blocks([b.block_hash for b in blocks], self.reader(blocks))
        except Exception:  # a lost copy, as with a spill; the release must still free
            log.exception("the connector could not store %d blocks", len(blocks))
