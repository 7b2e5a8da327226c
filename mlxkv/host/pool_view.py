"""What the block pool looks like right now, and what the current turn did to it.

A `PoolSnapshot` is plain data for a UI: one state character per block
(see `BlockPool.block_states`), one event mark per block, pool usage and the
tiers' counters. `PoolWatcher` makes snapshots; it runs on the engine thread,
the only thread that may read the pool.

Marks say what happened to a block since `PoolWatcher.begin()` (the start of
a turn): a prefix hit in the pool, a block hydrated from the memory, SSD or
remote tier, a block computed new, or a cached block evicted to make room (spilled
to a tier when one is on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxkv.cache.tiers import DISK, MEMORY, POOL, REMOTE

MARK_NONE = " "
MARK_POOL_HIT = "p"
MARK_MEMORY = "m"
MARK_DISK = "d"
MARK_REMOTE = "r"
MARK_NEW = "n"
MARK_SPILL = "x"
# Where a sequence's blocks came from, in block-table order: the cache
# manager takes pool hits first, then hydrates from memory, then from disk.
_SOURCES = ((POOL, MARK_POOL_HIT), (MEMORY, MARK_MEMORY), (DISK, MARK_DISK), (REMOTE, MARK_REMOTE))


@dataclass(frozen=True)
class PoolSnapshot:
    states: str  # per block: '.' free, 'c' cached-free, 'u' in use, 's' shared
    marks: str  # per block: one of the MARK_* characters
    usage: dict[str, int]  # BlockPool.usage()
    tiers: dict[str, dict[str, int]]  # connector stats per tier name
    block_size: int
    requests: int = 0
    mark_counts: dict[str, int] = field(default_factory=dict)
    kv_format: str = ""  # how the pool stores K/V: the dtype ("float16"), or "q8g64" (cache/kv_format.py)
    kv_bytes_per_token: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.states)


class PoolWatcher:
    """Snapshots of an engine core's pool, with marks for the turn since `begin()`.

    `core` is an EngineCore (engine/core.py): its `block_pool`, its running
    sequences' block tables (`running_tables()`), its tiers' counters
    (`tier_stats()`) and `requests_served`, read at each snapshot.
    """

    def __init__(self, core):
        self.core = core
        layout = core.kv_layout
        self.block_size, self.kv_format, self.kv_bytes_per_token = (layout.block_size, layout.kv_format,
                                                                    layout.bytes_per_token)
        self.begin()

    @classmethod
    def of(cls, engine) -> PoolWatcher:
        """The watcher of an Engine's core."""
        return cls(engine.core)

    @property
    def pool(self):
        return self.core.block_pool

    def begin(self) -> None:
        blocks = self.pool.blocks
        self._hashes = [b.block_hash for b in blocks]
        self._marks = bytearray(MARK_NONE.encode() * len(blocks))

    def snapshot(self) -> PoolSnapshot:
        pool = self.pool
        if len(pool.blocks) < len(self._marks):  # the pool shrank while idle: its blocks moved, marks start over
            self.begin()
        grown = len(pool.blocks) - len(self._marks)
        if grown > 0:  # the pool grew (block_pool.py): its new blocks held nothing at begin()
            self._marks += MARK_NONE.encode() * grown
            self._hashes += [None] * grown
        self._mark_spills(pool.blocks)
        for cached_tokens, table in self.core.running_tables():
            self._mark_sequence(cached_tokens, table, self.block_size)
        marks = self._marks.decode()
        return PoolSnapshot(
            states=pool.block_states(),
            marks=marks,
            usage=pool.usage(),
            tiers=self.core.tier_stats(),
            block_size=self.block_size,
            requests=self.core.requests_served,
            mark_counts={m: marks.count(m) for m in (MARK_POOL_HIT, MARK_MEMORY, MARK_DISK, MARK_REMOTE, MARK_NEW,
                                                     MARK_SPILL)},
            kv_format=self.kv_format,
            kv_bytes_per_token=self.kv_bytes_per_token,
        )

    def _mark_spills(self, blocks) -> None:
        """A block whose cached hash changed since begin() was evicted."""
        spill = ord(MARK_SPILL)
        for block, old in zip(blocks, self._hashes):
            if old is not None and block.block_hash != old:
                self._marks[block.block_id] = spill

    def _mark_sequence(self, cached_tokens: dict, table: list, block_size: int) -> None:
        ends, total = [], 0
        for source, mark in _SOURCES:
            total += cached_tokens.get(source, 0) // block_size
            ends.append((total, ord(mark)))
        new = ord(MARK_NEW)
        for i, block in enumerate(table):
            if block is None:
                continue  # a sliding window let go of it, or a hit never needed it
            if self._marks[block.block_id] == ord(MARK_SPILL):
                continue  # it was evicted first; the spill is the news
            self._marks[block.block_id] = next((m for end, m in ends if i < end), new)
