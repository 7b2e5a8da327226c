"""The cache coordinator (mlxkv/cache/coordinator.py) on a plain model: lookup,
admission, slots, registration and release over the block pool.

Unit tests pin the behaviours one at a time; `CoordinatorMachine` at the
bottom runs random programs of start / compute / append / finish against a
shadow model and checks the pool's invariants after every step. The layer
rules alone are in tests/cache/groups/; hybrids end to end in tests/engine/.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mlxkv.cache.block_pool import Block
from mlxkv.cache.coordinator import KVCacheCoordinator
from mlxkv.cache.groups.base import blocks_for
from mlxkv.cache.hashing import hash_block, root_hash
from mlxkv.cache.layer_groups import GroupLayout
from mlxkv.cache.sequence import Sequence
from mlxkv.errors import PoolExhaustedError

ROOT = root_hash(b"mlxkv-test-fingerprint")
ROOT_SALTED = root_hash(b"mlxkv-test-fingerprint", "alice")


def coordinator(budget: int, block_size: int) -> KVCacheCoordinator:
    return KVCacheCoordinator(GroupLayout.plain(1), block_size, budget)


def admit(cache: KVCacheCoordinator, rid: int, tokens: list[int], root) -> Sequence:
    return cache.admit(rid, tokens, root, cache.lookup(tokens, root))


def compute(cache: KVCacheCoordinator, seq: Sequence, n: int) -> None:
    cache.allocate_slots(seq, n)
    cache.computed([seq], n)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def table(cache, seq) -> list[Block]:
    return cache.tables(seq)[0]


def run_prompt(cache: KVCacheCoordinator, rid: int, tokens: list[int], root=ROOT) -> Sequence:
    """What the engine does for a prompt: admit, compute all but the last token, register."""
    seq = admit(cache, rid, tokens, root)
    n = len(tokens) - 1 - seq.num_computed
    if n > 0:
        compute(cache, seq, n)
        cache.register_computed(seq)
    return seq


@pytest.mark.parametrize(
    ("prompt_len", "block_size", "expected_hits"),
    [(8, 4, 1), (9, 4, 2), (7, 4, 1), (4, 4, 0), (5, 4, 1), (1, 1, 0), (6, 1, 5), (6, 2, 2)],
)
def test_lookup_never_covers_the_whole_prompt(prompt_len, block_size, expected_hits):
    cache = coordinator(16, block_size)
    prompt = list(range(prompt_len))
    # A longer earlier request has every block of this prompt cached.
    cache.release(run_prompt(cache, 0, prompt + [99] * (block_size + 1)))
    hit = cache.lookup(prompt, ROOT)
    assert hit.num_blocks == expected_hits == hit.usable == (prompt_len - 1) // block_size
    seq = cache.admit(1, prompt, ROOT, hit)
    assert seq.num_computed == expected_hits * block_size < prompt_len
    assert seq.cached_tokens["pool"] == seq.num_reused == seq.num_computed
    assert seq.num_cached_blocks == expected_hits
    assert table(cache, seq) == hit.pool_blocks


def test_only_full_blocks_are_registered():
    cache = coordinator(4, 4)
    seq = admit(cache, 0, list(range(10)), ROOT)
    compute(cache, seq, 6)
    cache.register_computed(seq)
    blocks = table(cache, seq)
    assert len(blocks) == 2
    assert blocks[0].block_hash is not None and blocks[1].block_hash is None
    assert len(cache.pool.cached) == 1 and seq.num_cached_blocks == 1
    compute(cache, seq, 2)
    cache.register_computed(seq)
    assert blocks[1].block_hash is not None
    assert len(cache.pool.cached) == 2 and seq.num_cached_blocks == 2


def test_registration_only_uses_known_tokens():
    # The engine queues the next decode step before it knows its token, so
    # num_computed can run ahead of the tokens: only known tokens are hashed.
    cache = coordinator(4, 2)
    seq = admit(cache, 0, [1, 2, 3], ROOT)
    compute(cache, seq, 4)
    cache.register_computed(seq)
    assert seq.num_cached_blocks == 1 and len(cache.pool.cached) == 1
    seq.output.append(4)
    cache.register_computed(seq)
    assert seq.num_cached_blocks == 2
    assert table(cache, seq)[1].block_hash == hash_block(hash_block(ROOT, [1, 2]), [3, 4])


def test_allocate_slots_only_adds_missing_blocks():
    cache = coordinator(8, 4)
    seq = admit(cache, 0, [5], ROOT)
    cache.allocate_slots(seq, 3)
    assert len(table(cache, seq)) == 1
    cache.allocate_slots(seq, 4)
    assert len(table(cache, seq)) == 1
    cache.allocate_slots(seq, 5)
    assert len(table(cache, seq)) == 2
    assert cache.slots_needed(seq, 9) == 1
    assert blocks_for(0, 4) == 0 and blocks_for(4, 4) == 1 and blocks_for(5, 4) == 2


def test_allocate_slots_that_cannot_fit_changes_nothing():
    cache = coordinator(2, 2)
    seq = admit(cache, 0, [5], ROOT)
    cache.allocate_slots(seq, 2)
    with pytest.raises(PoolExhaustedError):
        cache.allocate_slots(seq, 5)
    assert len(table(cache, seq)) == 1 and cache.pool.num_free == 1


def test_a_released_sequence_frees_tail_first():
    cache = coordinator(6, 2)
    seq = run_prompt(cache, 0, list(range(7)))  # 3 full blocks
    held = ids(table(cache, seq))
    cache.release(seq)
    assert cache.held(seq) == [] and held == [0, 1, 2]
    # The empty blocks first, then its cached ones, last first.
    assert [b.block_id for b in cache.pool.free_blocks()] == [3, 4, 5, 2, 1, 0]
    # Pressure evicts the sequence's last full block first: the prefix survives.
    cache.pool.allocate(4)
    assert set(ids(cache.pool.cached.values())) == {held[0], held[1]}
    assert ids(cache.lookup(list(range(7)), ROOT).pool_blocks) == held[:2]


def test_a_second_request_hits_the_first_requests_blocks():
    cache = coordinator(8, 2)
    first = run_prompt(cache, 0, [1, 2, 3, 4, 5, 6])
    second = run_prompt(cache, 1, [1, 2, 3, 4, 9, 9])
    # Shared while both run.
    assert table(cache, second)[:2] == table(cache, first)[:2]
    assert second.cached_tokens["pool"] == second.num_reused == 4
    assert all(b.ref_count == 2 for b in table(cache, second)[:2])
    cache.release(first)
    cache.release(second)
    assert cache.pool.num_free == cache.pool.budget


def test_salts_do_not_share_blocks():
    cache = coordinator(8, 2)
    prompt = [1, 2, 3, 4, 5]
    cache.release(run_prompt(cache, 0, prompt))
    assert cache.lookup(prompt, ROOT_SALTED).num_blocks == 0
    assert cache.lookup(prompt, ROOT).num_blocks == 2


def test_no_hash_root_means_no_prefix_caching():
    cache = coordinator(8, 2)
    cache.release(run_prompt(cache, 0, [1, 2, 3, 4, 5], root=None))
    assert cache.pool.cached == {}
    seq = run_prompt(cache, 1, [1, 2, 3, 4, 5], root=None)
    assert seq.num_reused == 0 and seq.block_hashes == []


def test_a_lookup_is_valid_while_the_generation_stands():
    cache = coordinator(16, 2)
    hit = cache.lookup([1, 2, 3, 4, 5], ROOT)
    assert hit.generation == cache.generation
    seq = admit(cache, 0, [7, 7, 7], ROOT)
    cache.allocate_slots(seq, 2)  # slots alone change no lookup
    assert hit.generation == cache.generation
    cache.computed([seq], 2)
    cache.register_computed(seq)  # a block came: a lookup may answer differently now
    assert hit.generation != cache.generation


def test_a_connector_needs_the_kv_pool():
    from mlxkv.cache.connector import NoopKVCacheConnector

    with pytest.raises(ValueError):
        KVCacheCoordinator(GroupLayout.plain(1), 4, 8, connector=NoopKVCacheConnector())


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


class CoordinatorMachine(RuleBasedStateMachine):
    """Drives the coordinator and its pool the way the engine does.

    The shadow model keeps, independently of the pool: every block's expected
    reference count, the empty blocks (a stack) and the cached free ones in
    LRU order, which hash each block holds, and what was written into each
    block (the root and every token before its end, since KV depends on the
    whole prefix). The last one is the oracle for "never serve the wrong
    prefix": it does not look at hashes.
    """

    @initialize(num_blocks=st.integers(4, 16), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks, block_size):
        self.bs = block_size
        self.cache = coordinator(num_blocks, block_size)
        self.pool = self.cache.pool
        # The coordinator installed its own hook (it tells the connector);
        # watch every call to it without replacing it.
        hook = self.pool.on_evict

        def on_evict(evicted):
            for block in evicted:
                self._on_evict(block)
            hook(evicted)

        self.pool.on_evict = on_evict
        self.live: dict[int, Sequence] = {}
        self.next_id = 0
        self.history: list[list[int]] = [list(p) for p in PREFIXES]
        # Shadow model.
        self.ref = [0] * num_blocks
        self.empty = list(range(num_blocks))[::-1]  # a stack: the last is taken first
        self.lru: list[int] = []
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.content: list[tuple | None] = [None] * num_blocks
        self.shadow_blocks: dict[int, list[int]] = {}
        self.shadow_cached_upto: dict[int, int] = {}
        self.expected_evictions: list[int] = []
        self.hook_calls: list[int] = []

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
        k = min(n, len(self.empty))
        taken = self.empty[len(self.empty) - k:][::-1]
        self.empty = self.empty[: len(self.empty) - k]
        evicted, self.lru = self.lru[: n - k], self.lru[n - k:]
        for bid in evicted:
            self.expected_evictions.append(bid)
            self.hash_of[bid] = None
        for bid in taken + evicted:
            self.content[bid] = None
            self.ref[bid] = 1
        return taken + evicted

    def _shadow_register(self, seq: Sequence) -> None:
        """First block to claim a hash keeps it."""
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
                (self.lru if self.hash_of[bid] is not None else self.empty).append(bid)
        self.shadow_cached_upto.pop(rid)

    # -- rules ------------------------------------------------------------

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def start(self, data):
        base = data.draw(st.sampled_from(self.history), label="base")
        keep = data.draw(st.integers(0, len(base)), label="keep")
        suffix = data.draw(st.lists(ALPHABET, max_size=5), label="suffix")
        prompt = (base[:keep] + suffix) or [0]
        root = data.draw(st.sampled_from([ROOT, ROOT, ROOT_SALTED]), label="root")

        # Expected hits, from the shadow map.
        usable = (len(prompt) - 1) // self.bs
        cached = self._shadow_cached()
        expected = []
        for hh in chained_hashes(root, prompt, self.bs)[:usable]:
            if hh not in cached:
                break
            expected.append(cached[hh])

        seq = admit(self.cache, self.next_id, prompt, root)
        self.next_id += 1

        assert ids(table(self.cache, seq)) == expected
        assert len(expected) <= usable  # never the whole prompt
        for i, bid in enumerate(expected):
            # The hit's KV was computed from exactly this prefix.
            assert self.content[bid] == (root, tuple(prompt[: (i + 1) * self.bs]))
            assert self.pool.blocks[bid].block_hash == chained_hashes(root, prompt, self.bs)[i]
            if self.ref[bid] == 0:
                self.lru.remove(bid)
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
        needed = blocks_for(seq.num_computed + n, self.bs) - len(table(self.cache, seq))
        evictions_before = self.pool.evictions

        try:
            self.cache.allocate_slots(seq, n)
        except PoolExhaustedError:
            # Only when it really does not fit, and then nothing moved.
            assert needed > self.pool.num_free == len(self.empty) + len(self.lru)
            assert ids(table(self.cache, seq)) == self.shadow_blocks[rid]
            assert self.pool.evictions == evictions_before
            return
        assert needed <= len(self.empty) + len(self.lru)
        self.shadow_blocks[rid].extend(self._shadow_allocate(max(needed, 0)))
        assert ids(table(self.cache, seq)) == self.shadow_blocks[rid]

        # Write: only into blocks this sequence alone holds and nobody cached.
        tokens = seq.tokens
        for pos in range(seq.num_computed, seq.num_computed + n):
            block = table(self.cache, seq)[pos // self.bs]
            assert self.ref[block.block_id] == 1 and block.block_hash is None
            self.content[block.block_id] = (seq.hash_root, tuple(tokens[: pos + 1]))
        self.cache.computed([seq], n)

        if data.draw(st.booleans(), label="register now"):
            self._shadow_register(seq)
            self.cache.register_computed(seq)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), output=st.lists(ALPHABET, min_size=1, max_size=4))
    def append_output(self, data, output):
        seq = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda s: s.request_id)))
        seq.output.extend(output)
        self._shadow_register(seq)
        self.cache.register_computed(seq)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)), label="rid")
        seq = self.live.pop(rid)
        self._shadow_register(seq)
        self.cache.release(seq)
        self._shadow_free(rid)
        assert self.cache.held(seq) == []
        if seq.hash_root == ROOT:
            self.history.append(seq.tokens)

    # -- invariants -------------------------------------------------------

    @invariant()
    def ref_counts_match_holders(self):
        holders = [0] * self.pool.size
        for seq in self.live.values():
            for block in self.cache.held(seq):
                holders[block.block_id] += 1
        actual = [b.ref_count for b in self.pool.blocks]
        assert min(actual) >= 0
        assert actual == holders == self.ref

    @invariant()
    def free_blocks_are_exactly_the_unreferenced_ones_in_order(self):
        free = [b.block_id for b in self.pool.free_blocks()]
        assert free == self.empty[::-1] + self.lru
        assert set(free) == {b.block_id for b in self.pool.blocks if b.ref_count == 0}

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
        assert ids(self.pool.blocks) == list(range(self.pool.size))
        usage = self.pool.usage()
        assert usage["free"] + usage["cached_free"] + usage["in_use"] == usage["size_blocks"]
        assert usage["cached"] == len(self.pool.cached)

    @invariant()
    def evictions_are_reported_once_each(self):
        assert self.hook_calls == self.expected_evictions
        assert self.pool.evictions == len(self.hook_calls)

    @invariant()
    def sequences_are_consistent(self):
        for seq in self.live.values():
            blocks = table(self.cache, seq)
            assert ids(blocks) == self.shadow_blocks[seq.request_id]
            # Hits and allocations leave no spare block behind.
            assert len(blocks) == blocks_for(seq.num_computed, self.bs)
            assert seq.num_cached_blocks <= seq.num_computed // self.bs
            for i, block in enumerate(blocks[: seq.num_cached_blocks]):
                # A registered slot either holds the hash or lost it to an
                # earlier block with the same prefix (then it is private).
                if block.block_hash is not None:
                    assert block.block_hash == seq.block_hashes[i]


CoordinatorMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCoordinatorMachine = pytest.mark.slow(CoordinatorMachine.TestCase)


def test_a_rank_of_a_set_hits_no_further_than_the_shortest_rank():
    # Another rank holds only the first block of this prefix (a tier write still in flight
    # there, say): every rank looks again from the shortest, so all hit one block alike.
    seen = []

    def agree(n: int) -> list[int]:
        seen.append(n)
        return [n, min(n, 1)]

    cache = KVCacheCoordinator(GroupLayout.plain(1), 4, 16, agree=agree)
    prompt = list(range(13))
    cache.release(run_prompt(cache, 0, prompt))
    seen.clear()
    assert cache.lookup(prompt, ROOT).num_blocks == 1
    assert seen == [3, 1]  # one more agreement once the ranks' lengths are equal
