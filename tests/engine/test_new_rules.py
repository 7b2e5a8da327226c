"""The families of the newer cache rules under the pool, each against mlx-lm's greedy tokens:

- gemma4_text: sliding and full layers of two K/V shapes (a global head twice as wide), in shared pages;
- deepseek_v32: latent attention and its indexer's keys, two caches per layer (a CacheList);
- llama4: chunked local attention, a full layer every fourth;
- falcon_h1: Mamba and attention in every layer (a CacheList of a state and a KV cache);
- mamba2: states alone, no attention.

Cold, a prefix hit (the next chat turn), a restart from the SSD tier, a
concurrent batch, and preemption, each with the same output as mlx-lm.
"""

from __future__ import annotations

import pytest

from family_support import (
    assert_a_restart_resumes_the_chat, assert_next_turn_reuses_the_first, model_with_oracle, prompt_of,
    run_in_new_process,
)
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.errors import PoolExhaustedError
from mlxkv.models.tiny import TinyModelSpec

BLOCK = 16
WINDOW = 32  # gemma4's window, llama4's chunk; deepseek_v32's indexer keeps 2x this many keys
SPECS = {
    "gemma4_text": TinyModelSpec(family="gemma4_text", num_layers=4, sliding_pattern=2, seed=61),
    "deepseek_v32": TinyModelSpec(family="deepseek_v32", num_layers=4, seed=62),
    "llama4": TinyModelSpec(family="llama4", num_layers=4, seed=63),
    "falcon_h1": TinyModelSpec(family="falcon_h1", num_layers=4, seed=64),
    "mamba2": TinyModelSpec(family="mamba2", num_layers=4, seed=65),
}
STATES = {"falcon_h1", "mamba2"}  # hits come from checkpoints


@pytest.fixture(scope="module", params=list(SPECS))
def family(request, tmp_path_factory):
    return (request.param, *model_with_oracle(tmp_path_factory.mktemp("rules") / request.param, SPECS[request.param]))


def engine_for(loaded, num_blocks=256, prefill_chunk=512, **cache) -> Engine:
    config = CacheConfig(block_size=BLOCK, num_blocks=num_blocks,
                         **{"memory_tier_bytes": 0, "checkpoint_interval": 2 * BLOCK, **cache})
    return Engine(loaded, config, prefill_chunk=prefill_chunk)


def test_each_family_has_its_rule(family):
    name, _, loaded, _ = family
    layout = engine_for(loaded).coordinator.group_layout
    rules = {"gemma4_text": lambda: layout.page is not None and {g.window for g in layout.groups} == {None, WINDOW},
             "deepseek_v32": lambda: layout.composites and layout.page is not None,
             "llama4": lambda: {g.chunk for g in layout.groups} == {None, WINDOW} and not layout.batched,
             "falcon_h1": lambda: layout.composites and layout.recurrent and len(layout.groups) == 1,
             "mamba2": lambda: not layout.groups and layout.recurrent}
    assert rules[name](), layout.describe()


@pytest.mark.slow  # over a second or many params: the not-slow suite's 2 minutes
@pytest.mark.parametrize("length", [1, WINDOW + 1, 130])
def test_cold_prompts_match_mlx_lm(family, length):
    _, _, loaded, reference = family
    prompt = prompt_of(length)
    assert engine_for(loaded).generate(prompt, max_tokens=40).tokens == reference(prompt, 40)


def test_a_second_chat_turn_reuses_the_whole_first_turn(family):
    _, _, loaded, reference = family
    assert_next_turn_reuses_the_first(engine_for(loaded), reference, BLOCK)


@pytest.mark.slow  # over a second or many params: the not-slow suite's 2 minutes
@pytest.mark.parametrize("extra", [1, BLOCK + 3, 3 * BLOCK])
def test_a_longer_prompt_reuses_what_it_shares(family, extra):
    name, _, loaded, reference = family
    engine = engine_for(loaded)
    base = prompt_of(90, salt=7)
    engine.generate(base, max_tokens=1)
    longer = base[:85] + prompt_of(extra, salt=9)
    result = engine.generate(longer, max_tokens=12)
    # Blocks to the shared 85 tokens' last full block; checkpoints at 32, 64 and 80.
    usable = min(80, (len(longer) - 1) // BLOCK * BLOCK)
    assert result.stats.cached_tokens["pool"] == (usable if name not in STATES or usable == 80 else 64)
    assert result.tokens == reference(longer, 12)


def test_a_running_sequence_holds_only_its_window_or_chunk(family):
    _, _, loaded, _ = family
    engine = engine_for(loaded, prefill_chunk=BLOCK)
    request = engine.make_request(prompt_of(150), lambda record: None, max_tokens=40)
    engine.loop.add(request)
    seen = []
    while engine.loop.has_work:
        engine.loop.step()
        held = [len(m.tables.held(request.request_id)) for m in engine.coordinator.attention]
        if request.seq is not None and any(held):
            seen.append((request.seq.num_computed, held))
    bound = -(-WINDOW // BLOCK) + 2  # the window or chunk (a partial block at each end) and the block being written
    for computed, held in seen:
        for group, n in zip(engine.coordinator.group_layout.groups, held):
            if group.window is None and group.chunk is None:  # the whole prompt's blocks from admission on
                assert n == -(-max(computed, 150) // BLOCK)
            else:
                assert n <= bound, (computed, held)


@pytest.mark.slow  # a few seconds per family
def test_a_batch_equals_solo_runs(family):
    _, _, loaded, reference = family
    shared = prompt_of(60, salt=1)
    prompts = [shared + prompt_of(3 * i + 1, salt=20 + i) for i in range(3)] + [prompt_of(7, salt=2), prompt_of(100)]
    results = engine_for(loaded).generate_batch(prompts, max_tokens=24)
    for prompt, result in zip(prompts, results):
        assert result.tokens == reference(prompt, 24)


@pytest.mark.slow  # a few seconds per family
def test_preemption_through_the_memory_tier_keeps_output_equal(family):
    name, _, loaded, reference = family
    # Short prompts are admitted together; their long replies then run the pool short.
    peak = engine_for(loaded).coordinator.peak_blocks(20 + 60, 512)
    engine = engine_for(loaded, num_blocks=peak + 4, memory_tier_bytes=64 << 20)
    prompts = [prompt_of(20, salt=s) for s in range(4)]
    results = engine.generate_batch(prompts, max_tokens=60)
    for prompt, result in zip(prompts, results):
        assert result.tokens == reference(prompt, 60)
    if name == "mamba2":  # a model of states alone takes no blocks: nothing runs short
        return
    assert any(r.stats.preemptions for r in results)
    again = engine.generate(prompts[0], max_tokens=60)
    assert again.stats.cached_tokens["memory"] > 0  # evicted, then hydrated back
    assert again.tokens == reference(prompts[0], 60)


def run_short_once(engine: Engine, after: int) -> None:
    """Make the pool run short once, when a request has `after` tokens: the scheduler
    then preempts its newest request, as it does when decode slots cannot be had
    (a model of states alone takes no blocks, so its pool never runs short itself)."""
    scheduler, cache = engine.loop.scheduler, engine.coordinator
    allocate, fits = cache.allocate_slots, scheduler.decode_fits
    state = {"armed": False, "done": False}

    def decode_fits():
        if not state["done"] and any(len(r.output) >= after for r in scheduler.running):
            state["armed"] = True
            return False
        return fits()

    def allocate_slots(seq, num_new, ahead=0):
        if state["armed"] and not state["done"]:
            state["done"] = True
            raise PoolExhaustedError("the pool ran short (the test's)")
        return allocate(seq, num_new, ahead)

    scheduler.decode_fits, cache.allocate_slots = decode_fits, allocate_slots


@pytest.mark.slow  # over a second or many params: the not-slow suite's 2 minutes
def test_a_request_preempted_mid_reply_resumes_with_the_same_output(family):
    _, _, loaded, reference = family
    engine = engine_for(loaded)
    run_short_once(engine, after=10)
    prompts = [prompt_of(50, salt=s) for s in range(3)]
    results = engine.generate_batch(prompts, max_tokens=30)
    assert sum(r.stats.preemptions for r in results) == 1
    for prompt, result in zip(prompts, results):
        assert result.tokens == reference(prompt, 30)


@pytest.mark.slow  # three processes per family
def test_a_new_process_restores_a_chat_from_the_ssd_tier(family, tmp_path):
    name, path, _, reference = family
    second, turn2 = assert_a_restart_resumes_the_chat(path, tmp_path / "kv", reference, BLOCK)
    # Restarted again, the same prompt: blocks to its last full block are on disk; a
    # state's checkpoints only where a request left (the first turn's end, and past this prompt).
    again = run_in_new_process(path, tmp_path / "kv", second)
    assert again["cached"]["disk"] == (turn2["cached"]["disk"] if name in STATES else (len(second) - 1) // BLOCK * BLOCK)
    assert again["tokens"] == turn2["tokens"]
