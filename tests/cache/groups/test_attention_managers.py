"""The two attention rules, each alone: full attention (groups/full.py) and a sliding
window (groups/sliding.py), over a real block pool, with the tiers as a fake."""

from __future__ import annotations

import pytest

from mlxkv.cache.block_pool import BlockPool
from mlxkv.cache.groups.base import Presence
from mlxkv.cache.groups.chunked import ChunkedAttentionManager
from mlxkv.cache.groups.full import FullAttentionManager
from mlxkv.cache.groups.sliding import SlidingWindowManager
from mlxkv.cache.hashing import group_hash
from mlxkv.cache.layer_groups import KVGroup

BLOCK = 16
HASHES = [bytes([i]) * 32 for i in range(12)]


class FakeTier:
    """Holds some keys; counts how often it is asked."""

    def __init__(self, keys=()):
        self.keys = set(keys)
        self.asked = 0

    def get_computed_blocks(self, keys):
        self.asked += 1
        n = 0
        while n < len(keys) and keys[n] in self.keys:
            n += 1
        return n


def full(index=0, pool=None):
    return FullAttentionManager(KVGroup(index, None, (0,)), pool or BlockPool(64), BLOCK)


def sliding(window, index=1, pool=None):
    return SlidingWindowManager(KVGroup(index, window, (0,)), pool or BlockPool(64), BLOCK)


def cache(manager, indices):
    """Register the manager's keys of these block indices in its pool (free, cached)."""
    blocks = manager.pool.allocate(len(indices))
    manager.pool.register(blocks, [manager.key(HASHES[i]) for i in indices], manager.index)
    manager.pool.free(blocks)


# -- full attention -------------------------------------------------------------


def test_full_attention_hits_the_longest_leading_run_of_the_pool_then_the_tiers():
    manager = full()
    cache(manager, [0, 1, 2, 5])
    assert manager.longest_hit(HASHES, 12, Presence(manager.pool)) == 3
    tier = FakeTier([manager.key(HASHES[i]) for i in (3, 4, 6)])
    assert manager.longest_hit(HASHES, 12, Presence(manager.pool, tier)) == 5  # 5 is in the pool too
    assert manager.longest_hit(HASHES, 2, Presence(manager.pool, tier)) == 2  # never past the limit


def test_full_attention_needs_every_block_and_takes_a_prompts_slots_at_once():
    manager = full()
    cache(manager, [0, 1])
    needs = manager.needs(HASHES, 3)
    assert [i for i, _ in needs.pool] == [0, 1] and needs.tiers == [(2, HASHES[2])]
    assert manager.first_needed(10_000) == 0 and manager.slots_ahead()
    assert manager.peak_blocks(100, chunk=16) == 7


def test_a_groups_keys_are_its_own():
    assert full(0).key(HASHES[0]) == HASHES[0]
    assert full(2).key(HASHES[0]) == group_hash(HASHES[0], 2) != HASHES[0]


def test_a_table_registers_and_releases_its_blocks():
    manager = full()
    blocks = manager.pool.allocate(3)
    manager.start(7, 0, [])
    manager.tables.extend(7, blocks)
    assert manager.register(7, HASHES, 0, 2) == 2  # two registered, waiting to be stored
    assert [b.block_hash for b in blocks] == [HASHES[0], HASHES[1], None]
    assert manager.tables.take_unstored(7) == blocks[:2] and manager.tables.take_unstored(7) == []
    assert manager.passed(7, num_computed=48, registered=2) == []  # full attention never lets go
    assert manager.tables.release(7) == blocks and manager.tables.held(7) == []


# -- sliding window -------------------------------------------------------------


@pytest.mark.parametrize(("window", "position", "first_block"), [
    (32, 0, 0), (32, 31, 0), (32, 32, 0), (32, 47, 1), (32, 48, 1),
    (8, 20, 0), (8, 24, 1),   # a window shorter than a block
    (16, 16, 0), (16, 31, 1),  # a window of exactly one block
])
def test_a_sliding_window_needs_the_blocks_of_its_last_window_positions(window, position, first_block):
    manager = sliding(window)
    assert manager.first_needed(position) == first_block
    # The query at `position` sees `window` positions, itself included: the first is in that block.
    assert max(0, position - window + 1) // BLOCK == first_block


def test_a_sliding_hit_needs_only_the_window_before_it():
    manager = sliding(32)
    cache(manager, [6, 7])  # the window before token 8 * 16
    assert manager.longest_hit(HASHES, 8, Presence(manager.pool)) == 8
    needs = manager.needs(HASHES, 8)
    assert [i for i, _ in needs.pool] == [6, 7] and needs.tiers == []


def test_a_missing_block_caps_a_sliding_hit_and_the_scan_goes_down():
    manager = sliding(32)
    cache(manager, [0, 1, 2, 4, 5])  # 3 is missing: a hit at 6 needs 4, 5 (fine), at 7 needs 5, 6 (6 missing)
    assert manager.longest_hit(HASHES, 10, Presence(manager.pool)) == 6
    assert manager.longest_hit(HASHES, 5, Presence(manager.pool)) == 3  # at 5 needs 3, 4: capped at 3


def test_a_tier_fills_the_window_and_is_asked_once_per_key():
    manager = sliding(32)
    cache(manager, [8])
    tier = FakeTier([manager.key(HASHES[9])])
    presence = Presence(manager.pool, tier)
    assert manager.longest_hit(HASHES, 10, presence) == 10
    asked = tier.asked
    assert manager.longest_hit(HASHES, 10, presence) == 10 and tier.asked == asked  # remembered


def test_a_sliding_group_lets_go_of_registered_blocks_its_window_passed():
    manager = sliding(32)
    blocks = manager.pool.allocate(4)
    manager.start(3, 0, [])
    manager.tables.extend(3, blocks)
    assert manager.passed(3, num_computed=64, registered=4) == [0, 1]  # the token at 64 sees 33..64
    assert manager.passed(3, num_computed=64, registered=1) == [0]  # never an unregistered one
    assert manager.tables.drop(3, [0, 1]) == blocks[:2] and manager.tables.table(3) == [None, None, *blocks[2:]]
    assert manager.tables.held(3) == blocks[2:]
    assert not manager.slots_ahead()
    assert manager.peak_blocks(1000, chunk=64) == 7  # window + chunk (6 blocks), and a partial one
    assert manager.peak_blocks(40, chunk=64) == 3


# -- chunked local attention ------------------------------------------------------


def chunked(chunk, index=1, pool=None):
    return ChunkedAttentionManager(KVGroup(index, None, (0,), chunk=chunk), pool or BlockPool(64), BLOCK)


@pytest.mark.parametrize(("chunk", "position", "first_block"), [
    (64, 0, 0), (64, 63, 0), (64, 64, 4), (64, 100, 4),
    (24, 47, 1), (24, 48, 3),  # a chunk that ends inside a block: from the block holding its start
])
def test_a_chunked_query_needs_the_blocks_from_its_chunk_start(chunk, position, first_block):
    assert chunked(chunk).first_needed(position) == first_block


def test_a_chunked_hit_needs_its_chunk_so_far_and_nothing_at_a_chunk_start():
    manager = chunked(64)
    cache(manager, [5])  # half the chunk 64..127 so far, before token 6 * 16: block 4 is missing
    assert manager.longest_hit(HASHES, 6, Presence(manager.pool)) == 4  # 64 starts the chunk: nothing needed
    cache(manager, [4])
    assert manager.longest_hit(HASHES, 6, Presence(manager.pool)) == 6
    assert manager.longest_hit(HASHES, 7, Presence(manager.pool)) == 6  # 7 needs 4..6: 6 is missing
    assert manager.needs(HASHES, 8).pool == [] and manager.needs(HASHES, 8).tiers == []  # 8 * 16 starts a chunk
    assert manager.longest_hit(HASHES, 8, Presence(BlockPool(4))) == 8  # so it hits with nothing cached


def test_a_chunked_group_lets_go_of_the_blocks_before_its_chunk():
    manager = chunked(32)
    blocks = manager.pool.allocate(5)
    manager.start(4, 0, [])
    manager.tables.extend(4, blocks)
    assert manager.passed(4, num_computed=70, registered=5) == [0, 1, 2, 3]  # 70's chunk starts at 64
    assert manager.passed(4, num_computed=63, registered=5) == [0, 1]
    assert manager.peak_blocks(1000, chunk=64) == 7 and manager.peak_blocks(40, chunk=64) == 3
