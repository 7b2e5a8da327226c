"""Admission on a prefix hit: hold its pool blocks, load its tier blocks into fresh ones.

All or nothing: if a tier cannot supply its share (a copy gone or bad),
what was taken goes back and the coordinator looks the prompt up again
(coordinator.py's `admit`). A group's tier blocks land on fresh pool
blocks in id order, so a run of them is one slice copy per layer.
"""

from __future__ import annotations

from mlxkv.cache.block_pool import Block, BlockPool
from mlxkv.cache.connector import KVCacheConnector
from mlxkv.cache.groups.base import AttentionManager
from mlxkv.cache.hashing import BlockHash
from mlxkv.cache.kv_pool import KVPool
from mlxkv.cache.sequence import Sequence
from mlxkv.cache.tiers import POOL, TIERS


class Hydration:
    def __init__(self, pool: BlockPool, kv_pool: KVPool | None, connector: KVCacheConnector,
                 attention: list[AttentionManager], recurrent, block_size: int):
        self.pool, self.kv_pool, self.connector = pool, kv_pool, connector
        self.attention, self.recurrent, self.block_size = attention, recurrent, block_size

    def room_for(self, hit) -> bool:
        """Whether the pool can take the hit's tier blocks beside its own."""
        unreferenced = sum(1 for block in hit.pool_blocks if block.ref_count == 0)
        return hit.tier_blocks <= self.pool.num_free - unreferenced

    def take(self, request_id: int, tokens: list[int], root, hit, head: int = 0) -> Sequence | None:
        """A sequence holding the hit's blocks; None (holding nothing) if a tier could not supply its share.
        `head` (tokens): a rendered head's end, a branch point as the hit's own is."""
        loaded = self.recurrent.load(hit.checkpoint) if hit.checkpoint is not None else None
        if hit.checkpoint is not None and loaded is None:
            return None
        touched = hit.pool_blocks
        self.pool.touch(touched)
        sources = [POOL] * hit.num_blocks
        held, hydrated = [], []
        for manager, needs in zip(self.attention, hit.groups):
            blocks = self._load_group(manager, needs.tiers, sources)
            if blocks is None:
                self.pool.free(touched + hydrated)
                return None
            hydrated += [block for _, block in blocks]
            held.append(needs.pool + blocks)
        seq = Sequence(request_id, tokens, root, hit.hashes)
        seq.num_cached_blocks = hit.num_blocks
        seq.num_computed = hit.num_blocks * self.block_size
        for manager, blocks in zip(self.attention, held):
            manager.start(request_id, hit.num_blocks, blocks)
        if self.recurrent is not None:
            self.recurrent.start(request_id, loaded[0] if loaded else None, seq.num_computed,
                                 max(hit.branch * self.block_size, head))
        state_tier = loaded[1] if loaded else POOL
        for source in sources:
            source = max(source, state_tier, key=TIERS.index)  # as slow as the checkpoint, too
            seq.cached_tokens[source] += self.block_size
        return seq

    def _load_group(self, manager: AttentionManager, wanted: list[tuple[int, BlockHash]],
                    sources: list[str]) -> list[tuple[int, Block]] | None:
        """A group's tier blocks, loaded into fresh pool blocks; None if any is missing."""
        if not wanted:
            return []
        keys = [key for _, key in wanted]
        loaded = self.connector.load_blocks(keys)
        good = 0
        while (good < min(len(loaded), len(keys)) and loaded[good].block_hash == keys[good]
               and loaded[good].kv.group == manager.index):
            good += 1
        # Which free block takes which key is ours to choose: in id order, a
        # run of tier blocks lands on runs of ids, one slice copy per layer.
        blocks = sorted(self.pool.allocate(good), key=lambda blk: blk.block_id) if good else []
        if good:
            self.kv_pool.write_blocks([blk.block_id for blk in blocks], [block.kv for block in loaded[:good]])
            self.pool.register(blocks, keys[:good], manager.index)
        if good < len(keys):
            self.pool.free(blocks)  # they stay cached under their keys; the hit is looked up again
            return None
        for (i, _), found in zip(wanted, loaded):
            sources[i] = max(sources[i], found.tier, key=TIERS.index)  # as slow as its slowest group
        return [(i, block) for (i, _), block in zip(wanted, blocks)]
