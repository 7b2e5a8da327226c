"""A sequence: one admission of a request, its tokens and how far the pool has them.

The blocks that hold its KV belong to the layer groups' managers
(groups/), and a hybrid model's recurrent state to the recurrent manager;
the sequence is only the tokens and the progress, each field with one
writer: the coordinator (coordinator.py) writes the cache's fields, the
request (engine/request.py) appends the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxkv.cache.hashing import BlockHash
from mlxkv.cache.tiers import no_reuse


@dataclass(eq=False)
class Sequence:
    request_id: int
    prompt: list[int]  # every token known at admission (a resumed request's output included)
    # Root of the hash chain; None when prefix caching is off.
    hash_root: BlockHash | None
    # Hashes of the full blocks of tokens hashed so far (the prompt's at admission).
    block_hashes: list[BlockHash] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    # Tokens whose KV has been written to the pool (or came from a hit).
    num_computed: int = 0
    # Leading blocks registered in the pool's hash map.
    num_cached_blocks: int = 0
    # Prompt tokens reused instead of computed, by where they came from.
    cached_tokens: dict[str, int] = field(default_factory=no_reuse)
    # Restore or recompute (cache/restore_cost.py): what was chosen for the hit's tier
    # blocks, and the hit's tokens recomputed because reading them would take longer.
    restore_choice: str = ""
    recomputed_hit: int = 0

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
    def num_reused(self) -> int:
        return sum(self.cached_tokens.values())
