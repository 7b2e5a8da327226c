"""The recurrent manager alone (groups/recurrent.py): its checkpoint index, the
checkpoint policy, the SSD write rule and the states of a batch, with the
tiers as a fake that counts what it is asked."""

from __future__ import annotations

import mlx.core as mx

from mlxkv.cache.checkpoints import Checkpoint, CheckpointIndex, CheckpointRef
from mlxkv.cache.connector import LoadedCheckpoint
from mlxkv.cache.groups.base import Presence
from mlxkv.cache.groups.recurrent import CheckpointNeed, RecurrentManager
from mlxkv.cache.block_pool import BlockPool
from mlxkv.cache.hashing import extend_block_hashes, root_hash
from mlxkv.cache.sequence import Sequence
from mlxkv.cache.tiers import DISK, POOL

BLOCK = 4
ROOT = root_hash(b"recurrent-test")


def states(value: float):
    return ((mx.full((1, 2), value), None), (mx.full((1, 3), value),))


class FakeTiers:
    def __init__(self, refs=()):
        self.held: dict[bytes, Checkpoint] = {}
        self.found = list(refs)  # as an SSD tier's files from an earlier run
        self.asked = self.written = 0

    def has_checkpoint(self, key):
        self.asked += 1
        return key in self.held

    def load_checkpoint(self, key):
        held = self.held.get(key)
        return None if held is None else LoadedCheckpoint(key, held.states, DISK)

    def cache_checkpoint(self, checkpoint):
        self.written += 1
        self.held[checkpoint.key] = checkpoint

    def evict_checkpoint(self, checkpoint):
        self.held[checkpoint.key] = checkpoint

    def checkpoint_refs(self):
        refs, self.found = self.found, []
        return refs


def manager(tiers=None, budget=1 << 20, interval=8, ratio=0.0, per_token=1):
    return RecurrentManager((2, 1), budget, tiers or FakeTiers(), BLOCK, interval, ratio, per_token)


def tokens(n, salt=0):
    return [(7 * i + salt) % 50 + 3 for i in range(n)]


def seq_of(rid, toks, computed=0):
    seq = Sequence(rid, toks, ROOT, extend_block_hashes([], ROOT, toks, BLOCK))
    seq.num_computed = computed
    return seq


def presence(tiers=None):
    return Presence(BlockPool(4), tiers)


def run_prefill(m, seq, stops):
    """What the engine does: forwards ending at `stops`, registering after each."""
    m.start(seq.request_id, None, 0)
    for stop in stops:
        forward(m, seq, stop)


def forward(m, seq, stop):
    seq.num_computed = stop
    m.record([seq], [((mx.full((1, 2), float(stop)), None), (mx.full((1, 3), float(stop)),))])
    m.register(seq, min(seq.num_computed, len(seq.prompt)), every=True)


def test_a_prefill_leaves_checkpoints_at_the_interval_and_the_prompts_last_full_block():
    m = manager()
    seq = seq_of(0, tokens(23))  # last full block ends at 20
    assert m.prefill_stop(seq) == 8
    run_prefill(m, seq, [4, 8, 12, 16, 20, 22])
    held = sorted(ref.boundary for ref in m.index.candidates(seq.block_hashes, 5, BLOCK))
    assert held == [8, 16, 20] and len(m.store) == 3


def test_a_branch_point_is_a_prefill_stop_and_its_checkpoint_is_written_when_pending_ones_are():
    tiers = FakeTiers()
    m = manager(tiers, interval=64, ratio=1e9)  # the ratio writes nothing through
    seq = seq_of(0, tokens(23))  # another chain's blocks ended at 12: the branch point
    m.start(0, None, 0, 12)
    assert m.prefill_stop(seq) == 12
    for stop in (12, 20, 22):
        forward(m, seq, stop)
    held = sorted(ref.boundary for ref in m.index.candidates(seq.block_hashes, 5, BLOCK))
    assert held == [12, 20]
    m.leave(seq)
    assert tiers.written == 0 and m.pending == 2
    assert m.write_pending() == 2  # the chain's newest (20) and the branch point's (12)
    assert set(tiers.held) == {CheckpointRef(seq.block_hashes[i], 4 * (i + 1)).key for i in (2, 4)}
    assert m.write_pending() == 0 and m.pending == 0


def test_a_hit_is_the_largest_checkpoint_of_this_chain_and_costs_no_probe_per_boundary():
    tiers = FakeTiers()
    m = manager(tiers)
    seq = seq_of(0, tokens(40))
    run_prefill(m, seq, [8, 16, 24, 32, 39])
    other = seq_of(1, tokens(40, salt=1))  # another chain: none of its boundaries match
    assert m.longest_hit(other.block_hashes, 9, presence(tiers)) == 0 and tiers.asked == 0
    longer = seq_of(2, tokens(30) + tokens(20, salt=5))  # shares the first 7 blocks
    assert m.longest_hit(longer.block_hashes, 12, presence(tiers)) == 6  # at 24: the largest held below 28
    assert tiers.asked == 0  # found in the store: no tier asked
    need = m.needs(longer.block_hashes, 6)
    assert need.ref.boundary == 24 and not need.in_tier


def test_a_stale_index_entry_is_forgotten_and_the_next_one_tried():
    tiers = FakeTiers()
    m = manager(tiers, budget=1)  # the store keeps nothing: every checkpoint spills to the tiers
    seq = seq_of(0, tokens(40))
    run_prefill(m, seq, [8, 16])
    assert len(m.store) == 0 and len(tiers.held) == 0  # too big for the store, so never held
    ref16 = CheckpointRef(seq.block_hashes[3], 16)
    ref8 = CheckpointRef(seq.block_hashes[1], 8)
    m.index.add(ref8)
    m.index.add(ref16)
    tiers.held[ref8.key] = Checkpoint(ref8, states(8))  # the tier kept 8 but lost 16
    assert m.longest_hit(seq.block_hashes, 9, presence(tiers)) == 2 and tiers.asked == 2
    assert list(m.index.candidates(seq.block_hashes, 9, BLOCK)) == [ref8]
    assert m.longest_hit(seq.block_hashes, 9, presence(None)) == 0  # the pool alone: a tier's is no hit


def test_a_tiers_own_checkpoints_are_learned_and_loaded_into_the_store():
    first = manager()
    seq = seq_of(0, tokens(20))
    ref = CheckpointRef(seq.block_hashes[3], 16)
    tiers = FakeTiers([ref])  # e.g. an SSD file from an earlier run
    tiers.held[ref.key] = Checkpoint(ref, states(1.5))
    m = manager(tiers)
    assert first.longest_hit(seq.block_hashes, 4, presence()) == 0
    assert m.longest_hit(seq.block_hashes, 4, presence(tiers)) == 4
    checkpoint, tier = m.load(CheckpointNeed(ref, in_tier=True))
    assert tier == DISK and ref.key in m.store and m.store.anchor(ref.key) == 16  # disk anchors the chain
    assert m.load(CheckpointNeed(ref, in_tier=False)) == (m.store.get(ref.key), POOL)
    m.start(5, checkpoint, 16)
    assert m.batch_states([5])[0][0].tolist() == [[1.5, 1.5]]


def test_batch_states_stack_rows_of_one_shape_and_other_rows_run_apart():
    m = manager()
    m.start(0, None, 0)
    m.start(1, Checkpoint(CheckpointRef(b"x" * 32, 4), states(2.0)), 4)
    m.start(2, Checkpoint(CheckpointRef(b"y" * 32, 4), states(5.0)), 4)
    # A row not started beside one that has: zeros need not be a fresh state (an n-gram context).
    assert not m.stackable([0, 1]) and m.stackable([1, 2])
    slot0, slot1 = m.batch_states([1, 2])
    assert slot0[0].tolist() == [[2, 2], [5, 5]] and slot0[1] is None and slot1[0].shape == (2, 3)
    a, b = seq_of(1, tokens(9), computed=8), seq_of(2, tokens(9), computed=6)
    m.record([a, b], [((mx.array([[1.0, 1.0]]), None), (mx.ones((1, 3)),)),
                      ((mx.array([[3.0, 3.0]]), None), (mx.ones((1, 4)),))])
    assert m.batch_states([2])[0][0].tolist() == [[3.0, 3.0]]
    assert not m.stackable([1, 2])  # a state that grew in one row
    assert 8 in m._running[1].snapshots and not m._running[2].snapshots  # only a block boundary


def chat_turns(m: RecurrentManager, tiers: FakeTiers, turns: int, step: int):
    """A chat of `turns` turns, each leaving its checkpoint `step` tokens after the last;
    the last checkpoint and how many were written after each turn."""
    chat, last, written = tokens(step + 1), None, []
    for turn in range(turns):
        seq = seq_of(turn, chat)
        m.start(turn, last and m.store.get(last.key), last.boundary if last else 0)
        seq.num_computed = len(chat) // BLOCK * BLOCK
        m.record([seq], [((mx.zeros((1, 2)), None), (mx.zeros((1, 3)),))])
        m.register(seq, seq.num_computed, every=False)
        last = m._running[turn].last
        m.leave(seq)
        written.append(tiers.written)
        chat = chat + tokens(step, salt=turn + 1)
    return last, written


def test_a_leaving_checkpoint_is_written_once_the_kv_since_the_anchor_outweighs_it():
    tiers = FakeTiers()
    nbytes = Checkpoint(CheckpointRef(b"y" * 32, 4), states(0)).nbytes
    m = manager(tiers, interval=1 << 20, ratio=1.0, per_token=nbytes // 12 + 1)  # worth it from 12 tokens
    last, _ = chat_turns(m, tiers, turns=3, step=8)  # checkpoints at 8, 16, 24
    # 8: 8 tokens since 0, kept aside; 16: 16 since 0, written (and supersedes 8); 24: 8 since 16, kept.
    assert tiers.written == 1 and m.pending == 1
    assert m.write_pending() == 1 and tiers.written == 2 and m.pending == 0  # a clean close, or idle
    assert last.key in tiers.held and m.store.anchor(last.key) == 24
    assert m.write_pending() == 0  # one per chain per close or idle spell, not again


def test_the_index_forgets_its_oldest_past_its_limit():
    index = CheckpointIndex(limit=2)
    refs = [CheckpointRef(bytes([i]) * 32, 4 * (i + 1)) for i in range(3)]
    for ref in refs:
        index.add(ref)
    hashes = [r.block_hash for r in refs]
    assert [r.boundary for r in index.candidates(hashes, 3, BLOCK)] == [12, 8]


def test_with_no_kv_to_weigh_a_checkpoint_against_one_is_written_per_ratio_intervals():
    """A model of states alone (Mamba): a leaving checkpoint goes to SSD once ratio x interval
    tokens have passed since its chain's anchor."""
    tiers = FakeTiers()
    m = manager(tiers, interval=8, ratio=2.0, per_token=0)  # one write per 16 tokens
    _, written = chat_turns(m, tiers, turns=4, step=4)  # checkpoints at 4, 8, 12, 16
    assert written == [0, 0, 0, 1]  # 16 tokens since 0: written
