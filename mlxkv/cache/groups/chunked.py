"""Chunked local attention (Llama 4): a query sees only the tokens of its own chunk.

Positions are cut into chunks of `chunk` tokens; a query attends to the
earlier tokens of its chunk and nothing before it. So the blocks before
the next token's chunk start are let go of as a sliding window's are
(once registered, so they stay cached and spill), and a hit at block b
needs only the blocks from the start of the chunk token b x block_size
falls in: none at all when it lands on a chunk's first token.
"""

from __future__ import annotations

from mlxkv.cache.groups.base import blocks_for
from mlxkv.cache.groups.sliding import SlidingWindowManager


class ChunkedAttentionManager(SlidingWindowManager):
    @property
    def chunk(self) -> int:
        return self.group.chunk

    def first_needed(self, position: int) -> int:
        return (position - position % self.chunk) // self.block_size

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        # The chunk so far behind a prefill chunk, that chunk, and a partial block at each end.
        total = blocks_for(num_tokens, self.block_size)
        return min(total, blocks_for(self.chunk + min(chunk, num_tokens), self.block_size) + 1)
