"""How long a prompt's prefix hit is, when every layer group has a say.

A hit at block boundary b reuses the prompt's first b blocks and computes
from token b * block_size on. Each group says what it needs for that:
- a full-attention group, its blocks 0..b-1;
- a sliding-window group, only the blocks that hold the window before
  token b * block_size (see KVGroup.first_needed_block).
A block counts when the pool holds it or a tier can supply it. The hit is
the largest b that every group accepts, and never covers the prompt's
last token. vLLM's hybrid cache manager finds it the same way: the
full-attention groups give an upper bound, then a sliding group that
lacks block m caps b at m (any b above it would still need m).

A hybrid model's recurrent layers also need a state checkpoint at exactly
b (checkpoints.py), from the store or a tier: the hit is the largest b
below the attention groups' bound that has one and that every group still
accepts, or 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxkv.cache.block_pool import Block, BlockPool
from mlxkv.cache.checkpoints import CheckpointStore, checkpoint_key
from mlxkv.cache.hashing import BlockHash, group_hash
from mlxkv.cache.layer_groups import GroupLayout, KVGroup


@dataclass
class PrefixHit:
    """The blocks a hit of `num_blocks` blocks needs, per group: the pool's, and the tiers' to load."""

    num_blocks: int
    # Per group: (block index, pool block) for each needed block the pool holds.
    pool: list[list[tuple[int, Block]]] = field(default_factory=list)
    # Per group: (block index, group hash) for each needed block a tier supplies.
    tiers: list[list[tuple[int, BlockHash]]] = field(default_factory=list)
    # The recurrent state checkpoint at block num_blocks, and whether a tier has it.
    checkpoint: BlockHash | None = None
    checkpoint_in_tier: bool = False


class PrefixLookup:
    def __init__(self, pool: BlockPool, layout: GroupLayout, block_size: int, connector,
                 checkpoints: CheckpointStore | None = None):
        self.pool, self.layout, self.block_size, self.connector = pool, layout, block_size, connector
        self.checkpoints = checkpoints

    def find(self, hashes: list[BlockHash], use_tiers: bool = True) -> PrefixHit:
        """The longest hit over `hashes` (the usable full blocks of a prompt)."""
        b = self._attention_bound(hashes, len(hashes), use_tiers)
        if not self.layout.has_recurrent:
            return self._hit(hashes, b)
        for c in range(b, 0, -1):  # the largest boundary with a checkpoint every group accepts
            key = checkpoint_key(hashes[c - 1])
            in_store = self.checkpoints is not None and key in self.checkpoints
            in_tier = not in_store and use_tiers and self.connector.has_checkpoint(key)
            if (in_store or in_tier) and self._first_missing(hashes, c, use_tiers) is None:
                hit = self._hit(hashes, c)
                hit.checkpoint, hit.checkpoint_in_tier = key, in_tier
                return hit
        return self._hit(hashes, 0)

    def _attention_bound(self, hashes: list[BlockHash], b: int, use_tiers: bool) -> int:
        """The largest hit the attention groups alone accept."""
        for group in self.layout.full_groups:
            b = min(b, self._leading(group, hashes[:b], use_tiers))
        while True:
            missing = self._first_missing(hashes, b, use_tiers)
            if missing is None:
                return b
            b = missing

    def _leading(self, group: KVGroup, hashes: list[BlockHash], use_tiers: bool) -> int:
        """How many leading blocks the pool, then the tiers, hold for a full group."""
        keys = [group_hash(h, group.index) for h in hashes]
        n = 0
        while n < len(keys) and keys[n] in self.pool.cached:
            n += 1
        if use_tiers and n < len(keys):
            n += self.connector.get_computed_blocks(keys[n:])
        return n

    def _first_missing(self, hashes: list[BlockHash], b: int, use_tiers: bool) -> int | None:
        """The first block some sliding group needs for a hit at b and nobody holds."""
        first = None
        for group in self.layout.sliding_groups:
            lo = group.first_needed_block(b * self.block_size, self.block_size) if b else b
            absent = [i for i in range(lo, b) if group_hash(hashes[i], group.index) not in self.pool.cached]
            if absent and use_tiers:
                supplied = self.connector.get_computed_blocks([group_hash(hashes[i], group.index) for i in absent])
                absent = absent[supplied:]
            if absent and (first is None or absent[0] < first):
                first = absent[0]
        return first

    def _hit(self, hashes: list[BlockHash], b: int) -> PrefixHit:
        hit = PrefixHit(b)
        for group in self.layout.groups:
            lo = group.first_needed_block(b * self.block_size, self.block_size) if b else 0
            pool, tiers = [], []
            for i in range(lo, b):
                key = group_hash(hashes[i], group.index)
                block = self.pool.cached.get(key)
                if block is not None:
                    pool.append((i, block))
                else:
                    tiers.append((i, key))
            hit.pool.append(pool)
            hit.tiers.append(tiers)
        return hit
