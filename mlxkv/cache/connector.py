"""The KV cache connector seam: the protocol the tiers implement (connectors/).

The seam is the cache's: the coordinator (coordinator.py) calls a connector
at exactly three points, and nowhere else does:

1. prefix lookup (`get_computed_blocks`, then `begin_load` or `load_blocks`
   to hydrate): after the pool's own hits, the connector says how many of
   the next blocks it can supply; the pool allocates local blocks for them,
   a load job reads the connector's K/V off the engine thread and the
   engine installs them a slice a step (tier_loads.py), and they become
   ordinary cached blocks;
2. block registration (`cache_blocks`): blocks that just became full;
3. eviction (`evict_blocks`): the pool is about to reuse cached blocks.

The block pool stays the only owner of local blocks: a connector only ever
holds copies of bytes, keyed by block hash. K/V bytes are read lazily, through
a `read` callable, so a connector that does not want them costs nothing.

A hybrid model's recurrent-state checkpoints (cache/checkpoints.py) meet
the connector at the same three points: `has_checkpoint` and
`load_checkpoint` at lookup, `cache_checkpoint` when one is written through
(the SSD tier keeps it, so it survives a restart), `evict_checkpoint` when
the pool's checkpoint store lets one go. `checkpoint_refs` tells the
coordinator's checkpoint index of the ones a tier found on its own (an SSD
tier's files from an earlier run), so a lookup never probes a tier per
block boundary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

from mlxkv.cache.block_kv import BlockKV
from mlxkv.cache.checkpoints import Checkpoint, CheckpointRef, States
from mlxkv.cache.hashing import BlockHash


@dataclass
class LoadedBlock:
    block_hash: BlockHash
    kv: BlockKV
    tier: str  # tiers.MEMORY or tiers.DISK: where the hit came from


@dataclass
class LoadedCheckpoint:
    key: BlockHash
    states: States
    tier: str


# Reads the bytes of the blocks named in the call that hands it over.
ReadKV = Callable[[], list[BlockKV]]


class LoadJob(Protocol):
    """A prefix hit's tier blocks on their way into the pool (cache/tier_loads.py).

    `run` reads them on the loader thread into staging memory (numpy,
    bytes: never MLX, whose state is the engine thread's); `take` hands the
    engine thread the next ones as MLX, about `max_bytes` at a time, in key
    order, and [] once there are no more (all taken, or a copy was gone or
    bad: fewer than asked is a shortfall the engine recomputes). `reads`:
    (tier, bytes, seconds) of each read, for the restore-or-recompute estimates.
    """

    reads: list[tuple[str, int, float]]

    def run(self) -> None: ...

    def take(self, max_bytes: int) -> list[LoadedBlock]: ...


class SyncLoad:
    """A load with nothing to do off the engine thread: the connector's own `load_blocks`, at the
    first `take` (a tier in memory, or a connector without `begin_load`), then handed out in slices."""

    def __init__(self, connector, block_hashes: Sequence[BlockHash]):
        self.connector, self.block_hashes = connector, list(block_hashes)
        self.reads: list[tuple[str, int, float]] = []
        self._loaded: list[LoadedBlock] | None = None

    def run(self) -> None:
        pass

    def take(self, max_bytes: int) -> list[LoadedBlock]:
        if self._loaded is None:
            start = time.perf_counter()
            self._loaded = self.connector.load_blocks(self.block_hashes) if self.block_hashes else []
            if self._loaded:
                nbytes = sum(b.kv.nbytes for b in self._loaded)
                self.reads.append((self._loaded[0].tier, nbytes, time.perf_counter() - start))
        out, used = [], 0
        while self._loaded and (not out or used < max_bytes):
            block = self._loaded.pop(0)
            out.append(block)
            used += block.kv.nbytes
        return out


def begin_load(connector, block_hashes: Sequence[BlockHash]) -> LoadJob:
    """The connector's own load job where it has one (`begin_load`), else a SyncLoad."""
    begin = getattr(connector, "begin_load", None)
    return begin(block_hashes) if begin is not None else SyncLoad(connector, block_hashes)


class CheckpointLoad:
    """A hit's checkpoint on its way from a tier (cache/tier_loads.py), as a LoadJob is for blocks.

    `run` (loader thread) reads and verifies it into staging memory through
    `stage` (numpy: never MLX); `take` (engine thread) makes it MLX, and does
    the tier's own bookkeeping, through `finish`; None if it was gone or bad.
    """

    def __init__(self, key: BlockHash, tier: str, stage: Callable[[], object | None],
                 finish: Callable[[object], States]):
        self.key, self.tier, self._stage, self._finish = key, tier, stage, finish
        self._staged: object | None = None

    def run(self) -> None:
        self._staged = self._stage()

    @property
    def staged(self) -> bool:
        return self._staged is not None

    def take(self) -> LoadedCheckpoint | None:
        staged, self._staged = self._staged, None
        return None if staged is None else LoadedCheckpoint(self.key, self._finish(staged), self.tier)


class SyncCheckpointLoad:
    """A checkpoint load with nothing to do off the engine thread: the connector's own
    `load_checkpoint` at `take` (a tier in memory, or a connector without `begin_checkpoint_load`)."""

    def __init__(self, connector, key: BlockHash):
        self.connector, self.key = connector, key

    def run(self) -> None:
        pass

    def take(self) -> LoadedCheckpoint | None:
        return self.connector.load_checkpoint(self.key)


def begin_checkpoint_load(connector, key: BlockHash) -> CheckpointLoad | SyncCheckpointLoad:
    """The connector's own checkpoint load where it has one (`begin_checkpoint_load`), else a sync one."""
    begin = getattr(connector, "begin_checkpoint_load", None)
    return begin(key) if begin is not None else SyncCheckpointLoad(connector, key)


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
    checkpoints: int = 0  # recurrent-state checkpoints held
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

    # Optional: `wants_spill(block_hash) -> bool`, whether an evicted block's bytes
    # are wanted (else the pool skips reading them); `begin_load(block_hashes) ->
    # LoadJob`, a load read off the engine thread (else a SyncLoad);
    # `begin_checkpoint_load(key) -> CheckpointLoad`, the same for a checkpoint.

    def has_checkpoint(self, key: BlockHash) -> bool:
        """Whether this connector can supply the checkpoint."""

    def load_checkpoint(self, key: BlockHash) -> LoadedCheckpoint | None:
        """The checkpoint's states, intact, or None (gone, or failed its checksum)."""

    def cache_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Keep this checkpoint where it survives a restart (the write policy chose it)."""

    def evict_checkpoint(self, checkpoint: Checkpoint) -> None:
        """The pool's store is letting this checkpoint go."""

    def checkpoint_refs(self) -> list[CheckpointRef]:
        """Checkpoints this connector found on its own since the last call (e.g. files of an earlier run)."""

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

    def has_checkpoint(self, key):
        return False

    def load_checkpoint(self, key):
        return None

    def cache_checkpoint(self, checkpoint):
        pass

    def evict_checkpoint(self, checkpoint):
        pass

    def checkpoint_refs(self):
        return []

    def stats(self):
        return {}

    def close(self):
        pass
