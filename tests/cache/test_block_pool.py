"""The block pool (mlxkv/cache/block_pool.py): ids, reference counts, empty and
cached free blocks, the hash map, growth and shrinking.

Unit tests pin the behaviours one at a time; `AllocationMachine` at the
bottom runs random programs of allocate / register / touch / free / grow /
shrink against a shadow model.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mlxkv.cache.block_pool import GROW_IF_RECENT, GROW_MIN_BLOCKS, Block, BlockPool, FreeBlockQueue
from mlxkv.cache.hashing import hash_block, root_hash
from mlxkv.errors import MlxkvError, PoolExhaustedError

ROOT = root_hash(b"mlxkv-test-fingerprint")


def h(name: str) -> bytes:
    """A stand-in block hash for pool-level tests."""
    return hash_block(ROOT, [ord(c) for c in name])


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_blocks()]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def cached_pool(num_blocks: int, hook=None) -> tuple[BlockPool, list[Block]]:
    """A pool whose blocks were all taken, registered as h("0"), h("1"), ..."""
    pool = BlockPool(num_blocks, on_evict=hook)
    blocks = pool.allocate(num_blocks)
    pool.register(blocks, [h(str(i)) for i in range(num_blocks)])
    return pool, blocks


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
    with pytest.raises(IndexError):
        FreeBlockQueue([]).popleft()


def test_hit_on_free_cached_block_is_removed_without_scanning(monkeypatch):
    pool, blocks = cached_pool(6)
    pool.free(blocks)
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]

    def no_scan(self):
        raise AssertionError("a prefix hit must not walk the free queue")

    # O(1): touching a block in the middle of the queue only relinks it.
    monkeypatch.setattr(FreeBlockQueue, "__iter__", no_scan)
    pool.touch([pool.cached[h("3")]])
    monkeypatch.undo()

    assert blocks[3].ref_count == 1
    assert free_ids(pool) == [0, 1, 2, 4, 5]
    assert pool.num_free == 5


# --- BlockPool basics --------------------------------------------------------


def test_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_new_pool_is_all_empty_in_id_order():
    pool = BlockPool(4)
    assert ids(pool.blocks) == [0, 1, 2, 3]
    assert free_ids(pool) == [0, 1, 2, 3]
    assert all(b.ref_count == 0 and b.block_hash is None for b in pool.blocks)
    assert pool.usage() == {"size_blocks": 4, "budget_blocks": 4, "free": 4, "cached_free": 0, "in_use": 0,
                            "shared": 0, "cached": 0, "evictions": 0}


def test_allocate_takes_empty_blocks_lowest_id_first_with_one_reference():
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


def test_empty_blocks_go_before_any_cached_block_is_evicted():
    """The soak's bug: a cached block was evicted while empty ones sat free behind it."""
    evicted = []
    pool = BlockPool(6, on_evict=evicted.extend)
    a = pool.allocate(6)
    pool.register(a[:3], [h("0"), h("1"), h("2")])
    pool.free(a[:3])  # cached, freed first: the least recently used
    pool.free(a[3:])  # empty (never registered), freed after
    taken = pool.allocate(3)
    assert ids(taken) == [5, 4, 3] and evicted == [] and len(pool.cached) == 3
    assert ids(pool.allocate(1)) == [0] and ids(evicted) == [0]


def test_hit_refreshes_recency():
    pool, blocks = cached_pool(3)
    pool.free(blocks)  # LRU order 0, 1, 2
    pool.touch([blocks[0]])
    pool.free([blocks[0]])  # block 0 used again: now most recent
    assert free_ids(pool) == [1, 2, 0]
    assert ids(pool.allocate(2)) == [1, 2]
    assert set(pool.cached) == {h("0")}


def test_touch_shares_a_referenced_block():
    pool, blocks = cached_pool(2)
    pool.touch([blocks[0]])
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


def test_register_first_block_keeps_the_hash():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    generation = pool.generation
    assert pool.register([a], [h("p")]) == [a]
    assert pool.generation > generation
    # Another sequence computed the same prefix: its block stays private.
    assert pool.register([b, c], [h("p"), h("q")]) == [c]
    assert pool.cached == {h("p"): a, h("q"): c}
    assert b.block_hash is None
    # A block keeps the hash it was registered under; nothing changed, no new generation.
    generation = pool.generation
    assert pool.register([a], [h("r")]) == []
    assert a.block_hash == h("p") and pool.generation == generation


def test_usage_counts_cached_free_blocks():
    pool, blocks = cached_pool(4)
    pool.free(blocks[:2])
    pool.touch([blocks[2]])
    assert pool.usage() == {"size_blocks": 4, "budget_blocks": 4, "free": 0, "cached_free": 2, "in_use": 2,
                            "shared": 1, "cached": 4, "evictions": 0}


def test_block_states_map():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.touch([b])
    pool.register([a], [b"x" * 32])
    pool.free([a])
    assert pool.block_states() == "cs.."


# --- eviction hook -----------------------------------------------------------


def test_eviction_hook_runs_once_per_allocation_with_every_evicted_block_before_reuse():
    calls = []

    def hook(evicted):
        # Still carrying their hashes, still findable, not yet handed out.
        calls.append([(b.block_id, b.block_hash, b.ref_count, pool.cached.get(b.block_hash)) for b in evicted])

    pool, blocks = cached_pool(4, hook=hook)
    generation = pool.generation
    pool.free(blocks[:3])  # free: 0, 1, 2 cached; 3 still referenced
    taken = pool.allocate(2)
    assert ids(taken) == [0, 1]
    assert calls == [[(0, h("0"), 0, blocks[0]), (1, h("1"), 0, blocks[1])]]  # one call: one read of the pool
    assert pool.generation > generation

    # Evicted blocks are empty now: freeing and re-taking them is silent.
    pool.free(taken)
    pool.allocate(3)  # 0, 1 (empty), then 2 (cached)
    assert [[c[0] for c in call] for call in calls] == [[0, 1], [2]]
    assert pool.evictions == 3


def test_no_hook_calls_for_blocks_never_cached():
    calls = []
    pool = BlockPool(3, on_evict=calls.append)
    pool.free(pool.allocate(3))
    pool.allocate(3)
    assert calls == [] and pool.evictions == 0


def test_failing_eviction_hook_loses_no_block():
    def hook(evicted):
        raise OSError("disk full")

    pool, blocks = cached_pool(3, hook=hook)
    pool.free(blocks)
    with pytest.raises(OSError):
        pool.allocate(2)
    # Every block is free and still cached, and usable for a hit.
    assert pool.num_free == 3 and len(pool.cached) == 3
    assert free_ids(pool) == [0, 1, 2]
    pool.touch([pool.cached[h("0")]])


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


# --- growth and shrinking ----------------------------------------------------


def test_a_pool_grows_rather_than_evict_a_recently_used_block():
    evicted, grown = [], []
    pool = BlockPool(1000, initial=16, on_evict=evicted.extend, on_grow=grown.append)
    a = pool.allocate(16)
    pool.register(a, [h(str(i)) for i in range(16)])
    pool.free(a)  # just used: the working set
    pool.allocate(4)
    assert evicted == [] and grown == [32] and len(pool.cached) == 16


def test_a_pool_evicts_an_old_block_rather_than_grow():
    """A small working set keeps a small pool: the soak's 16,384-block pool for 186 blocks in use."""
    evicted, grown = [], []
    pool = BlockPool(1000, initial=16, on_evict=evicted.extend, on_grow=grown.append)
    old = pool.allocate(8)
    pool.register(old, [h(str(i)) for i in range(8)])
    pool.free(old)
    for _ in range(int(GROW_IF_RECENT * 16) + 1):  # traffic since: the old blocks age
        pool.free(pool.allocate(1))
    pool.allocate(9)  # 8 empty, then one old cached block goes
    assert grown == [] and ids(evicted) == [0]


def test_shrink_keeps_the_most_recent_cached_blocks_at_the_lowest_ids():
    evicted, shrunk = [], []
    pool = BlockPool(100, initial=40, on_evict=evicted.extend,
                      on_shrink=lambda moves, size: shrunk.append((moves, size)))
    blocks = pool.allocate(40)
    pool.register(blocks[:30], [h(str(i)) for i in range(30)])
    pool.free(blocks[:30])
    pool.free(blocks[30:])
    assert pool.peak_in_use == 40
    with pytest.raises(ValueError):  # never while a block is in use
        pool.touch([blocks[0]]) or pool.shrink(keep_cached=20)
    pool.free([blocks[0]])
    new_size = pool.shrink(keep_cached=20)
    assert new_size == 20 == pool.size and len(pool.cached) == 20
    assert ids(evicted) == list(range(1, 11))  # the least recently used ten spill (0 was touched last)
    assert shrunk == [([(11 + i, i) for i in range(19)] + [(0, 19)], 20)]
    assert sorted(ids(pool.blocks)) == list(range(20))
    assert pool.cached[h("11")].block_id == 0 and pool.cached[h("0")].block_id == 19 and pool.peak_in_use == 0
    assert pool.num_free == 100 and ids(pool.allocate(1)) == [0]  # grows again on demand


def test_shrink_keeps_at_least_a_growth_step():
    pool = BlockPool(100, initial=40)
    pool.free(pool.allocate(40))
    assert pool.shrink(keep_cached=0) == GROW_MIN_BLOCKS and pool.size == GROW_MIN_BLOCKS


# --- stateful: no cached block is evicted while an empty block is free -------

NAMES = [bytes([i]) * 32 for i in range(64)]


class AllocationMachine(RuleBasedStateMachine):
    """Random programs of allocate / register / touch / free / shrink on a growing pool.

    The shadow keeps each block's expected reference count and hash; the
    eviction hook checks, at every eviction, that no empty block was free.
    """

    @initialize(budget=st.integers(4, 48), initial=st.integers(1, 16))
    def setup(self, budget, initial):
        self.pool = BlockPool(budget, initial=initial, on_evict=self._on_evict, on_shrink=lambda m, s: None)
        self.held: list[Block] = []  # one entry per reference
        self.evicted = 0
        self.shrinking = False

    def _on_evict(self, blocks):
        empty_free = [b for b in self.pool.free_blocks() if b.block_hash is None]
        assert self.shrinking or not empty_free, "a cached block is evicted while an empty one is free"
        assert all(b.ref_count == 0 and b.block_hash is not None for b in blocks)
        self.evicted += len(blocks)

    @rule(n=st.integers(0, 8))
    def allocate(self, n):
        if n > self.pool.num_free:
            with pytest.raises(PoolExhaustedError):
                self.pool.allocate(n)
            return
        taken = self.pool.allocate(n)
        assert all(b.ref_count == 1 and b.block_hash is None for b in taken)
        self.held += taken

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def register(self, data):
        block = data.draw(st.sampled_from(self.held))
        name = data.draw(st.sampled_from(NAMES))
        fresh = block.block_hash is None and name not in self.pool.cached
        assert self.pool.register([block], [name]) == ([block] if fresh else [])

    @precondition(lambda self: self.pool.cached)
    @rule(data=st.data())
    def touch(self, data):
        block = data.draw(st.sampled_from(sorted(self.pool.cached.values(), key=lambda b: b.block_id)))
        self.pool.touch([block])
        self.held.append(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        block = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.free([block])

    @precondition(lambda self: not self.held)
    @rule(keep=st.integers(0, 20))
    def shrink(self, keep):
        self.shrinking = True
        self.pool.shrink(keep_cached=keep)
        self.shrinking = False

    @invariant()
    def every_block_is_free_or_held_exactly(self):
        counts = {}
        for block in self.held:
            counts[block.block_id] = counts.get(block.block_id, 0) + 1
        assert {b.block_id: b.ref_count for b in self.pool.blocks if b.ref_count} == counts
        free = free_ids(self.pool)
        assert len(free) == len(set(free))
        assert set(free) == {b.block_id for b in self.pool.blocks if b.ref_count == 0}
        assert ids(self.pool.blocks) == list(range(self.pool.size)) and self.pool.size <= self.pool.budget
        assert self.pool.num_free == len(free) + self.pool.budget - self.pool.size

    @invariant()
    def hash_map_and_blocks_agree(self):
        hashed = {b.block_hash: b for b in self.pool.blocks if b.block_hash is not None}
        assert hashed == self.pool.cached
        assert self.pool.evictions == self.evicted


AllocationMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestAllocationMachine = pytest.mark.slow(AllocationMachine.TestCase)
