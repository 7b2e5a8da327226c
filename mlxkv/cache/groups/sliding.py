"""Sliding-window attention: a query sees only the last `window` positions (itself included).

A hit at b needs only the blocks holding the window before token
b x block_size. Scanning down from a bound, a missing block m caps the hit
at m (every larger hit still needs m), as vLLM's sliding-window manager
does. A running sequence lets go of the blocks its window has passed, once
registered, so they stay cached (and spill) without holding the pool: a
long prompt holds a window and a chunk, its slots taken a chunk at a time.
"""

from __future__ import annotations

from mlxkv.cache.groups.base import AttentionManager, Presence, blocks_for
from mlxkv.cache.hashing import BlockHash


class SlidingWindowManager(AttentionManager):
    @property
    def window(self) -> int:
        return self.group.window

    def first_needed(self, position: int) -> int:
        return max(0, position - self.window + 1) // self.block_size

    def longest_hit(self, hashes: list[BlockHash], limit: int, presence: Presence) -> int:
        b = limit
        while b > 0:
            lo = self.first_needed(b * self.block_size)
            missing = presence.first_absent([self.key(h) for h in hashes[lo:b]])
            if missing is None:
                return b
            b = lo + missing
        return 0

    def slots_ahead(self) -> bool:
        return False

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        # The window behind a chunk, the chunk, and a partial block at each end.
        total = blocks_for(num_tokens, self.block_size)
        return min(total, blocks_for(self.window + min(chunk, num_tokens), self.block_size) + 1)
