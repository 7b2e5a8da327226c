"""The connector seam, the memory tier and the tiered connector, through the real engine."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from mlx_lm.generate import stream_generate

from mlxkv.config import CacheConfig
from mlxkv.cache.block_kv import BlockKV, KVRun
from mlxkv.cache.connector import LoadedBlock, NoopKVCacheConnector
from mlxkv.connectors.memory import InMemoryKVCacheConnector
from mlxkv.engine.engine import Engine
from mlxkv.errors import MlxkvError
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model

BLOCK = 4


def tokens(n, start):
    return [(start + 11 * i) % 300 + 3 for i in range(n)]


def reference(path, prompt, max_tokens=6):
    model, tokenizer = mlx_lm.load(path)
    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]


def small_engine(path, **fields):
    # 10 blocks of 4 tokens: two 20-token conversations do not fit together.
    return Engine.load(path, CacheConfig(block_size=BLOCK, num_blocks=10, **fields))


def test_default_connector_is_noop_and_reads_nothing(llama_dir, monkeypatch):
    engine = small_engine(llama_dir, memory_tier_bytes=0)
    assert isinstance(engine.connector, NoopKVCacheConnector)
    reads, read_blocks = [], engine.kv_pool.read_blocks

    def recorded(*args, **kwargs):  # the real read, with whatever arguments the caller passes
        reads.append(args)
        return read_blocks(*args, **kwargs)

    monkeypatch.setattr(engine.kv_pool, "read_blocks", recorded)
    for start in (1, 2, 1):
        engine.generate(tokens(20, start), max_tokens=4)
    assert engine.block_pool.evictions > 0 and reads == []


def test_memory_tier_brings_back_an_evicted_prefix(llama_dir):
    engine = small_engine(llama_dir)
    a = tokens(20, 1)
    first = engine.generate(a, max_tokens=6)
    engine.generate(tokens(20, 2), max_tokens=6)  # pushes a's blocks out of the pool
    again = engine.generate(a, max_tokens=6)
    # a's first blocks may survive in the pool; the rest comes from memory.
    assert again.stats.cached_tokens["memory"] >= BLOCK
    assert again.stats.cached_tokens["pool"] + again.stats.cached_tokens["memory"] == 16
    assert again.tokens == first.tokens == reference(llama_dir, a)
    s = engine.stats()["connector"]["memory"]
    assert s["spills"] > 0 and s["hydrations"] >= 1 and s["hit_tokens"] >= BLOCK


class Recorder(NoopKVCacheConnector):
    """Counts the three calls and can serve blocks it was handed."""

    def __init__(self, corrupt_after=None, wrong_hash=False, wrong_group=False):
        self.calls = {"get_computed_blocks": 0, "cache_blocks": 0, "evict_blocks": 0, "load_blocks": 0}
        self.kept: dict[bytes, BlockKV] = {}
        self.corrupt_after = corrupt_after
        self.wrong_hash = wrong_hash
        self.wrong_group = wrong_group

    def get_computed_blocks(self, hashes):
        self.calls["get_computed_blocks"] += 1
        n = 0
        while n < len(hashes) and hashes[n] in self.kept:
            n += 1
        return n

    def load_blocks(self, hashes):
        self.calls["load_blocks"] += 1
        out = [LoadedBlock(h, self.kept[h], "memory") for h in hashes]
        if self.wrong_hash and out:
            out[0] = LoadedBlock(b"\0" * 32, out[0].kv, "memory")
        if self.wrong_group and out:
            kv = out[0].kv
            out[0] = LoadedBlock(out[0].block_hash, BlockKV(kv.keys, kv.values, group=kv.group + 1), "memory")
        return out[: self.corrupt_after] if self.corrupt_after is not None else out

    def cache_blocks(self, hashes, read):
        self.calls["cache_blocks"] += 1

    def evict_blocks(self, block_hashes, read):
        self.calls["evict_blocks"] += 1
        self.kept.update(zip(block_hashes, read()))


@pytest.mark.parametrize("fault", [{}, {"corrupt_after": 0}, {"wrong_hash": True}, {"wrong_group": True}])
def test_connector_seam_and_failed_hydrate_falls_back(llama_dir, fault):
    recorder = Recorder(**fault)
    engine = small_engine(llama_dir, connector=recorder)
    a = tokens(20, 3)
    first = engine.generate(a, max_tokens=6)
    engine.generate(tokens(20, 4), max_tokens=6)
    again = engine.generate(a, max_tokens=6)
    assert all(recorder.calls[k] > 0 for k in ("get_computed_blocks", "cache_blocks", "evict_blocks"))
    assert again.tokens == first.tokens
    reused = again.stats.cached_tokens["memory"]
    if fault:  # nothing usable came back: those tokens were recomputed
        assert reused == 0
    else:
        assert reused >= BLOCK
    assert again.stats.computed_tokens == 20 - sum(again.stats.cached_tokens.values())


def _kv(value, shape=(2, 2, BLOCK, 32)):
    return BlockKV(mx.full(shape, value, mx.float32), mx.full(shape, -value, mx.float32))


@pytest.mark.parametrize("bits", [None, 8])
def test_memory_tier_keeps_each_blocks_layer_group(bits):
    pushed = []
    budget = 2 * _kv(0).nbytes if bits is None else 10 * _kv(0).nbytes
    tier = InMemoryKVCacheConnector(budget_bytes=budget, block_size=BLOCK, quantize_bits=bits,
                                    on_evict=lambda h, kv: pushed.append(kv.group))
    blocks = [_kv(float(i)) for i in range(3)]
    for i, kv in enumerate(blocks):
        kv.group = i + 1
    tier.evict_blocks([bytes([i]) * 32 for i in range(3)], lambda: blocks)
    kept = [bytes([i]) * 32 for i in range(3) if tier.contains(bytes([i]) * 32)]
    groups = [b.kv.group for b in tier.load_blocks(kept)]
    # What the tier pushes on to the SSD tier keeps its group too.
    assert (pushed, groups) == (([1], [2, 3]) if bits is None else ([], [1, 2, 3]))


def test_memory_tier_lru_budget_pushes_to_next_tier():
    pushed = []
    tier = InMemoryKVCacheConnector(budget_bytes=3 * _kv(0).nbytes, block_size=BLOCK,
                                    on_evict=lambda h, kv: pushed.append(h))
    for i in range(3):
        tier.evict_blocks([bytes([i]) * 32], lambda i=i: [_kv(float(i))])
    tier.load_blocks([bytes([0]) * 32])  # 0 becomes most recent
    tier.evict_blocks([bytes([3]) * 32], lambda: [_kv(3.0)])
    assert pushed == [bytes([1]) * 32]
    assert tier.get_computed_blocks([bytes([0]) * 32, bytes([2]) * 32, bytes([1]) * 32]) == 2
    s = tier.stats()["memory"]
    assert s["blocks_held"] == 3 and s["bytes_held"] == 3 * _kv(0).nbytes and s["evictions"] == 1


def test_a_tiered_load_from_memory_counts_one_lookup_and_its_hits_once():
    from mlxkv.connectors.tiered import TieredKVCacheConnector

    tiered = TieredKVCacheConnector(None, 4 * _kv(0).nbytes, BLOCK)
    keys = [bytes([i]) * 32 for i in range(3)]
    tiered.memory.evict_blocks(keys[:2], lambda: [_kv(0.0), _kv(1.0)])
    assert tiered.tiers_of(keys) == ["memory", "memory"]  # the coordinator's lookup
    load = tiered.begin_load(keys[:2])
    load.run()
    assert [b.block_hash for b in load.take(1 << 30)] == keys[:2]
    s = tiered.stats()["memory"]
    assert (s["lookups"], s["hit_blocks"], s["hydrations"]) == (1, 2, 2)


def test_blocks_evicted_together_are_kept_as_runs_no_longer_than_the_tier_keeps(monkeypatch):
    from mlxkv.connectors import memory

    monkeypatch.setattr(memory, "MAX_RUN_BLOCKS", 4)
    monkeypatch.setattr(memory, "RUN_SHARE", 1)
    n = 6
    tier = InMemoryKVCacheConnector(n * _kv(0).nbytes, BLOCK)
    hashes = [bytes([i]) * 32 for i in range(n)]
    one_read = KVRun.stack([_kv(float(i)) for i in range(n)])  # in prefix order, as the manager reads
    reads = []
    # Handed over last block first (the order the pool evicts), views of one read.
    tier.evict_blocks(hashes[::-1], lambda: reads.append(1) or one_read.blocks()[::-1])
    assert reads == [1]
    loaded = tier.load_blocks(hashes)
    for i, block in enumerate(loaded):
        assert mx.all(block.kv.keys == i).item() and mx.all(block.kv.values == -i).item()
    runs = [block.kv.run for block in loaded]
    assert runs[0] is runs[3] and runs[4] is runs[5] and runs[3] is not runs[4]  # cut at 4 blocks
    assert [b.kv.index for b in loaded] == [0, 1, 2, 3, 0, 1]  # in prompt order: stretches to copy
    assert tier.stats()["memory"]["spills"] == n


def test_memory_tier_packs_evicted_blocks_into_runs_in_prompt_order(monkeypatch):
    from mlxkv.connectors import memory

    run_blocks = 4
    monkeypatch.setattr(memory, "MAX_RUN_BLOCKS", run_blocks)
    monkeypatch.setattr(memory, "RUN_SHARE", 1)  # so a small budget still packs
    pushed = []
    n = run_blocks + 2
    tier = InMemoryKVCacheConnector(n * _kv(0).nbytes, BLOCK, on_evict=lambda h, kv: pushed.append(h))
    hashes = [bytes([i]) * 32 for i in range(n)]
    for i in reversed(range(n)):  # the pool evicts a freed sequence last block first
        tier.evict_blocks([hashes[i]], lambda i=i: [_kv(float(i))])
    loaded = tier.load_blocks(hashes)
    assert [b.block_hash for b in loaded] == hashes
    for i, block in enumerate(loaded):
        assert mx.all(block.kv.keys == i).item() and mx.all(block.kv.values == -i).item()
    # The first blocks evicted (2..5) are one run, in prompt order: a
    # hydrate copies them with one slice per layer.
    run = loaded[2].kv.run
    assert [b.kv.run is run for b in loaded] == [False, False] + [True] * run_blocks
    assert [b.kv.index for b in loaded[2:]] == list(range(run_blocks))
    assert tier.stats()["memory"]["bytes_held"] == n * _kv(0).nbytes
    # The budget counts what runs hold: a run's memory goes with its last block.
    for h in (b"x" * 32, b"y" * 32):
        tier.evict_blocks([h], lambda: [_kv(9.0)])
    assert pushed == hashes[:2]  # least recently used first, one block each
    tier.evict_blocks([b"z" * 32], lambda: [_kv(9.0)])
    assert pushed == hashes  # the run had to go whole to make room
    s = tier.stats()["memory"]
    assert s["blocks_held"] == 3 and s["bytes_held"] == 3 * _kv(0).nbytes and s["evictions"] == n


def test_memory_tier_runs_are_a_small_share_of_the_budget():
    from mlxkv.connectors import memory

    block = _kv(0).nbytes
    assert InMemoryKVCacheConnector(3 * block, BLOCK)._run_blocks(block) == 0  # never packs
    assert InMemoryKVCacheConnector(memory.RUN_SHARE * 8 * block, BLOCK)._run_blocks(block) == 8
    big = InMemoryKVCacheConnector(1 << 40, BLOCK)
    assert big._run_blocks(block) == memory.MAX_RUN_BLOCKS
    assert big._run_blocks(memory.RUN_BYTES // 2) == 2


def test_memory_tier_quantized_round_trip_and_size():
    full = InMemoryKVCacheConnector(1 << 30, BLOCK)
    quant = InMemoryKVCacheConnector(1 << 30, BLOCK, quantize_bits=8)
    kv = BlockKV(mx.random.normal((2, 2, BLOCK, 64)), mx.random.normal((2, 2, BLOCK, 64)))
    for tier in (full, quant):
        tier.store(b"h" * 32, kv)
    back = quant.load_blocks([b"h" * 32])[0].kv
    err = np.abs(np.array(back.keys) - np.array(kv.keys)).max()
    assert err < 0.05
    ratio = quant.stats()["memory"]["bytes_held"] / full.stats()["memory"]["bytes_held"]
    assert ratio < 0.55  # fp32 -> 8 bits plus scales: about 3.5x smaller
    with pytest.raises(MlxkvError, match="4 or 8 bits"):
        InMemoryKVCacheConnector(1, BLOCK, quantize_bits=3)


def test_quantized_memory_tier_in_the_engine(tmp_path):
    path = str(write_tiny_model(tmp_path / "hd32", TinyModelSpec(num_heads=4, num_kv_heads=2, head_dim=32, seed=7)))
    engine = small_engine(path, memory_tier_bits=8)
    a = tokens(20, 5)
    first = engine.generate(a, max_tokens=6)
    engine.generate(tokens(20, 6), max_tokens=6)
    again = engine.generate(a, max_tokens=6)
    assert again.stats.cached_tokens["memory"] >= BLOCK
    # Quantized KV may change greedy output; the first token after a
    # quantized prefix is what the benchmark reports. Here: it runs and is sane.
    assert len(again.tokens) == 6


class FailingSpill(NoopKVCacheConnector):
    def evict_blocks(self, block_hashes, read):
        raise OSError("disk full")


def test_a_failing_spill_costs_the_cached_copy_not_the_request(llama_dir, caplog):
    engine = small_engine(llama_dir, connector=FailingSpill())
    a = tokens(20, 8)
    first = engine.generate(a, max_tokens=6)
    with caplog.at_level("ERROR", logger="mlxkv"):
        engine.generate(tokens(20, 9), max_tokens=6)
    failed = [r for r in caplog.records if "could not spill" in r.getMessage()]
    assert failed and failed[0].exc_info[0] is OSError  # logged with its traceback
    assert engine.generate(a, max_tokens=6).tokens == first.tokens
    usage = engine.stats()["pool"]
    assert usage["in_use"] == 0 and usage["free"] + usage["cached_free"] == usage["size_blocks"]


class Offers(NoopKVCacheConnector):
    """Keeps what each cache_blocks call offered: the hashes and the K/V it read."""

    def __init__(self):
        self.offers = []

    def cache_blocks(self, hashes, read):
        self.offers.append((list(hashes), read()))


def test_decode_blocks_reach_the_connector_in_batches_with_their_kv(llama_dir):
    from mlxkv.cache.coordinator import STORE_BATCH_BLOCKS

    offers = Offers()
    engine = Engine.load(llama_dir, CacheConfig(block_size=BLOCK, num_blocks=64, connector=offers))
    result = engine.generate(tokens(9, 5), max_tokens=100)
    prefill, *decode = offers.offers
    assert len(prefill[0]) == 2  # the prompt's full blocks go at once
    chain = [h for hashes, _ in offers.offers for h in hashes]
    decode_blocks = len(chain) - 2
    assert decode_blocks == (9 + len(result.tokens) - 1) // BLOCK - 2 >= STORE_BATCH_BLOCKS + 1
    # Full batches while decoding, the rest when the request let go of its blocks.
    assert [len(h) for h, _ in decode] == [STORE_BATCH_BLOCKS] * (decode_blocks // STORE_BATCH_BLOCKS) + (
        [decode_blocks % STORE_BATCH_BLOCKS] if decode_blocks % STORE_BATCH_BLOCKS else []
    )
    # Each block was offered once, with the K/V the pool holds for it.
    blocks = [engine.block_pool.cached[h] for h in chain]
    assert len(blocks) == len(chain) == len(set(chain))
    held = engine.kv_pool.read_blocks([b.block_id for b in blocks])
    offered = [kv for _, kvs in offers.offers for kv in kvs]
    for got, want in zip(offered, held):
        assert mx.array_equal(got.keys, want.keys) and mx.array_equal(got.values, want.values)


class FailingStore(NoopKVCacheConnector):
    def cache_blocks(self, hashes, read):
        raise OSError("disk gone")


def test_a_failing_store_costs_the_copy_not_the_request_or_the_blocks(llama_dir, caplog):
    engine = Engine.load(llama_dir, CacheConfig(block_size=BLOCK, num_blocks=64, connector=FailingStore()))
    alone = Engine.load(llama_dir, CacheConfig(block_size=BLOCK, num_blocks=64, memory_tier_bytes=0))
    prompt = tokens(9, 6)
    with caplog.at_level("ERROR", logger="mlxkv"):
        result = engine.generate(prompt, max_tokens=40)
    assert any("could not store" in r.getMessage() and r.exc_info for r in caplog.records)
    assert result.tokens == alone.generate(prompt, max_tokens=40).tokens
    assert engine.stats()["pool"]["in_use"] == 0


class MemoryTierMachine(RuleBasedStateMachine):
    """Random evict / store-a-run / load programs over a memory tier that packs runs of 3.

    Invariants: every block held comes back with its own values; the byte
    count is what the distinct runs really hold, and stays in the budget.
    """

    N, BUDGET_BLOCKS = 10, 6

    def __init__(self):
        super().__init__()
        from mlxkv.connectors import memory

        self._saved = memory.MAX_RUN_BLOCKS, memory.RUN_SHARE
        memory.MAX_RUN_BLOCKS, memory.RUN_SHARE = 3, 2
        self.pushed = []
        self.tier = InMemoryKVCacheConnector(self.BUDGET_BLOCKS * _kv(0).nbytes, BLOCK,
                                             on_evict=lambda h, kv: self.pushed.append(h))

    def teardown(self):
        from mlxkv.connectors import memory

        memory.MAX_RUN_BLOCKS, memory.RUN_SHARE = self._saved

    @staticmethod
    def _hash(i):
        return bytes([i]) * 32

    @rule(i=st.integers(0, N - 1))
    def evict(self, i):
        self.tier.evict_blocks([self._hash(i)], lambda: [_kv(float(i))])

    @rule(start=st.integers(0, N - 1), n=st.integers(1, 3))
    def promote_a_run(self, start, n):
        ids = [(start + j) % self.N for j in range(n)]
        run = KVRun.stack([_kv(float(i)) for i in ids])
        for j, i in enumerate(ids):
            self.tier.store(self._hash(i), run.block(j))

    @rule(ids=st.lists(st.integers(0, N - 1), min_size=1, max_size=4))
    def load(self, ids):
        for block in self.tier.load_blocks([self._hash(i) for i in ids]):
            i = block.block_hash[0]
            assert mx.all(block.kv.keys == i).item() and mx.all(block.kv.values == -i).item()

    @invariant()
    def bytes_are_what_runs_hold(self):
        tier = self.tier
        runs = {id(b.run): b.run for b in tier._blocks.values()}
        s = tier.stats()["memory"]
        assert s["blocks_held"] == len(tier._blocks)
        assert s["bytes_held"] == sum(r.nbytes for r in runs.values()) <= tier.budget_bytes
        assert set(tier._live) == set(runs)


TestMemoryTierMachine = MemoryTierMachine.TestCase
TestMemoryTierMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
