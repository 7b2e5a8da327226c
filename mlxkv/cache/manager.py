"""Sequence-level block management on top of the block pool.

This is where a prompt meets the pool: prefix lookup (pool first, then the
connector's tiers), slot allocation as tokens are computed, registration of
blocks once they are full, and release. It is also the connector seam: the
three calls of connectors/base.py are made here and nowhere else.
"""

from __future__ import annotations

import logging

from mlxkv.cache.block_pool import Block, BlockPool
from mlxkv.connectors.base import KVCacheConnector, LoadedBlock, NoopKVCacheConnector
from mlxkv.cache.hashing import BlockHash, extend_block_hashes
from mlxkv.cache.kv_pool import KVPool
from mlxkv.cache.sequence import Sequence
from mlxkv.cache.tiers import POOL

log = logging.getLogger(__name__)


# Decode fills a block every block_size tokens. Offered one at a time, each
# costs a pool read and the SSD tier a file with its own fsync: 32 files for
# a 500-token demo reply. Offered in batches of this many (and whatever is
# left when the sequence lets go of its blocks), the same reply is 3 files,
# so a restored conversation reads runs, as a restored prompt does.
STORE_BATCH_BLOCKS = 16


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        kv_pool: KVPool | None = None,
        connector: KVCacheConnector | None = None,
    ):
        # Without a KV pool (pure bookkeeping, as in the pool's property
        # tests) there are no bytes to move, so only the no-op connector fits.
        if connector is not None and kv_pool is None:
            raise ValueError("a connector needs the KV pool to move bytes")
        self.pool = pool
        self.block_size = block_size
        self.kv_pool = kv_pool
        self.connector = connector or NoopKVCacheConnector()
        pool.on_evict = self._on_evict

    def _reader(self, block_ids: list[int]):
        return lambda: self.kv_pool.read_blocks(block_ids)

    def _on_evict(self, blocks: list[Block]) -> None:
        # Read in reverse: a freed sequence's blocks are evicted last first,
        # so reversed they are in prefix order, one run a hydrate copies in
        # stretches; handed over in eviction order, for the tiers' LRU.
        ids = [b.block_id for b in reversed(blocks)]
        try:
            self.connector.evict_blocks([b.block_hash for b in blocks], lambda: self.kv_pool.read_blocks(ids)[::-1])
        except Exception:  # a failed spill loses cached copies, never a request
            log.exception("the connector could not spill %d blocks", len(blocks))

    def _usable_hashes(self, seq: Sequence) -> list[BlockHash]:
        """Hashes of the prompt's full blocks, less the one holding its last token.

        The last prompt token is always computed, so the step that samples
        the first output token has logits.
        """
        extend_block_hashes(seq.block_hashes, seq.hash_root, seq.prompt, self.block_size)
        return seq.block_hashes[: (len(seq.prompt) - 1) // self.block_size]

    def get_computed_blocks(self, seq: Sequence) -> list[Block]:
        """The pool's cached blocks for the prompt's prefix."""
        if seq.hash_root is None:
            return []
        return self.pool.get_computed_blocks(self._usable_hashes(seq))

    def admit(self, seq: Sequence) -> None:
        """Take the prompt's prefix hits from the pool, then from the tiers."""
        hits = self.get_computed_blocks(seq)
        self.pool.touch(hits)
        seq.blocks = list(hits)
        seq.num_cached_blocks = len(hits)
        seq.num_computed = len(hits) * self.block_size
        seq.cached_tokens[POOL] = seq.num_computed
        if seq.hash_root is not None:
            self._hydrate(seq, self._usable_hashes(seq)[len(hits) :])

    def _hydrate(self, seq: Sequence, wanted: list[BlockHash]) -> None:
        n = min(self.connector.get_computed_blocks(wanted), self.pool.num_free)
        if n == 0:
            return
        loaded = self._matching(wanted[:n], self.connector.load_blocks(wanted[:n]))
        if not loaded:
            return
        # Which free block takes which hash is ours to choose: in id order, a
        # run of tier blocks lands on runs of ids, one slice copy per layer.
        blocks = sorted(self.pool.allocate(len(loaded)), key=lambda b: b.block_id)
        self.kv_pool.write_blocks([b.block_id for b in blocks], [l.kv for l in loaded])
        self.pool.cache_blocks(blocks, [l.block_hash for l in loaded])
        seq.blocks.extend(blocks)
        seq.num_cached_blocks += len(blocks)
        seq.num_computed += len(blocks) * self.block_size
        for block in loaded:
            seq.cached_tokens[block.tier] = seq.cached_tokens.get(block.tier, 0) + self.block_size

    @staticmethod
    def _matching(wanted: list[BlockHash], loaded: list[LoadedBlock]) -> list[LoadedBlock]:
        """The leading run of loaded blocks that are the ones asked for, in order."""
        run = []
        for want, block in zip(wanted, loaded):
            if block.block_hash != want:
                break
            run.append(block)
        return run

    def allocate_slots(self, seq: Sequence, num_new: int) -> None:
        """Make sure blocks exist for the next `num_new` tokens of `seq`."""
        needed = blocks_for(seq.num_computed + num_new, self.block_size) - len(seq.blocks)
        if needed > 0:
            seq.blocks.extend(self.pool.allocate(needed))

    def cache_blocks(self, seq: Sequence, *, store_now: bool = True) -> None:
        """Register the blocks that are now full of computed, known tokens.

        The connector gets them at once, or with `store_now=False` (decode)
        once STORE_BATCH_BLOCKS are waiting or the sequence is freed. Until
        then the sequence holds them, so the pool cannot evict them.
        """
        if seq.hash_root is None:
            return
        # Runs after every decode step: only a block that just filled up
        # pays for the token list, so a long context costs no copy per token.
        known = min(seq.num_computed, seq.num_tokens)
        full = known // self.block_size
        if full <= seq.num_cached_blocks:
            return
        extend_block_hashes(seq.block_hashes, seq.hash_root, seq.tokens[:known], self.block_size)
        start = seq.num_cached_blocks
        newly = self.pool.cache_blocks(seq.blocks[start:full], seq.block_hashes[start:full])
        seq.num_cached_blocks = full
        seq.unstored.extend(newly)
        if store_now or len(seq.unstored) >= STORE_BATCH_BLOCKS:
            self._store(seq)

    def _store(self, seq: Sequence) -> None:
        blocks, seq.unstored = seq.unstored, []
        if not blocks:
            return
        try:
            self.connector.cache_blocks([b.block_hash for b in blocks], self._reader([b.block_id for b in blocks]))
        except Exception:  # a lost copy, as with a spill; free() must still free
            log.exception("the connector could not store %d blocks", len(blocks))

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, last first, so they are evicted first."""
        self._store(seq)
        self.pool.free(reversed(seq.blocks))
        seq.blocks = []
