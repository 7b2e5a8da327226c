"""A quantized pool's batch equals its solo runs on a real model (issue 48, item 8): the demo
model's float32 copy, an 8-bit pool, three prompts as one batch and each alone.

Tiny random models rarely sit near a rounding step of the 8-bit grid; a trained model's K/V
do, so a row whose attention or quantization depended on the batch shows here. Each solo
run is on an engine of its own. What this cannot promise: the model's matmuls round a row
differently with the number of rows (OpenBLAS on the CPU), so a prefix hit's chunk or a
batched step may differ from a solo run's in the last bits, in any pool; 8 bits turns some
of those into a step of the grid (docs/quantized-kv.md). These prompts stay clear of it.
"""

from __future__ import annotations

import pytest

from mlxkv.benchmarks.speculative import _write_float_copy
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.fetch import DEMO_INSTALL, demo_gguf
from mlxkv.models.gguf import imported_model
from mlxkv.models.loader import load_model
from real_parts import on_ci

PROMPTS = ["Tell me a story about the sea.", "What is the capital of France? Answer in a sentence.",
           "Write a haiku about autumn leaves."]
TOKENS = 32


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


@pytest.mark.slow
def test_an_8_bit_batch_equals_its_solo_runs_on_the_demo_model(demo_f32):
    config = CacheConfig(kv_bits=8, memory_tier_bytes=0)
    engine = Engine(demo_f32, config)
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    solo = [Engine(demo_f32, config).generate(p, max_tokens=TOKENS).tokens for p in prompts]
    batch = engine.generate_batch(prompts, max_tokens=TOKENS)
    assert [r.tokens for r in batch] == solo
