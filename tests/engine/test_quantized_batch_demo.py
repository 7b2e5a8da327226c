"""A quantized pool's batch equals its solo runs on a real model (issue 48, item 8): the demo
model's float32 copy, an 8-bit pool, three prompts as one batch and each alone on an engine of its
own (as `mlxkv generate --concurrent` against each prompt run by itself).

Tiny random models rarely sit near a rounding step of the 8-bit grid; a trained model's K/V do.
What mlxkv owns must not depend on the batch: the attention path (a quantized batch takes no
cascade attention, whose split softmax rounded the first batched step's K/V otherwise than the
solo steps') and the quantization of each vector. The model's matmuls do depend on it, on this
CPU: a projection rounds a row differently with the rows computed beside it. The batch's copper
prompt reads the chat template's K/V from the story prompt's 44-row prefill chunk (a prefix hit
inside the batch), its solo run computes them in its own 38-row chunk, and 8 bits turn that into
another reply from token 2 on. So the first test makes the model's matmuls batch-invariant (each
token's row alone) and asserts the batch equals its solo runs bit for bit, in every layer's K/V;
the second measures the rounding that the first takes away (docs/quantized-kv.md).
"""

from __future__ import annotations

import sys

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxkv.attention.paged_cache import PagedKVCache
from mlxkv.benchmarks.speculative import _write_float_copy
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.engine.model_runner import ModelRunner
from mlxkv.models.fetch import DEMO_INSTALL, demo_gguf
from mlxkv.models.gguf import imported_model
from mlxkv.models.loader import load_model
from real_parts import on_ci

# The audit's prompts: the copper one's batched reply parted from its solo one at token 2.
PROMPTS = ["Tell me a story about the sea and the ships that sail upon it.", "Explain how a bicycle works.",
           "List three uses of copper and say why."]
TOKENS = 8  # the batched steps' K/V are compared bit for bit, so a few steps show any difference
CONFIG = CacheConfig(kv_bits=8, memory_tier_bytes=0)


@pytest.fixture(scope="module")
def demo_f32(tmp_path_factory):
    gguf = demo_gguf()
    if gguf is None:
        message = f"the demo model's package is missing; {DEMO_INSTALL} (README, .ci/run)"
        pytest.fail(message, pytrace=False) if on_ci() else pytest.skip(message)
    with pytest.MonkeyPatch.context() as mp:  # the session's cache dir, as the autouse fixture sets it
        mp.setenv("MLXKV_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "mlxkv-cache"))
        path = str(imported_model(gguf))
    copy = tmp_path_factory.mktemp("demo-f32")
    _write_float_copy(path, str(copy))
    return load_model(str(copy))


def _prompts(loaded) -> list[list[int]]:
    engine = Engine(loaded, CONFIG)
    return [engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


def _row_by_row(monkeypatch) -> None:
    """The model's matmuls made batch-invariant: every token's row computed alone, as one row."""
    for cls, name in ((nn.Linear, "__call__"), (nn.Embedding, "as_linear")):
        apply = getattr(cls, name)

        def alone(self, x, apply=apply):
            if x.ndim != 3 or x.shape[0] * x.shape[1] == 1:
                return apply(self, x)
            b, n, d = x.shape
            rows = x.reshape(b * n, 1, 1, d)
            return mx.concatenate([apply(self, rows[i]) for i in range(b * n)]).reshape(b, n, -1)

        monkeypatch.setattr(cls, name, alone)


class _KVRecord:
    """Each row's K/V as the model hands them to the pool (before quantization), by
    (prompt, cache slot, position), in the run named `run`."""

    def __init__(self, monkeypatch, prompts: list[list[int]]):
        self.runs: dict[str, dict] = {}
        self.run = ""
        index = {tuple(p): i for i, p in enumerate(prompts)}
        rows: list[tuple[int, int]] = []
        forward, write = ModelRunner._forward, PagedKVCache.update_and_fetch

        def _forward(runner, seqs, *args):
            rows[:] = [(index[tuple(s.prompt)], s.num_computed) for s in seqs]
            return forward(runner, seqs, *args)

        def update_and_fetch(cache, keys, values):
            k, v = np.array(keys), np.array(values)
            for i, (prompt, start) in enumerate(rows):
                for j in range(k.shape[2]):
                    self.runs[self.run][(prompt, cache.slot, start + j)] = (k[i, :, j].tobytes(), v[i, :, j].tobytes())
            return write(cache, keys, values)

        monkeypatch.setattr(ModelRunner, "_forward", _forward)
        monkeypatch.setattr(PagedKVCache, "update_and_fetch", update_and_fetch)

    def start(self, run: str) -> None:
        self.run = run
        self.runs[run] = {}


@pytest.mark.slow
def test_with_batch_invariant_matmuls_an_8_bit_batch_equals_its_solo_runs_bit_for_bit(demo_f32, monkeypatch):
    prompts = _prompts(demo_f32)
    _row_by_row(monkeypatch)
    record = _KVRecord(monkeypatch, prompts)
    record.start("solo")
    solo = [Engine(demo_f32, CONFIG).generate(p, max_tokens=TOKENS).tokens for p in prompts]
    record.start("batch")
    results = Engine(demo_f32, CONFIG).generate_batch(prompts, max_tokens=TOKENS)
    assert [r.tokens for r in results] == solo
    assert all(r.stats.cached_tokens["pool"] > 0 for r in results[1:])  # the batch's own prefix hits
    batch, alone = record.runs["batch"], record.runs["solo"]
    assert batch.keys() <= alone.keys()
    differing = sorted(key for key in batch if batch[key] != alone[key])
    assert not differing, f"{len(differing)} of {len(batch)} K/V vectors differ, first {differing[:3]}"


def _template_kv(loaded, tokens: list[int], shared: int) -> list[mx.array]:
    """Every layer's K and V of the first `shared` tokens, prefilled as the engine prefills
    `tokens` cold: one chunk of all but the last token."""
    cache = make_prompt_cache(loaded.model)
    loaded.model(mx.array([tokens[:-1]]), cache=cache)
    kv = [x for c in cache for x in (c.keys[..., :shared, :], c.values[..., :shared, :])]
    mx.eval(kv)
    return kv


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "darwin", reason="measures OpenBLAS's rounding; a Mac's BLAS is Accelerate")
def test_without_them_the_models_matmuls_round_a_row_by_the_rows_beside_it(demo_f32):
    """What the test above takes away, measured: the chat template's 16 tokens (the block the
    batch's copper prompt hits) prefilled among the story prompt's 44 rows and among the copper
    prompt's own 38 differ in their float32 K/V, and some in their 8-bit records."""
    story, _, copper = _prompts(demo_f32)
    shared = 16
    assert story[:shared] == copper[:shared]
    hit, cold = _template_kv(demo_f32, story, shared), _template_kv(demo_f32, copper, shared)
    assert sum((a != b).sum().item() for a, b in zip(hit, cold)) > 0
    records = [mx.quantize(x, 64, 8) for x in hit], [mx.quantize(x, 64, 8) for x in cold]
    assert any(not mx.array_equal(p, q).item() for a, b in zip(*records) for p, q in zip(a, b))
    # A decode step of two rows against one: the projections of the first row differ too.
    layer = demo_f32.model.model.layers[0].self_attn.k_proj
    x = mx.random.normal((2, 1, layer.weight.shape[1]), key=mx.random.key(0))
    assert not mx.array_equal(layer(x)[:1], layer(x[:1])).item()
