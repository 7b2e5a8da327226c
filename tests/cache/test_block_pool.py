"""Tests for the block pool (mlxkv/block_pool.py) and the sequence-level
manager on top of it (mlxkv/cache_manager.py).

Unit tests pin the behaviours one at a time; `PoolMachine` at the bottom runs
random programs of admit / compute / append / finish / abort against a shadow
model and checks the pool's invariants after every step.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mlxkv.cache.block_pool import Block, BlockPool, FreeBlockQueue
from mlxkv.cache.manager import KVCacheManager, blocks_for
from mlxkv.errors import MlxkvError, PoolExhaustedError
from mlxkv.cache.hashing import hash_block, root_hash
from mlxkv.cache.sequence import Sequence

ROOT = root_hash(b"mlxkv-test-fingerprint")
ROOT_SALTED = root_hash(b"mlxkv-test-fingerprint", "alice")


def h(name: str) -> bytes:
    """A stand-in block hash for pool-level tests."""
    return hash_block(ROOT, [ord(c) for c in name])


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def cached_pool(num_blocks: int, hook=None) -> tuple[BlockPool, list[Block]]:
    """A pool whose blocks were all taken, cached as h("0"), h("1"), ..."""
    pool = BlockPool(num_blocks, on_evict=hook)
    blocks = pool.allocate(num_blocks)
    pool.cache_blocks(blocks, [h(str(i)) for i in range(num_blocks)])
    return pool, blocks


def run_prompt(manager: KVCacheManager, seq: Sequence) -> Sequence:
    """What the engine does for a prompt: admit, compute all but the last token, cache."""
    manager.admit(seq)
    n = len(seq.prompt) - 1 - seq.num_computed
    if n > 0:
        manager.allocate_slots(seq, n)
        seq.num_computed += n
        manager.cache_blocks(seq)
    return seq


# --- FreeBlockQueue ----------------------------------------------------------


def test_free_queue_keeps_insertion_order():
    blocks = [Block(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3]
    assert len(queue) == queue.size == 4
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    assert ids(queue) == [1, 2, 3, 0]


def test_free_queue_removes_from_the_middle_and_unlinks():
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3]
    assert len(queue) == 2


def test_free_queue_popleft_on_empty_raises():
    queue = FreeBlockQueue([])
    with pytest.raises(IndexError):
        queue.popleft()


def test_hit_on_free_cached_block_is_removed_without_scanning(monkeypatch):
    pool, blocks = cached_pool(6)
    pool.free(blocks)
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]

    def no_scan(self):
        raise AssertionError("a prefix hit must not walk the free queue")

    # O(1): touching a block in the middle of the queue only relinks it.
    monkeypatch.setattr(FreeBlockQueue, "__iter__", no_scan)
    hits = pool.get_computed_blocks([h("3")])
    pool.touch(hits)
    monkeypatch.undo()

    assert hits == [blocks[3]]
    assert blocks[3].ref_count == 1
    assert free_ids(pool) == [0, 1, 2, 4, 5]
    assert pool.num_free == 5


# --- BlockPool basics --------------------------------------------------------


def test_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_new_pool_is_all_free_in_id_order():
    pool = BlockPool(4)
    assert ids(pool.blocks) == [0, 1, 2, 3]
    assert free_ids(pool) == [0, 1, 2, 3]
    assert all(b.ref_count == 0 and b.block_hash is None for b in pool.blocks)
    assert pool.usage() == {
        "num_blocks": 4,
        "budget_blocks": 4,
        "free": 4,
        "cached_free": 0,
        "in_use": 0,
        "shared": 0,
        "cached": 0,
        "evictions": 0,
    }


def test_allocate_takes_blocks_from_the_head_with_one_reference():
    pool = BlockPool(4)
    taken = pool.allocate(3)
    assert ids(taken) == [0, 1, 2]
    assert all(b.ref_count == 1 for b in taken)
    assert free_ids(pool) == [3]
    assert pool.allocate(0) == []


def test_allocate_evicts_the_least_recently_used_cached_block():
    evicted = []
    pool, blocks = cached_pool(4, hook=evicted.extend)
    # Freed in this order: block 2 is now the least recently used.
    pool.free([blocks[2], blocks[0], blocks[1], blocks[3]])
    assert free_ids(pool) == [2, 0, 1, 3]

    (new,) = pool.allocate(1)
    assert new is blocks[2]
    assert evicted == [blocks[2]]
    assert new.block_hash is None and new.ref_count == 1
    assert h("2") not in pool.cached
    assert set(pool.cached) == {h("0"), h("1"), h("3")}
    assert pool.evictions == 1


def test_hit_refreshes_recency():
    pool, blocks = cached_pool(3)
    pool.free(blocks)  # LRU order 0, 1, 2
    pool.touch(pool.get_computed_blocks([h("0")]))
    pool.free([blocks[0]])  # block 0 used again: now most recent
    assert free_ids(pool) == [1, 2, 0]
    assert ids(pool.allocate(2)) == [1, 2]
    assert set(pool.cached) == {h("0")}


def test_touch_shares_a_referenced_block():
    pool, blocks = cached_pool(2)
    pool.touch(pool.get_computed_blocks([h("0")]))
    assert blocks[0].ref_count == 2
    assert pool.num_free == 0
    assert pool.usage()["shared"] == 1
    pool.free([blocks[0]])
    assert blocks[0].ref_count == 1 and pool.num_free == 0
    pool.free([blocks[0]])
    assert free_ids(pool) == [0]


def test_free_more_often_than_taken_raises():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([block])
    assert block.ref_count == 0
    assert pool.num_free == 2


def test_get_computed_blocks_stops_at_the_first_miss():
    pool, blocks = cached_pool(4)
    assert pool.get_computed_blocks([h("0"), h("1"), h("x"), h("3")]) == blocks[:2]
    assert pool.get_computed_blocks([h("x"), h("0")]) == []
    assert pool.get_computed_blocks([]) == []


def test_cache_blocks_first_block_keeps_the_hash():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    assert pool.cache_blocks([a], [h("p")]) == [a]
    # Another sequence computed the same prefix: its block stays private.
    assert pool.cache_blocks([b, c], [h("p"), h("q")]) == [c]
    assert pool.cached == {h("p"): a, h("q"): c}
    assert b.block_hash is None
    # A block keeps the hash it was registered under.
    assert pool.cache_blocks([a], [h("r")]) == []
    assert a.block_hash == h("p")


def test_usage_counts_cached_free_blocks():
    pool, blocks = cached_pool(4)
    pool.free(blocks[:2])
    pool.touch([blocks[2]])
    assert pool.usage() == {
        "num_blocks": 4,
        "budget_blocks": 4,
        "free": 0,
        "cached_free": 2,
        "in_use": 2,
        "shared": 1,
        "cached": 4,
        "evictions": 0,
    }


# --- eviction hook -----------------------------------------------------------


def test_eviction_hook_runs_once_per_allocation_with_every_evicted_block_before_reuse():
    calls = []

    def hook(evicted):
        # Still carrying their hashes, still findable, not yet handed out.
        calls.append([(b.block_id, b.block_hash, b.ref_count, pool.cached.get(b.block_hash)) for b in evicted])

    pool, blocks = cached_pool(4, hook=hook)
    pool.free(blocks[:3])  # free: 0, 1, 2 cached; 3 still referenced
    taken = pool.allocate(2)
    assert ids(taken) == [0, 1]
    assert calls == [[(0, h("0"), 0, blocks[0]), (1, h("1"), 0, blocks[1])]]  # one call: one read of the pool

    # Evicted blocks are plain now: freeing and re-taking them is silent.
    pool.free(taken)
    pool.allocate(3)  # 2 (cached), then 0, 1 (uncached)
    assert [[c[0] for c in call] for call in calls] == [[0, 1], [2]]
    assert pool.evictions == 3


def test_no_hook_calls_for_blocks_never_cached():
    calls = []
    pool = BlockPool(3, on_evict=calls.append)
    pool.free(pool.allocate(3))
    pool.allocate(3)
    assert calls == []
    assert pool.evictions == 0


def test_failing_eviction_hook_loses_no_block():
    def hook(evicted):
        raise OSError("disk full")

    pool, blocks = cached_pool(3, hook=hook)
    pool.free(blocks)
    with pytest.raises(OSError):
        pool.allocate(2)
    # Whatever the pool decides, every block must be free or referenced...
    referenced = [b for b in pool.blocks if b.ref_count > 0]
    assert pool.num_free + len(referenced) == pool.num_blocks
    # ...and a block still in the hash map must be usable for a hit.
    pool.touch(pool.get_computed_blocks([h("0")]))


# --- exhaustion --------------------------------------------------------------


def test_pool_exhausted_when_every_block_is_referenced():
    pool = BlockPool(3)
    pool.allocate(3)
    with pytest.raises(PoolExhaustedError) as info:
        pool.allocate(1)
    assert isinstance(info.value, MlxkvError)
    message = str(info.value)
    assert "\n" not in message
    assert "--num-blocks" in message  # says how to size the pool
    assert "need 1" in message and "0 of 3" in message


def test_pool_exhausted_takes_nothing():
    evicted = []
    pool, blocks = cached_pool(4, hook=evicted.extend)
    pool.free(blocks[:2])
    with pytest.raises(PoolExhaustedError, match="need 3 free blocks, 2 of 4"):
        pool.allocate(3)
    assert free_ids(pool) == [0, 1]
    assert len(pool.cached) == 4
    assert evicted == [] and pool.evictions == 0
    assert ids(pool.allocate(2)) == [0, 1]  # exactly num_free is fine


# --- KVCacheManager ----------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_len", "block_size", "expected_hits"),
    [(8, 4, 1), (9, 4, 2), (7, 4, 1), (4, 4, 0), (5, 4, 1), (1, 1, 0), (6, 1, 5), (6, 2, 2)],
)
def test_lookup_never_covers_the_whole_prompt(prompt_len, block_size, expected_hits):
    manager = KVCacheManager(BlockPool(16), block_size)
    prompt = list(range(prompt_len))
    # A longer earlier request has every block of this prompt cached.
    first = Sequence(0, prompt + [99] * block_size, ROOT)
    manager.allocate_slots(first, len(first.prompt))
    first.num_computed = len(first.prompt)
    manager.cache_blocks(first)
    manager.free(first)

    seq = Sequence(1, prompt, ROOT)
    hits = manager.get_computed_blocks(seq)
    assert len(hits) == expected_hits == (prompt_len - 1) // block_size
    manager.admit(seq)
    assert seq.num_computed == expected_hits * block_size < prompt_len
    assert seq.cached_tokens["pool"] == seq.num_reused == seq.num_computed
    assert seq.num_cached_blocks == expected_hits
    assert seq.blocks == hits


def test_only_full_blocks_are_cached():
    pool = BlockPool(4)
    manager = KVCacheManager(pool, 4)
    seq = Sequence(0, list(range(10)), ROOT)
    manager.allocate_slots(seq, 6)
    seq.num_computed = 6
    manager.cache_blocks(seq)
    assert len(seq.blocks) == 2
    assert seq.blocks[0].block_hash is not None
    assert seq.blocks[1].block_hash is None
    assert len(pool.cached) == 1 and seq.num_cached_blocks == 1

    manager.allocate_slots(seq, 2)
    seq.num_computed = 8
    manager.cache_blocks(seq)
    assert seq.blocks[1].block_hash is not None
    assert len(pool.cached) == 2 and seq.num_cached_blocks == 2


def test_cache_blocks_only_uses_known_tokens():
    # The engine queues the next decode step before it knows its token, so
    # num_computed can run ahead of the tokens: only known tokens are hashed.
    pool = BlockPool(4)
    manager = KVCacheManager(pool, 2)
    seq = Sequence(0, [1, 2, 3], ROOT)
    manager.allocate_slots(seq, 4)
    seq.num_computed = 4
    manager.cache_blocks(seq)
    assert seq.num_cached_blocks == 1 and len(pool.cached) == 1
    seq.output.append(4)
    manager.cache_blocks(seq)
    assert seq.num_cached_blocks == 2
    assert seq.blocks[1].block_hash == hash_block(hash_block(ROOT, [1, 2]), [3, 4])


def test_allocate_slots_only_adds_missing_blocks():
    manager = KVCacheManager(BlockPool(8), 4)
    seq = Sequence(0, list(range(20)), ROOT)
    manager.allocate_slots(seq, 3)
    assert len(seq.blocks) == 1
    manager.allocate_slots(seq, 4)
    assert len(seq.blocks) == 1
    manager.allocate_slots(seq, 5)
    assert len(seq.blocks) == 2
    assert blocks_for(0, 4) == 0 and blocks_for(4, 4) == 1 and blocks_for(5, 4) == 2


def test_allocate_slots_that_cannot_fit_changes_nothing():
    pool = BlockPool(2)
    manager = KVCacheManager(pool, 2)
    seq = Sequence(0, list(range(10)), ROOT)
    manager.allocate_slots(seq, 2)
    with pytest.raises(PoolExhaustedError):
        manager.allocate_slots(seq, 5)
    assert len(seq.blocks) == 1 and pool.num_free == 1


def test_finished_sequence_frees_tail_first():
    pool = BlockPool(6)
    manager = KVCacheManager(pool, 2)
    seq = run_prompt(manager, Sequence(0, list(range(7)), ROOT))  # 3 full blocks
    table = seq.block_table
    manager.cache_blocks(seq)
    manager.free(seq)
    assert seq.blocks == []
    # Fresh blocks first, then the sequence's blocks last to first.
    assert free_ids(pool) == [3, 4, 5, *reversed(table)]

    # Pressure evicts the sequence's last block first: the prefix survives.
    pool.allocate(4)
    assert set(pool.cached.values()) == {pool.blocks[table[0]], pool.blocks[table[1]]}
    again = Sequence(1, list(range(7)), ROOT)
    assert ids(manager.get_computed_blocks(again)) == table[:2]


def test_second_request_hits_the_first_requests_blocks():
    pool = BlockPool(8)
    manager = KVCacheManager(pool, 2)
    first = run_prompt(manager, Sequence(0, [1, 2, 3, 4, 5, 6], ROOT))
    second = run_prompt(manager, Sequence(1, [1, 2, 3, 4, 9, 9], ROOT))
    # Shared while both run.
    assert second.block_table[:2] == first.block_table[:2]
    assert second.cached_tokens["pool"] == second.num_reused == 4
    assert all(b.ref_count == 2 for b in second.blocks[:2])
    manager.free(first)
    manager.free(second)
    assert pool.num_free == pool.num_blocks


def test_salts_do_not_share_blocks():
    manager = KVCacheManager(BlockPool(8), 2)
    prompt = [1, 2, 3, 4, 5]
    manager.free(run_prompt(manager, Sequence(0, prompt, ROOT)))
    assert manager.get_computed_blocks(Sequence(1, prompt, ROOT_SALTED)) == []
    assert len(manager.get_computed_blocks(Sequence(2, prompt, ROOT))) == 2


def test_no_hash_root_means_no_prefix_caching():
    pool = BlockPool(8)
    manager = KVCacheManager(pool, 2)
    manager.free(run_prompt(manager, Sequence(0, [1, 2, 3, 4, 5], None)))
    assert pool.cached == {}
    seq = run_prompt(manager, Sequence(1, [1, 2, 3, 4, 5], None))
    assert seq.num_reused == 0 and seq.block_hashes == []


# --- stateful: random programs against a shadow model ------------------------

ALPHABET = st.integers(0, 2)
PREFIXES = [[0] * 12, [1, 2] * 6, [2, 1, 0] * 4]
MAX_LIVE = 4


def chained_hashes(root: bytes, tokens, block_size: int) -> list[bytes]:
    """The hash chain recomputed from scratch with hash_block only."""
    hashes, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, list(tokens[start : start + block_size]))
        hashes.append(parent)
    return hashes


class PoolMachine(RuleBasedStateMachine):
    """Drives KVCacheManager + BlockPool the way the engine does.

    The shadow model keeps, independently of the pool: every block's expected
    reference count, the LRU order of the free queue, which hash each block
    holds, and what was written into each block (the root and every token
    before its end, since KV depends on the whole prefix). The last one is the
    oracle for "never serve the wrong prefix": it does not look at hashes.
    """

    @initialize(num_blocks=st.integers(4, 16), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks, block_size):
        self.bs = block_size
        self.pool = BlockPool(num_blocks)
        self.manager = KVCacheManager(self.pool, block_size)
        # The manager installs its own hook (it tells the connector); watch
        # every call to it without replacing it.
        manager_hook = self.pool.on_evict

        def on_evict(evicted):
            for block in evicted:
                self._on_evict(block)
            manager_hook(evicted)

        self.pool.on_evict = on_evict
        self.live: dict[int, Sequence] = {}
        self.next_id = 0
        self.history: list[list[int]] = [list(p) for p in PREFIXES]
        # Shadow model.
        self.ref = [0] * num_blocks
        self.free_order = list(range(num_blocks))
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.content: list[tuple | None] = [None] * num_blocks
        self.shadow_blocks: dict[int, list[int]] = {}
        self.shadow_cached_upto: dict[int, int] = {}
        self.expected_evictions: list[int] = []
        self.hook_calls: list[int] = []

    # -- the hook ---------------------------------------------------------

    def _on_evict(self, block: Block) -> None:
        # Before reuse: unreferenced, still hashed, still in the map.
        assert block.ref_count == 0
        assert block.block_hash is not None
        assert self.pool.cached.get(block.block_hash) is block
        assert block.block_hash == self.hash_of[block.block_id]
        self.hook_calls.append(block.block_id)

    # -- shadow helpers ---------------------------------------------------

    def _shadow_cached(self) -> dict[bytes, int]:
        return {hh: bid for bid, hh in enumerate(self.hash_of) if hh is not None}

    def _shadow_allocate(self, n: int) -> list[int]:
        taken, self.free_order = self.free_order[:n], self.free_order[n:]
        for bid in taken:
            if self.hash_of[bid] is not None:
                self.expected_evictions.append(bid)
                self.hash_of[bid] = None
            self.content[bid] = None
            self.ref[bid] = 1
        return taken

    def _shadow_cache(self, seq: Sequence) -> None:
        """Mirror KVCacheManager.cache_blocks: first block to claim a hash keeps it."""
        rid = seq.request_id
        known = min(seq.num_computed, len(seq.tokens))
        full = known // self.bs
        start = self.shadow_cached_upto[rid]
        if full <= start:
            return
        cached = self._shadow_cached()
        hashes = chained_hashes(seq.hash_root, seq.tokens[:known], self.bs)
        for i in range(start, full):
            bid = self.shadow_blocks[rid][i]
            if self.hash_of[bid] is None and hashes[i] not in cached:
                self.hash_of[bid] = hashes[i]
                cached[hashes[i]] = bid
        self.shadow_cached_upto[rid] = full

    def _shadow_free(self, rid: int) -> None:
        for bid in reversed(self.shadow_blocks.pop(rid)):
            self.ref[bid] -= 1
            if self.ref[bid] == 0:
                self.free_order.append(bid)
        self.shadow_cached_upto.pop(rid)

    # -- rules ------------------------------------------------------------

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def start(self, data):
        base = data.draw(st.sampled_from(self.history), label="base")
        keep = data.draw(st.integers(0, len(base)), label="keep")
        suffix = data.draw(st.lists(ALPHABET, max_size=5), label="suffix")
        prompt = base[:keep] + suffix
        if not prompt:
            prompt = [0]
        root = data.draw(st.sampled_from([ROOT, ROOT, ROOT_SALTED]), label="root")
        seq = Sequence(self.next_id, prompt, root)
        self.next_id += 1

        # Expected hits, from the shadow map.
        usable = (len(prompt) - 1) // self.bs
        cached = self._shadow_cached()
        expected = []
        for hh in chained_hashes(root, prompt, self.bs)[:usable]:
            if hh not in cached:
                break
            expected.append(cached[hh])

        self.manager.admit(seq)

        assert seq.block_table == expected
        assert len(expected) <= usable  # never the whole prompt
        for i, bid in enumerate(expected):
            # The hit's KV was computed from exactly this prefix.
            assert self.content[bid] == (root, tuple(prompt[: (i + 1) * self.bs]))
            assert self.pool.blocks[bid].block_hash == chained_hashes(root, prompt, self.bs)[i]
            if self.ref[bid] == 0:
                self.free_order.remove(bid)
            self.ref[bid] += 1
        assert seq.num_computed == len(expected) * self.bs
        assert seq.cached_tokens["pool"] == seq.num_reused == seq.num_computed
        self.live[seq.request_id] = seq
        self.shadow_blocks[seq.request_id] = list(expected)
        self.shadow_cached_upto[seq.request_id] = len(expected)

    @precondition(lambda self: any(s.num_computed < len(s.tokens) for s in self.live.values()))
    @rule(data=st.data())
    def compute(self, data):
        """Write KV for the next n known tokens; usually register full blocks."""
        pending = [s for s in self.live.values() if s.num_computed < len(s.tokens)]
        seq = data.draw(st.sampled_from(pending), label="seq")
        rid = seq.request_id
        n = data.draw(st.integers(1, len(seq.tokens) - seq.num_computed), label="n")
        needed = blocks_for(seq.num_computed + n, self.bs) - len(seq.blocks)
        evictions_before = self.pool.evictions

        try:
            self.manager.allocate_slots(seq, n)
        except PoolExhaustedError:
            # Only when it really does not fit, and then nothing moved.
            assert needed > self.pool.num_free == len(self.free_order)
            assert seq.block_table == self.shadow_blocks[rid]
            assert self.pool.evictions == evictions_before
            return
        assert needed <= len(self.free_order)
        new = self._shadow_allocate(max(needed, 0))
        self.shadow_blocks[rid].extend(new)
        assert seq.block_table == self.shadow_blocks[rid]

        # Write: only into blocks this sequence alone holds and nobody cached.
        tokens = seq.tokens
        for pos in range(seq.num_computed, seq.num_computed + n):
            bid = seq.blocks[pos // self.bs].block_id
            assert self.ref[bid] == 1 and self.pool.blocks[bid].block_hash is None
            self.content[bid] = (seq.hash_root, tuple(tokens[: pos + 1]))
        seq.num_computed += n

        if data.draw(st.booleans(), label="cache now"):
            self._shadow_cache(seq)
            self.manager.cache_blocks(seq)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), output=st.lists(ALPHABET, min_size=1, max_size=4))
    def append_output(self, data, output):
        seq = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda s: s.request_id)))
        seq.output.extend(output)
        self._shadow_cache(seq)
        self.manager.cache_blocks(seq)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), register=st.booleans())
    def finish(self, data, register):
        """A sequence ends (register=True) or is aborted without registering."""
        rid = data.draw(st.sampled_from(sorted(self.live)), label="rid")
        seq = self.live.pop(rid)
        if register:
            self._shadow_cache(seq)
            self.manager.cache_blocks(seq)
        self.manager.free(seq)
        self._shadow_free(rid)
        assert seq.blocks == []
        if seq.hash_root == ROOT:
            self.history.append(seq.tokens)

    # -- invariants -------------------------------------------------------

    @invariant()
    def ref_counts_match_holders(self):
        holders = [0] * self.pool.num_blocks
        for seq in self.live.values():
            for block in seq.blocks:
                holders[block.block_id] += 1
        actual = [b.ref_count for b in self.pool.blocks]
        assert min(actual) >= 0
        assert actual == holders == self.ref

    @invariant()
    def free_queue_is_exactly_the_unreferenced_blocks_in_lru_order(self):
        queued = free_ids(self.pool)
        assert len(queued) == len(set(queued)) == self.pool.free_queue.size == self.pool.num_free
        assert set(queued) == {b.block_id for b in self.pool.blocks if b.ref_count == 0}
        assert queued == self.free_order
        for block in self.pool.blocks:
            if block.ref_count > 0:
                assert block.prev_free is None and block.next_free is None

    @invariant()
    def hash_map_and_blocks_agree(self):
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash
            assert self.pool.blocks[block.block_id] is block
        hashed = {b.block_hash: b for b in self.pool.blocks if b.block_hash is not None}
        assert hashed == self.pool.cached
        assert {hh: b.block_id for hh, b in self.pool.cached.items()} == self._shadow_cached()

    @invariant()
    def cached_blocks_hold_what_their_hash_names(self):
        for block_hash, block in self.pool.cached.items():
            root, prefix = self.content[block.block_id]
            assert len(prefix) % self.bs == 0
            assert chained_hashes(root, prefix, self.bs)[-1] == block_hash

    @invariant()
    def no_block_is_lost(self):
        assert ids(self.pool.blocks) == list(range(self.pool.num_blocks))
        in_use = sum(1 for b in self.pool.blocks if b.ref_count > 0)
        assert self.pool.num_free + in_use == self.pool.num_blocks
        usage = self.pool.usage()
        assert usage["free"] + usage["cached_free"] + usage["in_use"] == usage["num_blocks"]
        assert usage["cached"] == len(self.pool.cached)

    @invariant()
    def evictions_are_reported_once_each(self):
        assert self.hook_calls == self.expected_evictions
        assert self.pool.evictions == len(self.hook_calls)

    @invariant()
    def sequences_are_consistent(self):
        for seq in self.live.values():
            assert seq.block_table == self.shadow_blocks[seq.request_id]
            # Hits and allocations leave no spare block behind.
            assert len(seq.blocks) == blocks_for(seq.num_computed, self.bs)
            assert seq.num_cached_blocks <= seq.num_computed // self.bs
            for i, block in enumerate(seq.blocks[: seq.num_cached_blocks]):
                # A registered slot either holds the hash or lost it to an
                # earlier block with the same prefix (then it is private).
                if block.block_hash is not None:
                    assert block.block_hash == seq.block_hashes[i]


PoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPoolMachine = pytest.mark.slow(PoolMachine.TestCase)


def test_block_states_map():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.touch([b])
    pool.cache_blocks([a], [b"x" * 32])
    pool.free([a])
    assert pool.block_states() == "cs.."
