"""One attention group's block tables: a table per running sequence, and what waits to be stored.

Entry i of a table is the block of the sequence's i-th block of tokens,
or None where the group never needed it (a hit started past it) or let
go of it (a sliding window moved past). Blocks registered in the pool but
not yet offered to the tiers wait here (`unstored`) until the coordinator
stores them (tier_writes.py). The manager (base.py) decides by its rule
what to add and drop; this class only keeps the record, and hands back
the blocks it lets go of for the pool to free.
"""

from __future__ import annotations

from mlxkv.cache.block_pool import Block


class SequenceTables:
    def __init__(self):
        self._tables: dict[int, list[Block | None]] = {}  # request id -> table
        self._unstored: dict[int, list[Block]] = {}  # registered, not yet offered to the connector

    def start(self, request_id: int, table: list[Block | None]) -> None:
        self._tables[request_id] = table
        self._unstored[request_id] = []

    def table(self, request_id: int) -> list[Block | None]:
        return self._tables[request_id]

    def extend(self, request_id: int, blocks: list[Block]) -> None:
        self._tables[request_id].extend(blocks)

    def trim(self, request_id: int, num_blocks: int) -> list[Block]:
        """Cut the table to `num_blocks` entries; returns the held blocks cut, for the pool to free."""
        table = self._tables[request_id]
        cut = [b for b in table[num_blocks:] if b is not None]
        del table[num_blocks:]
        return cut

    def drop(self, request_id: int, indices: list[int]) -> list[Block]:
        """Let go of these blocks of the table; returns them, for the pool to free."""
        table = self._tables[request_id]
        blocks = [table[i] for i in indices]
        for i in indices:
            table[i] = None
        return blocks

    def add_unstored(self, request_id: int, blocks: list[Block]) -> int:
        """Blocks just registered; returns how many are waiting to be stored."""
        self._unstored[request_id].extend(blocks)
        return len(self._unstored[request_id])

    def has_unstored(self, request_id: int, indices: list[int]) -> bool:
        unstored = self._unstored[request_id]
        table = self._tables[request_id]
        return any(table[i] in unstored for i in indices)

    def take_unstored(self, request_id: int) -> list[Block]:
        blocks, self._unstored[request_id] = self._unstored[request_id], []
        return blocks

    def release(self, request_id: int) -> list[Block | None]:
        """The sequence leaves: its table, for the coordinator to free."""
        self._unstored.pop(request_id, None)
        return self._tables.pop(request_id)

    def held(self, request_id: int) -> list[Block]:
        return [b for b in self._tables.get(request_id, ()) if b is not None]
