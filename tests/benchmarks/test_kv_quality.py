"""`kv_quality`'s scores against mlx-lm on a tiny model: the full-precision pool scores what
mlx-lm does (its perplexity, and agreement 1.0 with its greedy replies), and a pool that
corrupts one layer agrees below 1.0 and scores another perplexity (a random model's has no
better side: the corrupt pool's came out lower). Scoring the wrong targets, or an agreement
that is not computed, fails here."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache

from mlxkv.benchmarks import kv_quality
from mlxkv.cache.kv_format import FULL
from mlxkv.cache.kv_pool import KVPool
from mlxkv.models.loader import load_model

REPLY = 12


class OneLayerCorrupt(KVPool):
    """A pool whose layer 1 stores its keys negated: what a broken format would do to one layer."""

    def write(self, layer, block_ids, offsets, keys, values, view=None):
        return super().write(layer, block_ids, offsets, -keys if layer == 1 else keys, values, view)


@pytest.fixture(scope="module")
def loaded(llama_dir):
    return load_model(llama_dir)


@pytest.fixture(scope="module")
def text_tokens(loaded):
    return loaded.tokenizer.encode(kv_quality.reference_text()[:600])[:120]


def mlx_lm_perplexity(model, tokens: list[int]) -> float:
    logits = model(mx.array([tokens[:-1]]), cache=make_prompt_cache(model))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logprobs, mx.array(tokens[1:])[:, None], axis=-1)
    return math.exp(-picked.sum().item() / (len(tokens) - 1))


def mlx_lm_replies(loaded, prompts):
    return [[r.token for r in stream_generate(loaded.model, loaded.tokenizer, p, max_tokens=REPLY)] for p in prompts]


PROMPTS = [[(5 * i + 11) % 400 + 3 for i in range(n)] for n in (9, 21)]


def test_the_full_precision_pool_scores_what_mlx_lm_does(loaded, text_tokens):
    ours = kv_quality.perplexity(loaded, FULL, text_tokens)
    assert ours == pytest.approx(mlx_lm_perplexity(loaded.model, text_tokens), rel=1e-5)
    replies = mlx_lm_replies(loaded, PROMPTS)
    assert kv_quality.greedy_agreement(loaded, FULL, PROMPTS, replies) == (2 * REPLY, 2 * REPLY)


def test_a_pool_that_corrupts_one_layer_scores_below(loaded, text_tokens, monkeypatch):
    reference = mlx_lm_perplexity(loaded.model, text_tokens)
    replies = mlx_lm_replies(loaded, PROMPTS)
    monkeypatch.setattr(kv_quality, "KVPool", OneLayerCorrupt)
    assert kv_quality.perplexity(loaded, FULL, text_tokens) != pytest.approx(reference, rel=1e-3)
    agree, total = kv_quality.greedy_agreement(loaded, FULL, PROMPTS, replies)
    assert total == 2 * REPLY and agree < total
