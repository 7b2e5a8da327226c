"""A sequence: one request's tokens and the blocks that hold their KV.

It holds a block table per layer group (layer_groups.py). A table's
entry i is the block of the sequence's i-th block of tokens in that
group, or None where a sliding-window group has let go of it (the window
has moved past) or never needed it (a prefix hit started past it).

A hybrid model's sequence also carries its recurrent layers' state, and
the states it had at the last block boundaries it crossed: the
checkpoints it may leave behind (checkpoints.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxkv.cache.block_pool import Block
from mlxkv.cache.checkpoints import States
from mlxkv.cache.hashing import BlockHash
from mlxkv.cache.tiers import no_reuse


@dataclass(eq=False)
class Sequence:
    request_id: int
    prompt: list[int]
    # Root of the hash chain; None when prefix caching is off.
    hash_root: BlockHash | None
    output: list[int] = field(default_factory=list)
    tables: list[list[Block | None]] = field(default_factory=lambda: [[]])
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Tokens whose KV has been written to the pool (or came from a hit).
    num_computed: int = 0
    # Leading blocks registered in the pool's hash map.
    num_cached_blocks: int = 0
    # Registered blocks not yet offered to the connector, per group
    # (manager.py batches the ones decode fills).
    unstored: list[list[Block]] = field(default_factory=lambda: [[]])
    # Prompt tokens reused instead of computed, by where they came from.
    cached_tokens: dict[str, int] = field(default_factory=no_reuse)
    # Recurrent slots' state arrays (batch of one); None: not started.
    states: States | None = None
    # States at the block boundaries (in tokens) a forward ended on, newest last.
    snapshots: dict[int, States] = field(default_factory=dict)
    # The boundary of the newest checkpoint this sequence has registered,
    # and that checkpoint (key, states): the SSD tier gets it when the sequence leaves.
    checkpointed: int = 0
    last_checkpoint: tuple[BlockHash, States, int] | None = None  # (key, states, boundary)
    # The boundary of the newest checkpoint of this chain known to be on the
    # SSD tier (checkpoints.py: the write policy's anchor).
    disk_anchor: int = 0

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
    def blocks(self) -> list[Block | None]:
        """Group 0's table: a plain model's only one."""
        return self.tables[0]

    @blocks.setter
    def blocks(self, blocks: list[Block | None]) -> None:
        self.tables[0] = blocks

    @property
    def block_table(self) -> list[int]:
        """Group 0's block ids (a plain model holds every block it has computed)."""
        return [b.block_id for b in self.blocks]

    def held(self) -> list[Block]:
        """Every block the sequence holds a reference to, in every group."""
        return [b for table in self.tables for b in table if b is not None]

    @property
    def num_reused(self) -> int:
        return sum(self.cached_tokens.values())
