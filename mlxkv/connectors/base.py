"""The KV cache connector seam.

The engine calls a connector at exactly three points:

1. prefix lookup (`get_computed_blocks`, then `load_blocks` to hydrate):
   after the pool's own hits, the connector says how many of the next blocks
   it can supply; the pool allocates local blocks for them, the connector's
   K/V are written in, and they become ordinary cached blocks;
2. block registration (`cache_blocks`): blocks that just became full;
3. eviction (`evict_block`): the pool is about to reuse a cached block.

The block pool stays the only owner of local blocks: a connector only ever
holds copies of bytes, keyed by block hash. K/V bytes are read lazily, through
a `read` callable, so a connector that does not want them costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Protocol, runtime_checkable

import mlx.core as mx

from mlxkv.hashing import BlockHash


@dataclass
class BlockKV:
    """One block's K and V for every layer: `[num_layers, n_kv_heads, block_size, head_dim]`.

    `run` and `index` say where the block sits when it is a view of a
    `KVRun`: the pool then copies a stretch of consecutive blocks of one run
    with one slice per layer instead of one copy per block.
    """

    keys: mx.array
    values: mx.array
    run: KVRun | None = None
    index: int = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@dataclass(eq=False)
class KVRun:
    """Consecutive blocks' K and V, layer-major: `[num_layers, n, n_kv_heads, block_size, head_dim]`.

    Layer-major so each layer's share of the run is one contiguous slab, the
    shape of a slice of that layer's pool. Never written after it is made:
    tiers share runs by reference.
    """

    keys: mx.array
    values: mx.array

    @classmethod
    def stack(cls, blocks: Sequence[BlockKV]) -> KVRun:
        """A new run holding copies of these blocks, in order (lazy)."""
        return cls(mx.stack([b.keys for b in blocks], axis=1), mx.stack([b.values for b in blocks], axis=1))

    def __len__(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def block(self, i: int) -> BlockKV:
        return RunBlock(self, i)

    def blocks(self) -> list[BlockKV]:
        return [self.block(i) for i in range(len(self))]


class RunBlock(BlockKV):
    """Block `index` of a KVRun. Its K/V slices are made when first asked for:
    a hydrate copies whole stretches of the run and never asks (two MLX ops
    per block were a tenth of an SSD hydrate's time)."""

    def __init__(self, run: KVRun, index: int):
        self.run, self.index = run, index

    @cached_property
    def keys(self) -> mx.array:
        return self.run.keys[:, self.index]

    @cached_property
    def values(self) -> mx.array:
        return self.run.values[:, self.index]

    @property
    def nbytes(self) -> int:
        return self.run.nbytes // len(self.run)


@dataclass
class LoadedBlock:
    block_hash: BlockHash
    kv: BlockKV
    tier: str  # "memory" or "disk": where the hit came from


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
class KvCacheConnector(Protocol):
    def get_computed_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes of `block_hashes` this connector can supply."""

    def load_blocks(self, block_hashes: Sequence[BlockHash]) -> list[LoadedBlock]:
        """Hydrate: K/V for the leading hashes it still has, intact.

        May return fewer than asked (a file vanished or failed its checksum);
        the engine recomputes the rest, never serves wrong KV.
        """

    def cache_blocks(self, block_hashes: Sequence[BlockHash], read: ReadKV) -> None:
        """Blocks that just became full and were registered in the pool."""

    def evict_block(self, block_hash: BlockHash, read: ReadKV) -> None:
        """The pool is about to overwrite this cached block."""

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters per tier name."""

    def close(self) -> None:
        """Finish pending work (e.g. background writes)."""


class NoopKvCacheConnector:
    """The default: supplies nothing, stores nothing, reads no bytes."""

    def get_computed_blocks(self, block_hashes):
        return 0

    def load_blocks(self, block_hashes):
        return []

    def cache_blocks(self, block_hashes, read):
        pass

    def evict_block(self, block_hash, read):
        pass

    def stats(self):
        return {}

    def close(self):
        pass
