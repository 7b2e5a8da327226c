"""Greedy equality with mlx-lm, token for token: test bodies shared by the
plain engine's suite (engine/test_engine_equality.py) and the kernel path's
(attention/test_kernels_engine.py). Each collects them with its own
`family` fixture."""

from __future__ import annotations

import pytest
from mlx_lm.generate import stream_generate

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine

BLOCK = 16
MAX_TOKENS = 12


def reference_tokens(model, tokenizer, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % 500 + 3 for i in range(n)]


@pytest.mark.parametrize("length", [1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
def test_cold_prompts_match_mlx_lm(family, length):
    _, path, model, tokenizer = family
    engine = Engine.load(path, CacheConfig(block_size=BLOCK, num_blocks=64))
    prompt = prompt_of(length)
    result = engine.generate(prompt, max_tokens=MAX_TOKENS)
    assert result.tokens == reference_tokens(model, tokenizer, prompt)
    assert sum(result.stats.cached_tokens.values()) == 0


def test_prefix_hits_match_mlx_lm(family):
    _, path, model, tokenizer = family
    engine = Engine.load(path, CacheConfig(block_size=BLOCK, num_blocks=64))
    first = prompt_of(2 * BLOCK + 3)
    turn1 = engine.generate(first, max_tokens=MAX_TOKENS)
    # A second turn: the first prompt, its reply, and a new message.
    second = first + turn1.tokens + prompt_of(9, salt=11)
    turn2 = engine.generate(second, max_tokens=MAX_TOKENS)
    assert turn2.stats.cached_tokens["pool"] >= 2 * BLOCK
    assert turn2.tokens == reference_tokens(model, tokenizer, second)
    # The exact same prompt again: every block but the one holding its last token.
    again = engine.generate(second, max_tokens=MAX_TOKENS)
    assert again.stats.cached_tokens["pool"] == (len(second) - 1) // BLOCK * BLOCK
    assert again.tokens == turn2.tokens


@pytest.mark.parametrize("length", [BLOCK, BLOCK + 1])
def test_prompt_of_whole_cached_blocks(family, length):
    """A prompt whose blocks are all cached still computes its last token."""
    _, path, model, tokenizer = family
    engine = Engine.load(path, CacheConfig(block_size=BLOCK, num_blocks=64))
    prompt = prompt_of(length, salt=5)
    engine.generate(prompt, max_tokens=2)
    result = engine.generate(prompt, max_tokens=MAX_TOKENS)
    assert result.stats.cached_tokens["pool"] == (length - 1) // BLOCK * BLOCK
    assert result.tokens == reference_tokens(model, tokenizer, prompt)
