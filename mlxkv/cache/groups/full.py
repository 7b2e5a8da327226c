"""Full attention: every query attends to every earlier token.

A hit at b needs blocks 0..b-1, so the longest hit is the longest leading
run of blocks the pool, then the tiers, hold. A prompt's slots are all
taken at admission, so its prefill never waits for a block.
"""

from __future__ import annotations

from mlxkv.cache.groups.base import AttentionManager, Presence, blocks_for
from mlxkv.cache.hashing import BlockHash


class FullAttentionManager(AttentionManager):
    def first_needed(self, position: int) -> int:
        return 0

    def longest_hit(self, hashes: list[BlockHash], limit: int, presence: Presence) -> int:
        return presence.leading([self.key(h) for h in hashes[:limit]])

    def slots_ahead(self) -> bool:
        return True

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        return blocks_for(num_tokens, self.block_size)
