"""What the pool hands the tiers: registered blocks stored, evicted blocks spilled.

Every write to the connector (cache/connector.py) from the attention
groups goes through here; the recurrent manager writes its checkpoints
itself. The bytes are read lazily (`reader`), so a tier that drops or
already holds a block never costs a pool read. A failed write loses a
cached copy, never a request: it is logged and the step goes on.
"""

from __future__ import annotations

import logging

from mlxkv.cache.block_pool import Block
from mlxkv.cache.connector import KVCacheConnector
from mlxkv.cache.groups.base import AttentionManager
from mlxkv.cache.kv_pool import KVPool

log = logging.getLogger(__name__)


class TierWrites:
    def __init__(self, connector: KVCacheConnector, kv_pool: KVPool | None):
        self.connector, self.kv_pool = connector, kv_pool

    def reader(self, blocks: list[Block]):
        """A call that reads these blocks' K/V from the pool, when a tier wants the bytes."""
        ids, groups = [b.block_id for b in blocks], [b.group for b in blocks]
        return lambda: self.kv_pool.read_blocks(ids, groups)

    def spill(self, blocks: list[Block]) -> None:
        """The pool's eviction hook: cached blocks leave the pool for the tiers."""
        # Read in reverse: a freed sequence's blocks are evicted last first,
        # so reversed they are in prefix order, one run a hydrate copies in
        # stretches; handed over in eviction order, for the tiers' LRU.
        read = self.reader(blocks[::-1])
        try:
            self.connector.evict_blocks([b.block_hash for b in blocks], lambda: read()[::-1])
        except Exception:  # a failed spill loses cached copies, never a request
            log.exception("the connector could not spill %d blocks", len(blocks))

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
