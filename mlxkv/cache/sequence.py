"""A sequence: one request's tokens and the blocks that hold their KV."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxkv.cache.block_pool import Block
from mlxkv.cache.hashing import BlockHash
from mlxkv.cache.tiers import no_reuse


@dataclass(eq=False)
class Sequence:
    request_id: int
    prompt: list[int]
    # Root of the hash chain; None when prefix caching is off.
    hash_root: BlockHash | None
    output: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Tokens whose KV has been written to the pool (or came from a hit).
    num_computed: int = 0
    # Leading blocks registered in the pool's hash map.
    num_cached_blocks: int = 0
    # Registered blocks not yet offered to the connector (cache_manager.py
    # batches the ones decode fills).
    unstored: list[Block] = field(default_factory=list)
    # Prompt tokens reused instead of computed, by where they came from.
    cached_tokens: dict[str, int] = field(default_factory=no_reuse)

    @property
    def tokens(self) -> list[int]:
        """A new list of every token: O(length), so not for per-step code (see num_tokens)."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def block_table(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def num_reused(self) -> int:
        return sum(self.cached_tokens.values())
