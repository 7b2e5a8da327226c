"""Many sequences at once: each one's greedy output equals its solo run.

Solo runs are `Engine.generate` on a fresh engine (itself equal to mlx-lm's
stream_generate, see test_engine_equality.py); batches mix lengths, shared
and unshared prefixes, chunked prefill and preemption.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import MAX_RUNNING, PREFILL_STEP, Engine
from mlxkv.host.engine_thread import EngineThread, RequestFailed
from mlxkv.models.loader import load_model

BLOCK = 8
MAX_TOKENS = 10


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % 500 + 3 for i in range(n)]


SHARED = prompt_of(3 * BLOCK + 2, salt=40)
PROMPTS = [
    prompt_of(5, 1),
    SHARED + prompt_of(9, 2),
    prompt_of(4 * BLOCK + 3, 4),
    SHARED + prompt_of(20, 3),
    prompt_of(1, 9),
    SHARED + prompt_of(3, 5),
    SHARED,
]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request, model_dirs):
    loaded = load_model(model_dirs[request.param])
    answers = {}

    def solo_tokens(prompt, max_tokens=MAX_TOKENS):
        key = (tuple(prompt), max_tokens)
        if key not in answers:  # a fresh engine: a cold run
            answers[key] = engine_for(loaded).generate(prompt, max_tokens=max_tokens).tokens
        return answers[key]

    return loaded, solo_tokens


def engine_for(loaded, num_blocks=64, prefill_chunk=PREFILL_STEP, max_running=MAX_RUNNING, **cache) -> Engine:
    return Engine(loaded, CacheConfig(block_size=BLOCK, num_blocks=num_blocks, memory_tier_bytes=0, **cache),
                  prefill_chunk=prefill_chunk, max_running=max_running)


def assert_pool_idle(engine: Engine) -> None:
    assert all(b.ref_count == 0 for b in engine.block_pool.blocks)
    assert engine.block_pool.num_free == engine.block_pool.budget
    assert engine.loop.running == {}


def test_solo_run_matches_mlx_lm(family):
    """The oracle chain: the solo run used below is mlx-lm's output."""
    loaded, solo_tokens = family
    prompt = PROMPTS[3]
    ref = [r.token for r in stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=MAX_TOKENS)]
    assert solo_tokens(prompt) == ref


def test_batch_equals_solo_with_shared_prefixes(family):
    loaded, solo_tokens = family
    engine = engine_for(loaded)
    results = engine.generate_batch(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r.tokens for r in results] == [solo_tokens(p) for p in PROMPTS]
    # The shared prefix was computed once: later requests hit its full blocks.
    hits = [r.stats.cached_tokens["pool"] for r in results]
    assert sum(h >= 3 * BLOCK for h in hits) >= 3
    assert all(r.finish_reason == "length" and r.stats.generation_tokens == MAX_TOKENS for r in results)
    assert_pool_idle(engine)


def test_chunked_prefill_interleaves_and_still_equals_solo(family):
    loaded, solo_tokens = family
    engine = engine_for(loaded, prefill_chunk=2 * BLOCK)  # a long prompt takes several steps
    long_prompt = prompt_of(9 * BLOCK + 5, salt=77)
    records = {0: [], 1: []}
    loop = engine.loop
    loop.add(engine.make_request(prompt_of(6, 3), records[0].append, max_tokens=12))
    loop.step()
    loop.step()  # the short one is decoding
    loop.add(engine.make_request(long_prompt, records[1].append, max_tokens=4))
    while not records[1]:
        before = len(records[0])
        loop.step()
        if not records[1] and before < 12:
            assert len(records[0]) == before + 1  # a token every step while the long one prefills
    while loop.has_work:
        loop.step()
    # Solo with the same chunk size: the same prefill shapes.
    solo = engine_for(loaded, prefill_chunk=2 * BLOCK)
    assert [r.token for r in records[1]] == solo.generate(long_prompt, max_tokens=4).tokens
    assert [r.token for r in records[0]] == solo_tokens(prompt_of(6, 3), 12)
    assert_pool_idle(engine)


@pytest.mark.parametrize("num_blocks", [9, 13])
def test_preemption_resumes_on_prefix_hits_and_equals_solo(family, num_blocks):
    loaded, solo_tokens = family
    engine = engine_for(loaded, num_blocks)
    prompts = [prompt_of(2 * BLOCK + 3, s) for s in range(4)]
    results = engine.generate_batch(prompts, max_tokens=4 * BLOCK)
    preempted = [r for r in results if r.stats.preemptions]
    assert preempted, "the pool is small enough that someone must be preempted"
    assert all(r.stats.preempted_s > 0 for r in preempted)
    assert [r.tokens for r in results] == [solo_tokens(p, 4 * BLOCK) for p in prompts]
    assert_pool_idle(engine)


def test_preemption_spills_through_the_memory_tier(family):
    loaded, solo_tokens = family
    engine = Engine(loaded, CacheConfig(block_size=BLOCK, num_blocks=9, memory_tier_bytes=1 << 20))
    prompts = [prompt_of(2 * BLOCK + 3, s + 10) for s in range(3)]
    results = engine.generate_batch(prompts, max_tokens=4 * BLOCK)
    assert any(r.stats.preemptions for r in results)
    assert [r.tokens for r in results] == [solo_tokens(p, 4 * BLOCK) for p in prompts]
    assert_pool_idle(engine)


def test_bad_requests_fail_alone(family):
    loaded, solo_tokens = family
    engine = engine_for(loaded, 12)
    prompts = [PROMPTS[0], [], prompt_of(20 * BLOCK), PROMPTS[2]]
    results = engine.generate_batch(prompts, max_tokens=MAX_TOKENS)
    assert [r.finish_reason for r in results] == ["length", "error", "error", "length"]
    assert "empty" in results[1].extra["error"]
    assert "blocks" in results[2].extra["error"] and "pool has 12" in results[2].extra["error"]
    assert results[0].tokens == solo_tokens(PROMPTS[0])
    assert results[3].tokens == solo_tokens(PROMPTS[2])
    assert_pool_idle(engine)


def test_stats_report_queued_time(family):
    loaded, _ = family
    engine = engine_for(loaded, 64, max_running=1)
    results = engine.generate_batch(PROMPTS[:3], max_tokens=3)
    assert results[0].stats.queued_s < results[2].stats.queued_s
    assert results[2].stats.queued_s > 0 and results[2].stats.ttft_s >= results[2].stats.queued_s


def test_engine_thread_streams_many_requests_at_once(llama_dir):
    """Submit from several threads; each stream is its own and equals its solo run."""
    loaded = load_model(llama_dir)

    def solo_tokens(prompt):
        return engine_for(loaded).generate(prompt, max_tokens=MAX_TOKENS).tokens

    thread = EngineThread(llama_dir, CacheConfig(block_size=BLOCK, num_blocks=64, memory_tier_bytes=0)).start()
    thread.wait_ready(timeout=120)
    try:
        out: dict[int, list] = {}

        def client(i):
            out[i] = list(thread.submit(PROMPTS[i], max_tokens=MAX_TOKENS))

        clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        cancelled = thread.submit(prompt_of(30, 8), max_tokens=200)
        for c in clients:
            c.start()
        first = next(iter(cancelled))
        cancelled.cancel()
        rest = list(cancelled)
        for c in clients:
            c.join(60)
        for i in range(4):
            assert [r.token for r in out[i]] == solo_tokens(PROMPTS[i])
        assert (rest or [first])[-1].finish_reason == "cancelled" and len(rest) < 199
        assert not isinstance(rest[-1], RequestFailed)
        assert thread.call(lambda e: e.block_pool.usage()["in_use"]).result(10) == 0
    finally:
        thread.close()


def test_a_request_ending_on_eos_drops_its_speculative_row(family):
    """Steps are pipelined: the row queued after an EOS is computed, then dropped."""
    loaded, solo_tokens = family
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    solos = [solo_tokens(p) for p in prompts]
    eos = solos[0][3]  # the first prompt's fourth token becomes its end
    tokenizer, saved = loaded.tokenizer, loaded.tokenizer.eos_token_ids
    tokenizer.eos_token_ids = {eos}  # shared with the module's other tests: restored below
    try:
        engine = engine_for(loaded)  # the engine takes its end tokens when it is made
        results = engine.generate_batch(prompts, max_tokens=MAX_TOKENS)
    finally:
        tokenizer.eos_token_ids = saved
    assert results[0].finish_reason == "stop"
    for solo, result in zip(solos, results):
        end = solo.index(eos) + 1 if eos in solo else len(solo)
        assert result.tokens == solo[:end]
    assert_pool_idle(engine)
    assert not engine.loop.has_work


def test_streams_consumed_side_by_side_are_batched_and_equal_solo(family):
    loaded, solo_tokens = family
    engine = engine_for(loaded)
    streams = [engine.stream(p, max_tokens=MAX_TOKENS) for p in PROMPTS[:3]]
    outs: list[list[int]] = [[] for _ in streams]
    widest = 0
    for _ in range(MAX_TOKENS):
        for out, stream in zip(outs, streams):
            out.append(next(stream).token)
        widest = max(widest, len(engine.loop.running))
    assert outs == [solo_tokens(p) for p in PROMPTS[:3]]
    assert widest == 3  # one loop served all three at once
    assert_pool_idle(engine)


def test_a_preempted_request_cancelled_while_it_waits_ends_at_once(family):
    loaded, solo_tokens = family
    engine = engine_for(loaded, 9)
    loop = engine.loop
    prompts = [prompt_of(2 * BLOCK + 3, s) for s in range(4)]
    records: list[list] = [[] for _ in prompts]
    stop = [False] * len(prompts)
    requests = [
        engine.make_request(p, records[i].append, should_stop=lambda i=i: stop[i], max_tokens=4 * BLOCK)
        for i, p in enumerate(prompts)
    ]
    for request in requests:
        loop.add(request)
    while not any(r.output for r in loop.scheduler.waiting):
        loop.step()
    victim = next(r for r in loop.scheduler.waiting if r.output)
    i = requests.index(victim)
    stop[i] = True
    loop.step()  # no wait for blocks to free up: it ends in the next step
    last = records[i][-1]
    assert isinstance(last, RequestFailed) and last.finish_reason == "cancelled"
    assert last.stats.generation_tokens == len(victim.output) == len(records[i]) - 1 > 0
    assert [c.token for c in records[i][:-1]] == solo_tokens(prompts[i], 4 * BLOCK)[: len(victim.output)]
    while loop.has_work:
        loop.step()
    for j, prompt in enumerate(prompts):
        if j != i:
            assert [c.token for c in records[j]] == solo_tokens(prompt, 4 * BLOCK)
    assert_pool_idle(engine)


def test_a_seeded_request_samples_as_mlx_lm_does_whatever_else_is_in_the_batch(family):
    loaded, solo_tokens = family
    prompt = PROMPTS[3]
    mx.random.seed(11)
    sampler = make_sampler(temp=1.0, top_k=50)
    ref = [r.token for r in stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=MAX_TOKENS,
                                            sampler=sampler)]
    engine = engine_for(loaded)
    assert engine.generate(prompt, max_tokens=MAX_TOKENS, temperature=1.0, top_k=50, seed=11).tokens == ref
    records: list[list] = [[], [], []]
    loop = engine.loop
    loop.add(engine.make_request(PROMPTS[0], records[0].append, max_tokens=MAX_TOKENS, temperature=1.0))
    loop.add(engine.make_request(prompt, records[1].append, max_tokens=MAX_TOKENS, temperature=1.0, top_k=50,
                                 seed=11))
    loop.add(engine.make_request(PROMPTS[2], records[2].append, max_tokens=MAX_TOKENS))
    while loop.has_work:
        loop.step()
    assert [r.token for r in records[1]] == ref
    assert [r.token for r in records[2]] == solo_tokens(PROMPTS[2])
