"""Engine behaviour beyond equality: reuse, eviction, stats, bad input."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from mlx_lm.models.cache import CacheList, ConcatenateKVCache, KVCache, QuantizedKVCache, RotatingKVCache

import mlxkv.attention.dispatch
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.errors import MlxkvError
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model


@pytest.fixture(scope="module")
def engine(model_dirs):
    return Engine.load(model_dirs["llama"], CacheConfig(block_size=8, num_blocks=32))


def tokens(n, start=5):
    return [(start + 13 * i) % 400 + 3 for i in range(n)]


def test_stream_yields_typed_chunks_with_stats_last(engine):
    chunks = list(engine.stream(tokens(10), max_tokens=5))
    assert len(chunks) == 5
    assert all(c.stats is None and c.finish_reason is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == "length"
    s = last.stats
    assert s.prompt_tokens == 10 and s.generation_tokens == 5
    assert s.computed_tokens + sum(s.cached_tokens.values()) == 10
    assert s.ttft_s > 0 and s.decode_tokens_per_s > 0 and s.peak_memory_gb > 0


def test_blocks_are_released_after_each_request(engine):
    engine.generate(tokens(30), max_tokens=4)
    usage = engine.stats()["pool"]
    assert usage["in_use"] == 0
    assert usage["free"] + usage["cached_free"] == usage["size_blocks"]


def test_stopping_early_releases_blocks(engine):
    stream = engine.stream(tokens(20, start=9), max_tokens=50)
    next(stream)
    stream.close()
    assert engine.stats()["pool"]["in_use"] == 0


def test_should_stop_ends_the_stream_cancelled(engine):
    chunks = []
    for chunk in engine.stream(tokens(12, start=4), max_tokens=50, should_stop=lambda: len(chunks) >= 3):
        chunks.append(chunk)
    assert 3 <= len(chunks) <= 5 and chunks[-1].finish_reason == "cancelled"
    assert chunks[-1].stats.generation_tokens == len(chunks)
    # Asked to stop before its first token: no chunks at all.
    assert list(engine.stream(tokens(12, start=4), max_tokens=50, should_stop=lambda: True)) == []
    assert engine.stats()["pool"]["in_use"] == 0


def test_chat_second_turn_reuses_first_turn(engine):
    messages = [{"role": "user", "content": "Tell me about the sea and the ships on it."}]
    first = engine.chat(messages, max_tokens=6)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    second = engine.chat(messages, max_tokens=6)
    full_blocks = len(first.prompt_tokens) // 8 * 8
    assert second.stats.cached_tokens["pool"] >= full_blocks > 0


def test_no_prefix_cache_never_reuses(model_dirs):
    engine = Engine.load(model_dirs["llama"], CacheConfig(block_size=8, num_blocks=32, prefix_cache=False))
    a = engine.generate(tokens(20), max_tokens=3)
    b = engine.generate(tokens(20), max_tokens=3)
    assert sum(b.stats.cached_tokens.values()) == 0 and a.tokens == b.tokens


def test_cache_salt_separates_prefixes(engine):
    engine.generate(tokens(24, start=77), max_tokens=2, cache_salt="alice")
    other = engine.generate(tokens(24, start=77), max_tokens=2, cache_salt="bob")
    same = engine.generate(tokens(24, start=77), max_tokens=2, cache_salt="alice")
    assert other.stats.cached_tokens["pool"] == 0
    assert same.stats.cached_tokens["pool"] == 16


def test_eviction_keeps_output_identical(model_dirs):
    # 8 blocks of 4 tokens: the second prompt evicts the first one's blocks.
    engine = Engine.load(model_dirs["llama"], CacheConfig(block_size=4, num_blocks=8))
    a = engine.generate(tokens(20, start=1), max_tokens=4)
    engine.generate(tokens(20, start=2), max_tokens=4)
    assert engine.block_pool.evictions > 0
    again = engine.generate(tokens(20, start=1), max_tokens=4)
    assert again.tokens == a.tokens
    assert again.stats.cached_tokens["pool"] < 16


def test_attention_is_routed_through_paged_attention(engine, monkeypatch):
    calls = []
    original = mlxkv.attention.dispatch.paged_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(mlxkv.attention.dispatch, "paged_attention", spy)
    engine.generate(tokens(9), max_tokens=2)
    assert len(calls) >= engine.kv_layout.num_layers


def test_decode_writes_do_not_copy_the_pool(model_dirs):
    # A 64 MiB pool: a copy per write would show up as >= 64 MiB of peak.
    engine = Engine.load(model_dirs["llama"], CacheConfig(block_size=16, memory_budget_bytes=64 << 20))
    pool = engine.block_pool
    pool.free(pool.allocate(pool.num_free))  # grown to its budget
    assert engine.kv_pool.nbytes >= 60 << 20
    engine.generate(tokens(40), max_tokens=2)  # warm up
    mx.synchronize()
    active = mx.get_active_memory()
    result = engine.generate(tokens(40, start=3), max_tokens=16)
    extra = result.stats.peak_memory_gb * 1e9 - active
    assert extra < engine.kv_pool.nbytes / 8


def test_every_decode_step_evaluates_its_pool_writes(model_dirs, monkeypatch):
    """A lone sequence attends to its mirror, so nothing else makes a step write the pool."""
    engine = Engine.load(model_dirs["llama"], CacheConfig(block_size=16, memory_tier_bytes=0))
    evaluated = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: (evaluated.append(arrays), real(*arrays))[1])
    engine.generate(tokens(40), max_tokens=12)
    pool = engine.kv_pool
    assert len(evaluated) >= 11
    for arrays in evaluated:
        assert all(any(a is p for a in arrays) for p in pool.keys + pool.values)


def test_a_decode_step_queues_the_next_step_before_its_one_host_read(engine, monkeypatch):
    """Decode speed rests on the pipeline (loop.py's `step`): each step queues the next
    forward, then reads the token in flight, and syncs nowhere else. An extra eval, item()
    or tolist() on the step path, or the read moved before the queue, serializes the steps
    and shows up in no output, only in the decode rate (docs/benchmarks.md, issue 48)."""
    events = []
    real_eval, real_async = mx.eval, mx.async_eval
    real_item, real_tolist = mx.array.item, mx.array.tolist
    monkeypatch.setattr(mx, "eval", lambda *a: (events.append("eval"), real_eval(*a))[1])
    monkeypatch.setattr(mx, "async_eval", lambda *a: (events.append("queue"), real_async(*a))[1])
    monkeypatch.setattr(mx.array, "item", lambda self: (events.append("read"), real_item(self))[1])
    monkeypatch.setattr(mx.array, "tolist", lambda self: (events.append("read"), real_tolist(self))[1])
    stream = engine.stream(tokens(10, start=21), max_tokens=12)
    next(stream)  # the prefill and the pipeline's first step are behind this
    events.clear()
    rest = list(stream)
    assert len(rest) == 11
    assert events.count("read") == 11 and set(events) == {"queue", "read"}
    assert events[:20] == ["queue", "read"] * 10


def test_stats_describe_the_pool(engine):
    s = engine.stats()
    assert s["block_size"] == 8 and s["pool"]["size_blocks"] == 32
    assert s["pool_bytes"] == 32 * s["kv_bytes_per_block"]


@pytest.mark.parametrize(
    "prompt, kwargs, message",
    [
        ([], {}, "prompt is empty"),
        ("", {}, "prompt is empty"),
        (tokens(5), {"max_tokens": 0}, "max_tokens"),
        (tokens(5), {"temperature": -1.0}, "temperature"),
        (tokens(5), {"temperature": float("inf")}, "temperature must be a finite number >= 0, got inf"),
        (tokens(5), {"temperature": "0.5"}, "temperature must be a finite number >= 0, got '0.5'"),  # TypeError
        (tokens(5), {"top_p": "0.9"}, "top_p must be between 0 and 1"),  # was a TypeError
        # MLX does not bounds-check the embedding: these were a segfault.
        ([3, 10**6], {}, "token id 1000000 is outside the model's vocabulary of"),
        ([-1, 3], {}, "token id -1 is outside"),
        ([3, 1.5], {}, "whole numbers"),
        ([3, 2.0], {}, "whole numbers, got 2.0"),  # was token 2
        ([True, 3], {}, "whole numbers, got True"),  # was token 1
        ([3, "a"], {}, "whole numbers, got 'a'"),
        (b"abc", {}, "list of token ids"),  # was tokens 97, 98, 99
        ({3, 4}, {}, "list of token ids"),
        (tokens(5), {"max_tokens": 1.5}, "whole number"),  # was 2 tokens, silently
        (tokens(5), {"cache_salt": 5}, "cache_salt must be a string"),  # was an AttributeError
        (tokens(5), {"temperature": 1.0, "top_k": 1.5}, "top_k must be a whole number"),  # failed mid-step
        (tokens(300), {"max_tokens": 10}, "pool has 32"),
    ],
)
def test_bad_requests_get_one_line_errors(engine, prompt, kwargs, message):
    with pytest.raises(MlxkvError, match=message) as info:
        engine.generate(prompt, **kwargs)
    assert "\n" not in str(info.value)
    # ...and the engine still works afterwards.
    assert engine.generate(tokens(6), max_tokens=2).tokens
    assert engine.stats()["pool"]["in_use"] == 0


@pytest.mark.parametrize(
    "messages, message",
    [
        # The chat template's own errors named no message ("'dict object' has no attribute 'content'").
        ("hi", "non-empty list"),
        ([], "non-empty list"),
        ([1], "chat message 1 is a int"),
        ([{"role": "user", "content": "hi"}, {"role": "user"}], "chat message 2 has no 'content'"),
        ([{"content": "hi"}], "chat message 1 has no 'role'"),
        ([{"role": "user", "content": None}], "chat message 1's 'content' must be text, got NoneType"),
        ([{"role": "assistant", "content": "a", "tokens": "12"}], "message 1's 'tokens' must be a list of token ids"),
        ([{"role": "assistant", "content": "a", "tokens": [1, 2.5]}], "'tokens' must be a list of token ids"),
    ],
)
def test_bad_chat_messages_get_one_line_errors(engine, messages, message):
    with pytest.raises(MlxkvError, match=message):
        engine.chat(messages, max_tokens=1)
    assert engine.chat([{"role": "user", "content": "hi"}], max_tokens=1).tokens


def test_prompt_longer_than_context(model_dirs, tmp_path):
    spec = TinyModelSpec(max_position_embeddings=32)
    engine = Engine.load(str(write_tiny_model(tmp_path / "short", spec)), CacheConfig(num_blocks=64))
    with pytest.raises(MlxkvError, match="context is 32"):
        engine.generate(tokens(40), max_tokens=2)


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    """An engine on a model whose context is 64 tokens, with room in the pool for much more."""
    path = write_tiny_model(tmp_path_factory.mktemp("short"), TinyModelSpec(max_position_embeddings=64))
    return Engine.load(str(path), CacheConfig(num_blocks=64))


@pytest.mark.parametrize("prompt_len, max_tokens, expected", [(62, 10, 3), (64, 10, 1), (20, 5, 5), (10, 10**6, 55)])
def test_a_reply_ends_where_the_context_does(short_context, prompt_len, max_tokens, expected):
    r = short_context.generate(tokens(prompt_len), max_tokens=max_tokens)
    assert (len(r.tokens), r.finish_reason) == (expected, "length")


def test_a_fitted_chat_leaves_its_reply_room_in_the_context(short_context):
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} goes on"} for i in range(9)]
    for max_tokens, room in [(6, 6), (100, 32)]:  # past half the context, the reply gets half
        prompt, left_out = short_context.chat_prompt(chat, max_tokens=max_tokens, fit=True)
        assert left_out > 0 and len(prompt) <= 65 - room
        reply = short_context.generate(prompt, max_tokens=max_tokens)
        assert len(reply.tokens) >= min(room, max_tokens)


@pytest.mark.parametrize(("cache", "missing"), [
    (lambda: CacheList(CacheList(KVCache()), KVCache()), "a CacheList inside a CacheList"),
    (lambda: ConcatenateKVCache(), "ConcatenateKVCache layers"),
    (lambda: QuantizedKVCache(), "quantized KV (QuantizedKVCache)"),
    (lambda: RotatingKVCache(64, keep=4), "keeps its first 4 tokens"),
])
def test_a_family_whose_caches_mlxkv_cannot_page_is_one_line_naming_what_is_missing(llama_dir, monkeypatch,
                                                                                   cache, missing):
    from mlx_lm.models import llama

    monkeypatch.setattr(llama.Model, "make_cache", lambda self: [cache() for _ in self.layers], raising=False)
    with pytest.raises(MlxkvError, match=r"^unsupported model family 'llama': ") as e:
        Engine.load(llama_dir)
    assert missing in str(e.value) and "\n" not in str(e.value)


def test_unknown_model_path():
    with pytest.raises(MlxkvError, match="model not found"):
        Engine.load("/definitely/not/here")


def test_block_size_must_be_power_of_two():
    with pytest.raises(MlxkvError, match="power of two"):
        CacheConfig(block_size=12)


def test_temperature_sampling_is_seeded(engine):
    a = engine.generate(tokens(12), max_tokens=8, temperature=1.0, seed=3)
    b = engine.generate(tokens(12), max_tokens=8, temperature=1.0, seed=3)
    assert a.tokens == b.tokens


def test_a_second_thread_generating_at_once_is_refused_and_the_engine_still_works(engine):
    expected = engine.generate(tokens(12), max_tokens=6).tokens
    first_token, refused, done = threading.Event(), [], threading.Event()

    def other():
        first_token.wait(30)
        try:
            engine.generate(tokens(7), max_tokens=2)
        except MlxkvError as e:
            refused.append(str(e))
        done.set()

    worker = threading.Thread(target=other)
    worker.start()
    got = []
    for chunk in engine.stream(tokens(12), max_tokens=6):
        got.append(chunk.token)
        first_token.set()
        done.wait(30)  # the other thread tries while this stream is mid-reply
    worker.join(30)
    assert refused and "another thread" in refused[0]
    assert got == expected
    # Taking turns works: the other thread, then this one again.
    turn = []
    worker = threading.Thread(target=lambda: turn.append(engine.generate(tokens(12), max_tokens=6).tokens))
    worker.start()
    worker.join(30)
    assert turn == [expected] and engine.generate(tokens(12), max_tokens=6).tokens == expected
