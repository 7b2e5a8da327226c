"""Sequence-level block management on top of the block pool.

This is where a prompt meets the pool: prefix lookup (pool first, then the
connector's tiers; prefix_lookup.py), slot allocation as tokens are
computed, registration of blocks once they are full, and release. It is
also the connector seam: the three calls of connectors/base.py are made
here and nowhere else.

A sequence holds a block table per layer group (layer_groups.py). Every
group registers the same blocks of tokens as they fill, each under its
own key (hashing.group_hash); a sliding-window group lets go of the
blocks its window has passed, so they stay cached (and spill to the tiers
when evicted) without holding the pool.

A hybrid model's recurrent state is checkpointed where a later request
will resume (checkpoints.py): every `checkpoint_interval` tokens of a
prefill (its chunks end there), at the prompt's last full block, and at
the last full block a sequence has computed when it leaves.
"""

from __future__ import annotations

import logging

from mlxkv.cache.block_pool import Block, BlockPool
from mlxkv.cache.checkpoints import CheckpointStore, States, checkpoint_key
from mlxkv.cache.hashing import BlockHash, extend_block_hashes, group_hash
from mlxkv.cache.kv_pool import KVPool
from mlxkv.cache.layer_groups import GroupLayout, KVGroup
from mlxkv.cache.prefix_lookup import PrefixHit, PrefixLookup
from mlxkv.cache.sequence import Sequence
from mlxkv.cache.tiers import DISK, POOL, TIERS
from mlxkv.connectors.base import KVCacheConnector, NoopKVCacheConnector

log = logging.getLogger(__name__)

# Decode fills a block every block_size tokens. Offered one at a time, each
# costs a pool read and the SSD tier a file with its own fsync. Offered in
# batches of this many (and whatever is left when the sequence lets go of
# its blocks), a restored conversation reads runs, as a restored prompt does.
STORE_BATCH_BLOCKS = 16
# Hydrates that find a tier's copy gone or bad look again this often, then
# settle for what the pool holds.
HYDRATE_ATTEMPTS = 3


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        kv_pool: KVPool | None = None,
        connector: KVCacheConnector | None = None,
        layout: GroupLayout | None = None,
        checkpoints: CheckpointStore | None = None,
        checkpoint_interval: int = 2048,
    ):
        # Without a KV pool (pure bookkeeping, as in the pool's property
        # tests) there are no bytes to move, so only the no-op connector fits.
        if connector is not None and kv_pool is None:
            raise ValueError("a connector needs the KV pool to move bytes")
        self.pool = pool
        self.block_size = block_size
        self.kv_pool = kv_pool
        self.connector = connector or NoopKVCacheConnector()
        self.layout = layout or GroupLayout.plain(kv_pool.layout.num_layers if kv_pool else 1)
        self.checkpoints = checkpoints
        if checkpoints is not None:
            checkpoints.on_evict = self._on_evict_checkpoint
        # Whole blocks, at least one.
        self.checkpoint_interval = max(1, checkpoint_interval // block_size) * block_size
        self.lookup = PrefixLookup(pool, self.layout, block_size, self.connector, checkpoints)
        pool.on_evict = self._on_evict

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        return self.layout.groups

    def _reader(self, blocks: list[Block]):
        ids, groups = [b.block_id for b in blocks], [b.group for b in blocks]
        return lambda: self.kv_pool.read_blocks(ids, groups)

    def _on_evict(self, blocks: list[Block]) -> None:
        # Read in reverse: a freed sequence's blocks are evicted last first,
        # so reversed they are in prefix order, one run a hydrate copies in
        # stretches; handed over in eviction order, for the tiers' LRU.
        read = self._reader(blocks[::-1])
        try:
            self.connector.evict_blocks([b.block_hash for b in blocks], lambda: read()[::-1])
        except Exception:  # a failed spill loses cached copies, never a request
            log.exception("the connector could not spill %d blocks", len(blocks))

    def _on_evict_checkpoint(self, key: BlockHash, states: States) -> None:
        try:
            self.connector.evict_checkpoint(key, states)
        except Exception:  # as for blocks: a lost copy, never a request
            log.exception("the connector could not spill a checkpoint")

    # -- admission ------------------------------------------------------------

    def _usable_hashes(self, seq: Sequence) -> list[BlockHash]:
        """Hashes of the prompt's full blocks, less the one holding its last token.

        The last prompt token is always computed, so the step that samples
        the first output token has logits.
        """
        extend_block_hashes(seq.block_hashes, seq.hash_root, seq.prompt, self.block_size)
        return seq.block_hashes[: (len(seq.prompt) - 1) // self.block_size]

    def pool_hit(self, seq: Sequence) -> PrefixHit:
        """The prefix hit the pool alone holds for the prompt (no tier is asked)."""
        if seq.hash_root is None:
            return PrefixHit(0, [[] for _ in self.groups], [[] for _ in self.groups])
        return self.lookup.find(self._usable_hashes(seq), use_tiers=False)

    def get_computed_blocks(self, seq: Sequence) -> list[Block]:
        """The pool's cached blocks for the prompt's prefix, in group 0."""
        return [block for _, block in self.pool_hit(seq).pool[0]]

    def admit(self, seq: Sequence) -> None:
        """Take the prompt's prefix hit from the pool and the tiers."""
        seq.tables = [[] for _ in self.groups]
        seq.unstored = [[] for _ in self.groups]
        seq.num_computed = seq.num_cached_blocks = seq.checkpointed = seq.disk_anchor = 0
        seq.states, seq.snapshots, seq.last_checkpoint = None, {}, None
        if seq.hash_root is None:
            return
        hashes = self._usable_hashes(seq)
        for _ in range(HYDRATE_ATTEMPTS):
            hit = self.lookup.find(hashes)
            if not self._room_for(hit):
                break  # computing those blocks would not fit either: the scheduler waits or preempts
            if self._take(seq, hit):
                return
        self._take(seq, self.lookup.find(hashes, use_tiers=False))

    def _room_for(self, hit: PrefixHit) -> bool:
        """Whether the pool can take the hit's tier blocks beside its own."""
        unreferenced = sum(1 for pool in hit.pool for _, block in pool if block.ref_count == 0)
        return sum(len(t) for t in hit.tiers) <= self.pool.num_free - unreferenced

    def _take(self, seq: Sequence, hit: PrefixHit) -> bool:
        """Hold the hit's blocks; False (holding nothing) if a tier could not supply its share."""
        b = hit.num_blocks
        states, state_tier = self._checkpoint_of(hit)
        if hit.checkpoint is not None and states is None:
            return False
        touched = [block for pool in hit.pool for _, block in pool]
        self.pool.touch(touched)
        tables = [[None] * b for _ in self.groups]
        for group, pool in zip(self.groups, hit.pool):
            for i, block in pool:
                tables[group.index][i] = block
        sources = [POOL] * b
        loaded_blocks = []
        for group, tiers in zip(self.groups, hit.tiers):
            loaded = self._load(group, tiers, tables[group.index], sources)
            if loaded is None:
                self.pool.free(touched + loaded_blocks)
                return False
            loaded_blocks += loaded
        seq.tables = tables
        seq.num_cached_blocks = b
        seq.num_computed = seq.checkpointed = b * self.block_size
        seq.states = states
        if hit.checkpoint is not None:  # resuming from disk anchors the chain there; else where its checkpoint did
            if state_tier == DISK:
                self.checkpoints.set_anchor(hit.checkpoint, seq.checkpointed)
            seq.disk_anchor = self.checkpoints.anchor(hit.checkpoint)
        for source in sources:
            source = max(source, state_tier, key=TIERS.index)  # as slow as the checkpoint, too
            seq.cached_tokens[source] = seq.cached_tokens.get(source, 0) + self.block_size
        return True

    def _checkpoint_of(self, hit: PrefixHit) -> tuple[States | None, str]:
        """The hit's checkpoint states (from the store, or a tier into the store) and where they came from."""
        if hit.checkpoint is None:
            return None, POOL
        if not hit.checkpoint_in_tier:
            return self.checkpoints.get(hit.checkpoint), POOL
        loaded = self.connector.load_checkpoint(hit.checkpoint)
        if loaded is None:
            return None, POOL
        self.checkpoints.put(hit.checkpoint, loaded.states)
        return loaded.states, loaded.tier

    def _load(self, group: KVGroup, wanted: list[tuple[int, BlockHash]], table: list, sources: list[str]):
        """Hydrate a group's blocks from the tiers into the table; None if any is missing."""
        if not wanted:
            return []
        keys = [key for _, key in wanted]
        loaded = self.connector.load_blocks(keys)
        good = 0
        while (good < min(len(loaded), len(keys)) and loaded[good].block_hash == keys[good]
               and loaded[good].kv.group == group.index):
            good += 1
        # Which free block takes which key is ours to choose: in id order, a
        # run of tier blocks lands on runs of ids, one slice copy per layer.
        blocks = sorted(self.pool.allocate(good), key=lambda blk: blk.block_id) if good else []
        if good:
            self.kv_pool.write_blocks([blk.block_id for blk in blocks], [block.kv for block in loaded[:good]])
            self.pool.cache_blocks(blocks, keys[:good], group.index)
        if good < len(keys):
            self.pool.free(blocks)  # they stay cached under their keys; the hit is looked up again
            return None
        for (i, _), block, found in zip(wanted, blocks, loaded):
            table[i] = block
            sources[i] = max(sources[i], found.tier, key=TIERS.index)  # a block comes as slow as its slowest group
        return blocks

    def admission_blocks(self, seq: Sequence, chunk: int) -> int:
        """Free blocks admitting `seq` may take while it prefills in chunks of `chunk` tokens."""
        hit = self.pool_hit(seq)
        held = sum(1 for pool in hit.pool for _, block in pool if block.ref_count == 0)
        need = self.peak_blocks(len(seq.prompt), chunk) - sum(len(pool) for pool in hit.pool)
        return need + held

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence holds on its way to `num_tokens` tokens."""
        bs, total = self.block_size, blocks_for(num_tokens, self.block_size)
        peak = 0
        for group in self.groups:
            if group.window is None:
                peak += total
            else:  # the window behind a chunk, the chunk, and a partial block at each end
                peak += min(total, blocks_for(group.window + min(chunk, num_tokens), bs) + 1)
        return peak

    # -- computing ------------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new: int, ahead: int = 0) -> None:
        """Make sure blocks exist for the next `num_new` tokens of `seq`, in every group.

        `ahead`: tokens after those that full-attention groups take slots for
        now too (the rest of a prompt, so its prefill never waits for them).
        Sliding groups take slots a chunk at a time, after letting go of
        the blocks their window has passed, so a long prompt never holds
        more than a window and a chunk of them.
        All or nothing: PoolExhaustedError leaves every table as it was.
        """
        self._release_passed(seq)
        short = self._short(seq, num_new, ahead)
        if not any(short):
            return
        fresh = self.pool.allocate(sum(short))
        for table, n in zip(seq.tables, short):
            table.extend(fresh[:n])
            fresh = fresh[n:]

    def _short(self, seq: Sequence, num_new: int, ahead: int = 0) -> list[int]:
        """Blocks each group's table lacks for the next `num_new` (+ `ahead`) tokens."""
        now = blocks_for(seq.num_computed + num_new, self.block_size)
        later = blocks_for(seq.num_computed + num_new + ahead, self.block_size)
        return [max(0, (now if group.window is not None else later) - len(table))
                for group, table in zip(self.groups, seq.tables)]

    def slots_needed(self, seq: Sequence, num_new: int) -> int:
        """Blocks `allocate_slots(seq, num_new)` would take from the pool (at most)."""
        return sum(self._short(seq, num_new))

    def _release_passed(self, seq: Sequence) -> None:
        """Sliding groups drop the registered blocks before the next token's window."""
        for group in self.layout.sliding_groups:
            table = seq.tables[group.index]
            end = min(group.first_needed_block(seq.num_computed, self.block_size), len(table))
            if seq.hash_root is not None:
                end = min(end, seq.num_cached_blocks)  # never a block not yet registered
            passed = [i for i in range(end) if table[i] is not None]
            if not passed:
                continue
            if any(table[i] in seq.unstored[group.index] for i in passed):
                self._store_group(seq, group.index)  # read before the pool may reuse them
            self.pool.free([table[i] for i in passed])
            for i in passed:
                table[i] = None

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
        if full > seq.num_cached_blocks:
            self._register_blocks(seq, known, full, store_now)
        if seq.snapshots:
            self._register_checkpoints(seq, min(known, len(seq.prompt)), every=True)

    def _register_blocks(self, seq: Sequence, known: int, full: int, store_now: bool) -> None:
        extend_block_hashes(seq.block_hashes, seq.hash_root, seq.tokens[:known], self.block_size)
        start = seq.num_cached_blocks
        for group, table in zip(self.groups, seq.tables):
            held = [(b, group_hash(h, group.index))
                    for b, h in zip(table[start:full], seq.block_hashes[start:full]) if b is not None]
            newly = self.pool.cache_blocks([b for b, _ in held], [key for _, key in held], group.index)
            seq.unstored[group.index].extend(newly)
        seq.num_cached_blocks = full
        if store_now or max(len(u) for u in seq.unstored) >= STORE_BATCH_BLOCKS:
            self._store(seq)

    def prefill_stop(self, seq: Sequence) -> int | None:
        """Where the prefill chunk now starting must end so a checkpoint can be taken there, or None."""
        if not self.layout.has_recurrent or seq.hash_root is None:
            return None
        at, step = seq.num_computed, self.checkpoint_interval
        last_full = len(seq.prompt) // self.block_size * self.block_size
        stops = [(at // step + 1) * step] + ([last_full] if last_full > at else [])
        return min(stops)

    def _register_checkpoints(self, seq: Sequence, upto: int, every: bool) -> None:
        """Keep the snapshots at boundaries up to `upto` (all, or the newest) as checkpoints.

        Only the newest, the one a sequence leaves behind, is written through
        to the SSD tier: a real model's state is megabytes per layer, more
        than a turn's KV, and the turn's end is where the next turn (or a
        restarted chat) resumes. The others reach SSD only if evicted.
        """
        ready = sorted(b for b in seq.snapshots if seq.checkpointed < b <= upto)
        if every:  # a prefill's: only where the policy says (a chunk may end elsewhere)
            last_full = len(seq.prompt) // self.block_size * self.block_size
            ready = [b for b in ready if b % self.checkpoint_interval == 0 or b == last_full]
        for boundary in ready if every else ready[-1:]:
            if len(seq.block_hashes) < boundary // self.block_size:  # cache_blocks has usually hashed them
                extend_block_hashes(seq.block_hashes, seq.hash_root, seq.tokens[:boundary], self.block_size)
            key = checkpoint_key(seq.block_hashes[boundary // self.block_size - 1])
            states = seq.snapshots[boundary]
            if self.checkpoints.put(key, states):
                seq.last_checkpoint = (key, states, boundary)
            seq.checkpointed = boundary
        for boundary in [b for b in seq.snapshots if b <= seq.checkpointed]:
            del seq.snapshots[boundary]

    def _write_through(self, seq: Sequence, key, states, boundary: int) -> None:
        """Send the checkpoint a sequence leaves to the SSD tier if the write policy says so (checkpoints.py)."""
        anchor = seq.disk_anchor
        per_token = self.kv_pool.layout.bytes_per_block // self.block_size
        if self.checkpoints.worth_writing(boundary, anchor, states, per_token):
            try:
                self.connector.cache_checkpoint(key, states)
                anchor = boundary
            except Exception:  # a lost copy, as with blocks
                log.exception("the connector could not store a checkpoint")
        self.checkpoints.set_anchor(key, anchor)

    def _store(self, seq: Sequence) -> None:
        for g in range(len(seq.unstored)):
            self._store_group(seq, g)

    def _store_group(self, seq: Sequence, g: int) -> None:
        blocks, seq.unstored[g] = seq.unstored[g], []
        if not blocks:
            return
        try:
            self.connector.cache_blocks([b.block_hash for b in blocks], self._reader(blocks))
        except Exception:  # a lost copy, as with a spill; free() must still free
            log.exception("the connector could not store %d blocks", len(blocks))

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, last first, so they are evicted first.

        A hybrid model's sequence leaves a checkpoint at the last boundary
        of tokens it knows (its reply's last full block): where its next
        turn, or its resumption after a preemption, starts.
        """
        if seq.snapshots and seq.hash_root is not None:
            self._register_checkpoints(seq, min(seq.num_computed, seq.num_tokens), every=False)
        if seq.last_checkpoint is not None:
            self._write_through(seq, *seq.last_checkpoint)
        seq.snapshots, seq.states, seq.last_checkpoint = {}, None, None
        self._store(seq)
        longest = max(len(table) for table in seq.tables)
        last_first = [table[i] for i in reversed(range(longest)) for table in seq.tables
                      if i < len(table) and table[i] is not None]
        self.pool.free(last_first)
        seq.tables = [[] for _ in seq.tables]
