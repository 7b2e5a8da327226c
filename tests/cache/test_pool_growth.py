"""The pool grows on demand, up to its budget: memory as sequences need it, never a
different answer."""

from __future__ import annotations

import pytest

from family_support import model_with_oracle, prompt_of
from mlxkv.cache.block_pool import GROW_MIN_BLOCKS, BlockPool
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.errors import PoolExhaustedError
from mlxkv.models.tiny import TinyModelSpec


def test_a_pool_starts_small_and_grows_in_chunks_up_to_its_budget():
    grown = []
    pool = BlockPool(100, initial=4, on_grow=grown.append)
    assert (pool.size, pool.budget, pool.num_free) == (4, 100, 100)
    pool.allocate(3)
    assert grown == []
    pool.allocate(5)  # 1 left, 5 wanted: a chunk
    assert grown == [4 + GROW_MIN_BLOCKS] and pool.size == 20 and pool.num_free == 92
    big = pool.allocate(80)
    assert pool.size == 88 and grown[-1] == 88 and pool.num_free == 12 and len(big) == 80
    with pytest.raises(PoolExhaustedError):
        pool.allocate(13)


def test_growth_comes_before_evicting_a_recently_used_block():
    evicted = []
    pool = BlockPool(40, initial=4, on_evict=evicted.extend)
    blocks = pool.allocate(4)
    pool.register(blocks, [bytes([i]) * 32 for i in range(4)])
    pool.free(blocks)
    pool.allocate(4)  # all four free blocks are cached, and were just used: grow instead
    assert evicted == [] and len(pool.cached) == 4 and pool.size > 4
    pool.allocate(pool.num_free - 4)  # up to the budget, and the cached ones still there
    assert evicted == [] and pool.size == 40
    pool.allocate(2)  # no room left to grow: now the LRU cached blocks go
    assert len(evicted) == 2 and len(pool.cached) == 2


def test_a_failed_growth_changes_nothing():
    def no_memory(size):
        raise MemoryError("no room for the new blocks")

    pool = BlockPool(64, initial=2, on_grow=no_memory)
    with pytest.raises(MemoryError):
        pool.allocate(3)
    assert pool.size == 2 and pool.num_free == 64 and pool.usage()["free"] == 2


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return model_with_oracle(tmp_path_factory.mktemp("growth") / "llama", TinyModelSpec(family="llama", seed=51))


def test_greedy_output_is_identical_across_growth_steps(llama):
    _, loaded, reference = llama
    engine = Engine(loaded, CacheConfig(block_size=16, num_blocks=512, memory_tier_bytes=0))
    assert engine.stats()["pool"]["size_blocks"] == GROW_MIN_BLOCKS
    sizes = []
    for n in (20, 300, 700):  # each prompt makes the pool grow again
        prompt = prompt_of(n, salt=n)
        assert engine.generate(prompt, max_tokens=24).tokens == reference(prompt, 24)
        sizes.append(engine.stats()["pool"]["size_blocks"])
    assert sizes[0] < sizes[1] < sizes[2] <= 512
    stats = engine.stats()
    assert stats["pool"]["budget_blocks"] == 512 and stats["pool_bytes"] == sizes[2] * stats["kv_bytes_per_block"]
    # The blocks made on the way still serve prefix hits.
    again = prompt_of(700, salt=700) + [5]
    result = engine.generate(again, max_tokens=8)
    assert result.stats.cached_tokens["pool"] == 688 and result.tokens == reference(again, 8)


def test_a_batch_grows_the_pool_and_each_row_equals_its_solo_run(llama):
    _, loaded, reference = llama
    engine = Engine(loaded, CacheConfig(block_size=16, num_blocks=200, memory_tier_bytes=0))
    prompts = [prompt_of(90 + 13 * i, salt=i) for i in range(6)]
    for prompt, result in zip(prompts, engine.generate_batch(prompts, max_tokens=16)):
        assert result.tokens == reference(prompt, 16)
    assert GROW_MIN_BLOCKS < engine.stats()["pool"]["size_blocks"] <= 200


def test_the_pool_view_follows_a_growing_pool(llama):
    from mlxkv.host.pool_view import PoolWatcher

    _, loaded, _ = llama
    engine = Engine(loaded, CacheConfig(block_size=16, num_blocks=512, memory_tier_bytes=0))
    watcher = PoolWatcher.of(engine)
    records = []
    engine.loop.add(engine.make_request(prompt_of(600), records.append, max_tokens=4))
    engine.loop.step()  # admitted and prefilled: the pool grew mid-turn
    snapshot = watcher.snapshot()
    assert len(snapshot.states) == len(snapshot.marks) == engine.block_pool.size > GROW_MIN_BLOCKS
    assert snapshot.usage["budget_blocks"] == 512 and snapshot.mark_counts["n"] > 0
    while engine.loop.has_work:
        engine.loop.step()


def test_on_metal_the_default_budget_respects_the_recommended_working_set():
    from mlxkv.cache.kv_pool import KVLayout
    from mlxkv.cache.pool_sizing import size_pool
    import mlx.core as mx

    class Metal:
        def __init__(self, recommended):
            self.recommended = recommended

        def is_metal(self):
            return True

        def recommended_bytes(self):
            return self.recommended

    layout = KVLayout(4, 2, 128, 128, 16, mx.float16)  # 64 KiB blocks
    roomy = size_pool(CacheConfig().engine_config(), layout, max_context=1 << 20, device=Metal(1 << 50))
    tight = size_pool(CacheConfig().engine_config(), layout, max_context=1 << 20, device=Metal(8 << 30))
    assert tight == (8 << 30) // 4 // layout.bytes_per_block < roomy
    # An explicit size is taken as asked.
    assert size_pool(CacheConfig(num_blocks=99).engine_config(), layout, max_context=None, device=Metal(1 << 20)) == 99


def test_an_idle_engine_gives_memory_back_and_answers_the_same(llama):
    _, loaded, reference = llama
    engine = Engine(loaded, CacheConfig(block_size=16, num_blocks=512, memory_tier_bytes=64 << 20,
                                        idle_shrink_s=60))
    prompts = [prompt_of(300 + 40 * i, salt=90 + i) for i in range(4)]  # one at a time: a small working set
    for prompt in prompts:
        engine.generate(prompt, max_tokens=4)
    busy = engine.stats()["pool"]["size_blocks"]
    peak = engine.block_pool.peak_in_use
    engine.idle(30)  # a short pause changes nothing
    assert engine.stats()["pool"]["size_blocks"] == busy
    engine.idle(60)
    after = engine.stats()
    assert after["pool"]["size_blocks"] == peak < busy
    assert after["pool_bytes"] == peak * after["kv_bytes_per_block"]
    assert after["connector"]["memory"]["spills"] > 0  # what left the pool went to the memory tier
    engine.idle(600)  # once per busy spell: nothing more to give
    assert engine.stats()["pool"]["size_blocks"] == peak
    # Every prompt still answers the same, from the pool or the memory tier.
    for prompt in prompts:
        again = engine.generate(prompt + [7], max_tokens=6)
        assert again.tokens == reference(prompt + [7], 6)
        assert sum(again.stats.cached_tokens.values()) == len(prompt) // 16 * 16


def test_a_model_of_states_alone_budgets_checkpoints_not_blocks():
    from mlxkv.cache.kv_pool import KVLayout
    from mlxkv.cache.pool_sizing import STATELESS_BLOCKS, checkpoint_budget, size_pool
    import mlx.core as mx

    layout = KVLayout(0, 1, 1, 1, 16, mx.float32)  # no page layers: blocks hold nothing
    assert layout.bytes_per_block == 0
    assert size_pool(CacheConfig(num_blocks=8).engine_config(), layout, max_context=None) == STATELESS_BLOCKS
    assert checkpoint_budget(CacheConfig(memory_budget_bytes=1 << 30).engine_config(), layout, STATELESS_BLOCKS) == 1 << 30
    assert checkpoint_budget(CacheConfig().engine_config(), layout, STATELESS_BLOCKS) > 0
