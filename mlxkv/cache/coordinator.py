"""The cache coordinator: where a prompt meets the pool, over one manager per layer group.

Each layer group has a manager with its rule (groups/): full attention,
a sliding window, the recurrent state. The coordinator does what they
share:

- the lookup: the fixed point of every manager's longest hit (each may
  only shorten it, so it ends at the largest hit every group accepts), the
  pool first, then the connector's tiers; one lookup per admission attempt,
  valid while `generation` stands;
- restore or recompute: a hit stops before the first tier block that is
  cheaper to compute than to read, by measured speeds (restore_cost.py);
- admission: holding the hit's pool blocks and hydrating its tier blocks,
  all or nothing (hydration.py), or, the usual way, reading them off the
  engine thread while the request waits (tier_loads.py, `loads`);
- slots for the tokens computed next, registration of blocks as they
  fill, and release;
- the connector seam (cache/connector.py): its calls are made by the
  coordinator's parts (hydration.py reads, tier_writes.py stores and
  spills) and the recurrent manager, nowhere else.

It owns the block pool, so it installs the pool's hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlxkv.cache.block_pool import Block, BlockPool
from mlxkv.cache.connector import KVCacheConnector, NoopKVCacheConnector
from mlxkv.cache.groups.base import AttentionManager, GroupNeeds, Presence, blocks_for
from mlxkv.cache.groups.chunked import ChunkedAttentionManager
from mlxkv.cache.groups.full import FullAttentionManager
from mlxkv.cache.groups.recurrent import CheckpointNeed, RecurrentManager
from mlxkv.cache.groups.sliding import SlidingWindowManager
from mlxkv.cache.hashing import BlockHash, extend_block_hashes
from mlxkv.cache.hydration import Hydration
from mlxkv.cache.kv_pool import KVPool
from mlxkv.cache.layer_groups import GroupLayout, KVGroup
from mlxkv.cache.sequence import Sequence
from mlxkv.cache.restore_cost import RestoreCost
from mlxkv.cache.tier_loads import TierLoads
from mlxkv.cache.tier_writes import TierWrites

# Decode fills a block every block_size tokens. Offered one at a time, each
# costs a pool read and the SSD tier a file with its own fsync. Offered in
# batches of this many (and whatever is left when the sequence lets go of
# its blocks), a restored conversation reads runs, as a restored prompt does.
STORE_BATCH_BLOCKS = 16
# Hydrates that find a tier's copy gone or bad look again this often, then
# settle for what the pool holds.
HYDRATE_ATTEMPTS = 3


@dataclass
class PrefixHit:
    """A prompt's longest prefix hit and what each group needs for it."""

    num_blocks: int
    hashes: list[BlockHash]  # every full block of the prompt's
    usable: int  # blocks a hit may cover: never the one holding the last token
    groups: list[GroupNeeds]  # per attention group
    checkpoint: CheckpointNeed | None
    generation: tuple  # the coordinator's when it was looked up
    recomputed: int = 0  # tokens a tier held that are cheaper to compute (restore_cost.py)
    # Blocks the attention groups alone would have hit: past num_blocks, a hybrid's
    # branch point (the prefix another chain shares, with no checkpoint at its end).
    branch: int = 0

    @property
    def tier_blocks(self) -> int:
        return sum(len(g.tiers) for g in self.groups)

    @property
    def restore_choice(self) -> str:
        """"restore", "recompute", "partial" (some of each), or "" (no tier held any of it)."""
        if self.recomputed:
            return "partial" if self.tier_blocks else "recompute"
        return "restore" if self.tier_blocks else ""

    @property
    def from_tiers(self) -> bool:
        """Whether admitting it reads a tier: blocks, or a hybrid's checkpoint."""
        return bool(self.tier_blocks) or (self.checkpoint is not None and self.checkpoint.in_tier)

    @property
    def pool_blocks(self) -> list[Block]:
        return [block for g in self.groups for _, block in g.pool]


def _manager_class(group: KVGroup) -> type[AttentionManager]:
    """The manager of a group's rule (groups/)."""
    if group.chunk is not None:
        return ChunkedAttentionManager
    return FullAttentionManager if group.window is None else SlidingWindowManager


class KVCacheCoordinator:
    def __init__(self, layout: GroupLayout, block_size: int, budget: int, *, kv_pool: KVPool | None = None,
                 connector: KVCacheConnector | None = None, initial: int | None = None,
                 checkpoint_budget: int = 0, checkpoint_interval: int = 2048, checkpoint_write_ratio: float = 0.0,
                 agree: Callable[[int], list[int]] | None = None):
        """`agree(n)`: every rank's `n`, for a rank of a distributed set: ranks whose tiers hold
        different blocks (a write still in flight, a file lost) must still hit the same length."""
        # Without a KV pool (pure bookkeeping, as in the pool's property
        # tests) there are no bytes to move, so only the no-op connector fits.
        if connector is not None and kv_pool is None:
            raise ValueError("a connector needs the KV pool to move bytes")
        self.group_layout = layout
        self.block_size = block_size
        self.kv_pool = kv_pool
        self.connector = connector or NoopKVCacheConnector()
        self.writes = TierWrites(self.connector, kv_pool)
        self.pool = BlockPool(budget, initial=initial, on_evict=self.writes.spill,
                              on_grow=kv_pool.grow if kv_pool else None, on_shrink=kv_pool.shrink if kv_pool else None)
        self.attention: list[AttentionManager] = [_manager_class(g)(g, self.pool, block_size) for g in layout.groups]
        self.recurrent = None
        if layout.has_recurrent:
            per_token = kv_pool.layout.bytes_per_token if kv_pool else 0
            self.recurrent = RecurrentManager(layout.state_sizes, checkpoint_budget, self.connector, block_size,
                                              checkpoint_interval, checkpoint_write_ratio, per_token)
        # The fixed point's order: the cheapest bound first.
        self._managers = sorted(self.attention, key=lambda m: m.slots_ahead(), reverse=True)
        self._managers += [self.recurrent] if self.recurrent else []
        self._hydration = Hydration(self.pool, kv_pool, self.connector, self.attention, self.recurrent, block_size)
        # Restore or recompute (restore_cost.py), and tier reads off the step path (tier_loads.py).
        self.costs = RestoreCost(kv_pool.layout.bytes_per_token if kv_pool else 0)
        self.loads = TierLoads(self.pool, kv_pool, self.connector, self.attention, self.recurrent, self.costs,
                               block_size)
        self.agree = agree

    # -- lookup and admission -------------------------------------------------

    @property
    def generation(self) -> tuple:
        """Changes whenever a lookup could answer differently (a block or checkpoint came or went)."""
        return self.pool.generation, self.recurrent.generation if self.recurrent else None

    def lookup(self, tokens: list[int], root: BlockHash | None, *, hashes: list[BlockHash] | None = None,
               use_tiers: bool = True) -> PrefixHit:
        """The longest hit for a prompt; `hashes` (an earlier lookup's) saves hashing again."""
        hashes = [] if root is None else extend_block_hashes(hashes or [], root, tokens, self.block_size)
        usable = (len(tokens) - 1) // self.block_size if root is not None else 0
        presence = Presence(self.pool, self.connector if use_tiers else None)
        hybrid = self.recurrent if self.attention else None
        b, branch = _longest(self._managers, hashes, usable, presence, hybrid)
        while self.agree is not None and len(set(seen := self.agree(b))) > 1:
            # Every rank sees every rank's length, so all loop alike: down to the shortest.
            b, branch = _longest(self._managers, hashes, min(seen), presence, hybrid)
        needs = [m.needs(hashes, b) for m in self.attention]
        # Restore or recompute: a hit ends before the first tier block cheaper to compute than to read.
        cut = min((i for g in needs for i, key in g.tiers if not self.costs.restores(presence.tier(key))),
                  default=None)
        found = b
        if cut is not None:
            b, _ = _longest(self._managers, hashes, cut, presence, hybrid)
            needs = [m.needs(hashes, b) for m in self.attention]
        checkpoint = self.recurrent.needs(hashes, b) if self.recurrent else None
        return PrefixHit(b, hashes, usable, needs, checkpoint, self.generation,
                         recomputed=(found - b) * self.block_size, branch=branch)

    def admission_blocks(self, hit: PrefixHit, num_tokens: int, chunk: int) -> int:
        """Free blocks admitting a prompt of `num_tokens` on `hit` takes while it prefills in chunks of `chunk`."""
        unreferenced = sum(1 for block in hit.pool_blocks if block.ref_count == 0)
        return self.peak_blocks(num_tokens, chunk) - len(hit.pool_blocks) + unreferenced

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence holds on its way to `num_tokens` tokens."""
        return sum(m.peak_blocks(num_tokens, chunk) for m in self.attention)

    def admit(self, request_id: int, tokens: list[int], root: BlockHash | None, hit: PrefixHit,
              head: int = 0) -> Sequence:
        """A sequence holding the hit's blocks, hydrated from the tiers; if a tier's copy is gone, look again.
        `head`: where a rendered system-and-tools head ends (tokens), a hybrid's branch point too."""
        for _ in range(HYDRATE_ATTEMPTS):
            if not self._hydration.room_for(hit):
                break  # computing those blocks would not fit either: the scheduler waits or preempts
            seq = self._hydration.take(request_id, tokens, root, hit, head)
            if seq is not None:
                seq.restore_choice, seq.recomputed_hit = hit.restore_choice, hit.recomputed
                return seq
            hit = self.lookup(tokens, root, hashes=hit.hashes)
        return self._hydration.take(request_id, tokens, root,
                                    self.lookup(tokens, root, hashes=hit.hashes, use_tiers=False), head)

    # -- computing ------------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new: int, ahead: int = 0) -> None:
        """Make sure every group has blocks for the next `num_new` tokens of `seq`.

        `ahead`: tokens after those that groups taking a prompt's slots at
        once (full attention) take slots for now too, so its prefill never
        waits for them; sliding groups take theirs a chunk at a time, after
        letting go of the blocks their window has passed.
        All or nothing: PoolExhaustedError leaves every table as it was.
        """
        self._release_passed(seq)
        short = [m.short(seq.request_id, seq.num_computed, num_new, ahead) for m in self.attention]
        if not any(short):
            return
        fresh = self.pool.allocate(sum(short))
        for manager, n in zip(self.attention, short):
            manager.tables.extend(seq.request_id, fresh[:n])
            fresh = fresh[n:]

    def slots_needed(self, seq: Sequence, num_new: int) -> int:
        """Blocks `allocate_slots(seq, num_new)` would take from the pool (at most)."""
        return sum(m.short(seq.request_id, seq.num_computed, num_new, 0) for m in self.attention)

    def _release_passed(self, seq: Sequence) -> None:
        """Groups let go of the registered blocks the next token no longer needs."""
        registered = seq.num_cached_blocks if seq.hash_root is not None else seq.num_computed
        for manager in self.attention:
            passed = manager.passed(seq.request_id, seq.num_computed, registered)
            if not passed:
                continue
            if manager.tables.has_unstored(seq.request_id, passed):
                self.writes.store_group(manager, seq.request_id)  # read before the pool may reuse them
            self.pool.free(manager.tables.drop(seq.request_id, passed))

    def prefill_stop(self, seq: Sequence) -> int | None:
        """Where the prefill chunk now starting must end so a checkpoint can be taken there, or None."""
        if self.recurrent is None or seq.hash_root is None:
            return None
        return self.recurrent.prefill_stop(seq)

    def computed(self, seqs: list[Sequence], num_new: int, new_states: list | None = None) -> None:
        """Record a forward: `num_new` more tokens of each sequence are in the pool (and its new states)."""
        for seq in seqs:
            seq.num_computed += num_new
        if new_states is not None:
            self.recurrent.record(seqs, new_states)

    def rollback(self, seq: Sequence, num_computed: int) -> None:
        """Keep only the first `num_computed` tokens' KV (a speculative step's rejected
        tokens go), and free the blocks past them. Never below what is registered: a
        rejected token's block was never registered, and now never will be."""
        if self.recurrent is not None:
            raise ValueError("a recurrent state cannot be rolled back")
        if not seq.num_cached_blocks * self.block_size <= num_computed <= seq.num_computed:
            raise ValueError(f"cannot roll back to {num_computed} tokens: {seq.num_computed} computed, "
                             f"{seq.num_cached_blocks} blocks registered")
        seq.num_computed = num_computed
        keep = blocks_for(num_computed, self.block_size)
        for manager in self.attention:
            self.pool.free(manager.tables.trim(seq.request_id, keep)[::-1])

    def register_computed(self, seq: Sequence, *, store_now: bool = True) -> None:
        """Register the blocks now full of computed, known tokens (and a prefill's checkpoints).

        The connector gets them at once, or with `store_now=False` (decode)
        once STORE_BATCH_BLOCKS are waiting or the sequence leaves. Until
        then the sequence holds them, so the pool cannot evict them.
        """
        if seq.hash_root is None:
            return
        # Runs after every decode step: only a block that just filled up
        # pays for the token list, so a long context costs no copy per token.
        known = min(seq.num_computed, seq.num_tokens)
        full = known // self.block_size
        if full > seq.num_cached_blocks:
            _hash_upto(seq, known, self.block_size)
            start = seq.num_cached_blocks
            waiting = max((m.register(seq.request_id, seq.block_hashes, start, full) for m in self.attention),
                          default=0)
            seq.num_cached_blocks = full
            if store_now or waiting >= STORE_BATCH_BLOCKS:
                self.writes.store(self.attention, seq.request_id)
        if self.recurrent is not None:
            self.recurrent.register(seq, min(known, len(seq.prompt)), every=True)

    # -- leaving --------------------------------------------------------------

    def release(self, seq: Sequence) -> None:
        """The sequence leaves: register what it computed, leave a hybrid's checkpoint
        at the last boundary it knows (where its next turn, or its resumption
        after a preemption, starts), and free its blocks last first, so they are
        evicted first."""
        self.register_computed(seq)
        if self.recurrent is not None:
            if seq.hash_root is not None:
                known = min(seq.num_computed, seq.num_tokens)
                _hash_upto(seq, known, self.block_size)
                self.recurrent.register(seq, known, every=False)
            self.recurrent.leave(seq)
        self.writes.store(self.attention, seq.request_id)
        tables = [m.tables.release(seq.request_id) for m in self.attention]
        longest = max((len(table) for table in tables), default=0)
        self.pool.free([table[i] for i in reversed(range(longest)) for table in tables
                        if i < len(table) and table[i] is not None])

    # -- reads ----------------------------------------------------------------

    def tables(self, seq: Sequence) -> list[list[Block | None]]:
        """The sequence's block table in each attention group."""
        return [m.tables.table(seq.request_id) for m in self.attention]

    def held(self, seq: Sequence) -> list[Block]:
        """Every block the sequence holds a reference to, in every group."""
        return [block for m in self.attention for block in m.tables.held(seq.request_id)]


def _longest(managers, hashes: list[BlockHash], limit: int, presence: Presence,
             recurrent=None) -> tuple[int, int]:
    """The fixed point of every manager's longest hit, from `limit` down; and the blocks the
    attention groups reached before `recurrent`'s cut (a hybrid's branch point; 0 without one)."""
    b, branch = limit, 0
    while True:
        c = b
        for manager in managers:
            if manager is recurrent:
                branch = max(branch, c)  # the attention groups' hit, before the state's cut
            c = manager.longest_hit(hashes, c, presence)
        if c == b:
            return b, branch
        b = c


def _hash_upto(seq: Sequence, num_tokens: int, block_size: int) -> None:
    if len(seq.block_hashes) < num_tokens // block_size:
        extend_block_hashes(seq.block_hashes, seq.hash_root, seq.tokens[:num_tokens], block_size)
