"""The KV cache connector seam.

The engine calls a connector at exactly three points:

1. prefix lookup (`get_computed_blocks`, then `load_blocks` to hydrate):
   after the pool's own hits, the connector says how many of the next blocks
   it can supply; the pool allocates local blocks for them, the connector's
   K/V are written in, and they become ordinary cached blocks;
2. block registration (`cache_blocks`): blocks that just became full;
3. eviction (`evict_blocks`): the pool is about to reuse cached blocks.

The block pool stays the only owner of local blocks: a connector only ever
holds copies of bytes, keyed by block hash. K/V bytes are read lazily, through
a `read` callable, so a connector that does not want them costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

from mlxkv.cache.block_kv import BlockKV
from mlxkv.cache.hashing import BlockHash


@dataclass
class LoadedBlock:
    block_hash: BlockHash
    kv: BlockKV
    tier: str  # tiers.MEMORY or tiers.DISK: where the hit came from


# Reads the bytes of the blocks named in the call that hands it over.
ReadKV = Callable[[], list[BlockKV]]


@dataclass
class TierStats:
    lookups: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    stores: int = 0
    evictions: int = 0
    spills: int = 0
    hydrations: int = 0
    bytes_held: int = 0
    blocks_held: int = 0
    corrupt: int = 0
    write_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@runtime_checkable
class KVCacheConnector(Protocol):
    def get_computed_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes of `block_hashes` this connector can supply."""

    def load_blocks(self, block_hashes: Sequence[BlockHash]) -> list[LoadedBlock]:
        """Hydrate: K/V for the leading hashes it still has, intact.

        May return fewer than asked (a file vanished or failed its checksum);
        the engine recomputes the rest, never serves wrong KV.
        """

    def cache_blocks(self, block_hashes: Sequence[BlockHash], read: ReadKV) -> None:
        """Blocks that just became full and were registered in the pool."""

    def evict_blocks(self, block_hashes: Sequence[BlockHash], read: ReadKV) -> None:
        """The pool is about to overwrite these cached blocks, least recently used
        first. `read()` gives their K/V in that order, read from the pool at once."""

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters per tier name."""

    def close(self) -> None:
        """Finish pending work (e.g. background writes)."""


class NoopKVCacheConnector:
    """The default: supplies nothing, stores nothing, reads no bytes."""

    def get_computed_blocks(self, block_hashes):
        return 0

    def load_blocks(self, block_hashes):
        return []

    def cache_blocks(self, block_hashes, read):
        pass

    def evict_blocks(self, block_hashes, read):
        pass

    def stats(self):
        return {}

    def close(self):
        pass
