"""The engine over a quantized pool: equal to mlx-lm's QuantizedKVCache, batches equal to solo
runs, preemption and prefix hits equal to cold runs, speculation equal to plain decode, and
exact where the model's K/V are values the format holds exactly."""

from __future__ import annotations

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import QuantizedKVCache

from family_support import model_with_oracle, prompt_of
from mlxkv.attention import dispatch
from mlxkv.attention.cascade import cascade_decode
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.errors import MlxkvError
from mlxkv.models.loader import load_model
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model

BLOCK = 8
GROUP = 32
SPEC = TinyModelSpec(family="llama", head_dim=64, seed=71)
SHARED = prompt_of(3 * BLOCK + 2, salt=40)
PROMPTS = [prompt_of(5, 1), SHARED + prompt_of(9, 2), prompt_of(4 * BLOCK + 3, 4), SHARED + prompt_of(20, 3),
           SHARED]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return model_with_oracle(tmp_path_factory.mktemp("quantized") / "llama", SPEC)


def engine_for(loaded, bits, num_blocks=96, **cache) -> Engine:
    cache = {"block_size": BLOCK, "num_blocks": num_blocks, "memory_tier_bytes": 0, **cache}
    return Engine(loaded, CacheConfig(kv_bits=bits, kv_group_size=GROUP, **cache), prefill_chunk=64)


def mlx_lm_quantized(loaded, prompt, bits, n):
    """mlx-lm's greedy tokens with a QuantizedKVCache from the first token (mlx-lm's own
    default keeps the first 5000 tokens in full precision: quantized_kv_start)."""
    cache = [QuantizedKVCache(GROUP, bits) for _ in loaded.model.layers]
    return [r.token for r in stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=n, prompt_cache=cache)]


@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_output_equals_mlx_lms_quantized_cache(llama, bits):
    _, loaded, _ = llama
    engine = engine_for(loaded, bits)
    for prompt in (prompt_of(7, 3), prompt_of(3 * BLOCK + 5, 8)):
        assert engine.generate(prompt, max_tokens=16).tokens == mlx_lm_quantized(loaded, prompt, bits, 16)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_concurrent_batch_equals_its_solo_runs_and_hits_equal_cold_runs(llama, bits, monkeypatch):
    _, loaded, _ = llama
    solo = [engine_for(loaded, bits).generate(p, max_tokens=12).tokens for p in PROMPTS]
    engine = engine_for(loaded, bits)
    assert [r.tokens for r in engine.generate_batch(PROMPTS, max_tokens=12)] == solo
    again = engine.generate_batch(PROMPTS, max_tokens=12)  # on prefix hits now
    assert [r.tokens for r in again] == solo
    assert all(r.stats.cached_tokens["pool"] >= BLOCK for r in again[1:])
    # Rows that all share a prefix take no cascade attention: its split softmax rounds a row
    # otherwise than its solo steps, and the demo model's 8-bit batch parted from its solo runs
    # over it (test_quantized_batch_demo.py, issue 48 item 8).
    cascades = []
    monkeypatch.setattr(dispatch, "cascade_decode", lambda *a: cascades.append(1) or cascade_decode(*a))
    sharing = [1, 3, 4]
    assert [r.tokens for r in engine.generate_batch([PROMPTS[i] for i in sharing], max_tokens=12)] == \
        [solo[i] for i in sharing]
    assert not cascades and engine.runner.prefix_nbytes == 0


@pytest.mark.parametrize("bits", [8, 4])
def test_preemption_resumes_on_quantized_blocks_and_equals_solo(llama, bits):
    _, loaded, _ = llama
    prompts = [prompt_of(2 * BLOCK + 3, s) for s in range(4)]
    solo = [engine_for(loaded, bits).generate(p, max_tokens=4 * BLOCK).tokens for p in prompts]
    engine = engine_for(loaded, bits, num_blocks=14)
    results = engine.generate_batch(prompts, max_tokens=4 * BLOCK)
    assert any(r.stats.preemptions for r in results)
    assert [r.tokens for r in results] == solo
    assert engine.block_pool.in_use == 0


def test_speculation_over_a_quantized_pool_equals_plain_decode(llama):
    _, loaded, _ = llama
    prompt = prompt_of(30, salt=21)
    plain = engine_for(loaded, 8).generate(prompt, max_tokens=80).tokens
    engine = engine_for(loaded, 8, speculative="lookup", speculative_tokens=5)
    assert engine.generate(prompt, max_tokens=80).tokens == plain
    repeat = prompt + plain[:50]  # a reply that repeats what came before: proposals are accepted
    assert engine.generate(repeat, max_tokens=30).tokens == engine_for(loaded, 8).generate(repeat, max_tokens=30).tokens
    assert engine.stats()["speculative"]["accepted"] > 0


def test_stats_and_the_chat_apps_panel_say_the_format_and_its_bytes(llama):
    from mlxkv.host.pool_view import PoolWatcher

    _, loaded, _ = llama
    engine = engine_for(loaded, 4)
    full, q4 = engine_for(loaded, None).stats(), engine.stats()
    assert (full["kv_format"], q4["kv_format"]) == ("float32", "q4g32")
    # 2 layers x 2 KV heads x K and V x 64 values: 4 bytes each, or half a byte and a
    # float32 scale and bias per 32
    assert (full["kv_bytes_per_token"], q4["kv_bytes_per_token"]) == (2 * 2 * 2 * 64 * 4, 2 * 2 * 2 * (32 + 16))
    assert q4["kv_bytes_per_block"] == BLOCK * q4["kv_bytes_per_token"]
    snapshot = PoolWatcher.of(engine).snapshot()
    assert (snapshot.kv_format, snapshot.kv_bytes_per_token) == ("q4g32", q4["kv_bytes_per_token"])


def test_formats_never_share_blocks(llama):
    _, loaded, _ = llama
    fingerprints = {engine_for(loaded, bits).fingerprint for bits in (None, 8, 4)}
    assert len(fingerprints) == 3
    assert engine_for(loaded, None).fingerprint == Engine(loaded, CacheConfig(block_size=BLOCK)).fingerprint


def test_a_head_dim_the_groups_do_not_divide_is_refused_at_load(tmp_path):
    loaded = load_model(str(write_tiny_model(tmp_path / "m", TinyModelSpec(family="llama", head_dim=48))))
    with pytest.raises(MlxkvError, match="head dim of 48 does not split into quantization groups of 32"):
        engine_for(loaded, 8)


# -- exact where the values are on the grid ----------------------------------------------


class OnGrid:
    """Wraps a module's output onto values `bits` hold exactly: integers 0..2^bits-1 in
    every group of GROUP values, each group with both ends, divided by a power of two."""

    def __init__(self, inner, bits: int):
        self.inner, self.top = inner, 2**bits - 1

    def __call__(self, *args, **kwargs):
        x = self.inner(*args, **kwargs)
        q = mx.clip(mx.round(x * 8) + (self.top + 1) // 2, 0, self.top).reshape(*x.shape[:-1], -1, GROUP)
        ends = mx.arange(GROUP) < 2
        q = mx.where(ends, mx.where(mx.arange(GROUP) == 0, 0, self.top), q).reshape(x.shape)
        return (q / 16).astype(x.dtype)


def on_grid(path, bits):
    loaded = load_model(path)
    for layer in loaded.model.layers:
        attention = layer.self_attn
        attention.rope = OnGrid(attention.rope, bits)  # the keys after RoPE (and the queries: harmless)
        attention.v_proj = OnGrid(attention.v_proj, bits)
    return loaded


@pytest.mark.parametrize("bits", [8, 4])
def test_exact_equality_where_the_pool_holds_the_values_exactly(llama, bits):
    path, _, _ = llama
    loaded = on_grid(path, bits)
    full, quantized = engine_for(loaded, None), engine_for(loaded, bits)
    for prompt in PROMPTS[:3]:
        assert quantized.generate(prompt, max_tokens=20).tokens == full.generate(prompt, max_tokens=20).tokens
    # The check can fail: what the pools hold is equal, value for value.
    ids = [0, 1, 2]
    held = quantized.kv_pool.gather(1, mx.array([ids]))
    assert all(mx.array_equal(a, b).item() for a, b in zip(held, full.kv_pool.gather(1, mx.array([ids]))))
    assert mx.any(held[0] != 0).item()


# -- the other families ------------------------------------------------------------------


@pytest.mark.slow  # a tiny model of each, solo, batched and on hits
@pytest.mark.parametrize(("family", "layers"), [("gemma3_text", 4), ("gpt_oss", 2), ("qwen3_next", 4), ("llama4", 4)])
def test_sliding_sink_hybrid_and_chunked_families_batch_and_hit_as_solo(tmp_path, family, layers):
    """Windows, sinks, chunks: the masks the quantized path takes; a hybrid's states stay exact."""
    spec = TinyModelSpec(family=family, num_layers=layers, head_dim=64, seed=3, sliding_window=24)
    loaded = load_model(str(write_tiny_model(tmp_path / family, spec)))
    prompts = [prompt_of(30, 1), prompt_of(45, 2), prompt_of(30, 1) + prompt_of(9, 7)]
    solo = [engine_for(loaded, 8).generate(p, max_tokens=20).tokens for p in prompts]
    engine = engine_for(loaded, 8)
    assert [r.tokens for r in engine.generate_batch(prompts, max_tokens=20)] == solo
    assert [r.tokens for r in engine.generate_batch(prompts, max_tokens=20)] == solo  # on prefix hits
    assert engine.stats()["kv_format"] == "q8g32"


def test_a_family_of_k_v_shapes_that_differ_is_refused_at_load(tmp_path):
    spec = TinyModelSpec(family="gemma4_text", num_layers=4, head_dim=64, seed=3)
    loaded = load_model(str(write_tiny_model(tmp_path / "gemma4", spec)))
    with pytest.raises(MlxkvError, match="holds layers of one K/V shape, and this model's differ"):
        engine_for(loaded, 8)
