"""Sequence-level block management on top of the block pool.

This is where a prompt meets the pool: prefix lookup, slot allocation as
tokens are computed, registration of blocks once they are full, and release.
"""

from __future__ import annotations

from mlxkv.block_pool import BlockPool
from mlxkv.hashing import extend_block_hashes
from mlxkv.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size

    def get_computed_blocks(self, seq: Sequence):
        """The pool's cached blocks for the prompt's prefix.

        Never the whole prompt: its last token is always computed, so the
        step that samples the first output token has logits.
        """
        if seq.hash_root is None:
            return []
        extend_block_hashes(seq.block_hashes, seq.hash_root, seq.prompt, self.block_size)
        usable = (len(seq.prompt) - 1) // self.block_size
        return self.pool.get_computed_blocks(seq.block_hashes[:usable])

    def admit(self, seq: Sequence) -> None:
        """Take the prompt's prefix hits; they become the sequence's first blocks."""
        hits = self.get_computed_blocks(seq)
        self.pool.touch(hits)
        seq.blocks = list(hits)
        seq.num_cached_blocks = len(hits)
        seq.num_computed = len(hits) * self.block_size
        seq.cached_tokens["pool"] = seq.num_computed

    def allocate_slots(self, seq: Sequence, num_new: int) -> None:
        """Make sure blocks exist for the next `num_new` tokens of `seq`."""
        needed = blocks_for(seq.num_computed + num_new, self.block_size) - len(seq.blocks)
        if needed > 0:
            seq.blocks.extend(self.pool.allocate(needed))

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the blocks that are now full of computed, known tokens."""
        if seq.hash_root is None:
            return
        tokens = seq.tokens
        known = min(seq.num_computed, len(tokens))
        full = known // self.block_size
        if full <= seq.num_cached_blocks:
            return
        extend_block_hashes(seq.block_hashes, seq.hash_root, tokens[:known], self.block_size)
        start = seq.num_cached_blocks
        self.pool.cache_blocks(seq.blocks[start:full], seq.block_hashes[start:full])
        seq.num_cached_blocks = full

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, last first, so they are evicted first."""
        self.pool.free(reversed(seq.blocks))
        seq.blocks = []
