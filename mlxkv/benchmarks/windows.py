"""`mlxkv bench windows`: a sliding-window model's KV and prefix hits.

On a Gemma-3-shaped model (five sliding-window layers to one full, window
512, head dim 256, one KV head), measured in one run:

- KV held by one long sequence (4k context, in decode): our blocks against
  mlx-lm's own caches for the same model and prompt (a `RotatingKVCache`
  per sliding layer) and against paging every layer as full attention.
  Sliding groups hold only the blocks their window reaches.
- warm/cold TTFT of a 2k-token prefix: the hit needs the full layers'
  blocks and only the window's worth of the sliding layers'.
- KV held at 4k context by a Gemma-4-shaped model (four sliding layers to
  one full, window 512, head dim 256, the full layers' 512): its two
  shapes share pages (cache/page_format.py), against mlx-lm's own caches.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxkv.benchmarks.engine import (
    BENCH_SPEC, BLOCK_SIZE, TTFT_GOAL, _stderr, _tokens, _ttftrow, bench_model_path, check_context, describe_model,
    kv_bytes_per_token,
)
from mlxkv.benchmarks.rows import format_rows, row  # noqa: F401  (format_rows: the suite's printer)
from mlxkv.cache.groups.base import blocks_for
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import PREFILL_STEP, Engine
from mlxkv.models.loader import load_model
from mlxkv.models.tiny import TinyModelSpec

# A 6-layer slice of Gemma 3 1B: its window, head shape and 5:1 layer pattern.
GEMMA3_SPEC = dataclasses.replace(BENCH_SPEC, family="gemma3_text", num_layers=6, num_heads=4, num_kv_heads=1,
                                  head_dim=256, sliding_window=512, sliding_pattern=6)
# A 5-layer slice of Gemma 4 E2B: four sliding layers (window 512, one KV head of 256)
# to one full layer whose head is twice as wide (512).
GEMMA4_SPEC = dataclasses.replace(BENCH_SPEC, family="gemma4_text", num_layers=5, num_heads=4, num_kv_heads=1,
                                  head_dim=256, sliding_window=512, sliding_pattern=5)
KV_GOAL = 1.10  # our KV bytes over mlx-lm's, at most
DECODE_TOKENS = 8  # past the prompt, so both sides are in their decode layout


def run_windows_benchmark(context: int = 4096, prefix: int = 2048, rounds: int = 3,
                          spec: TinyModelSpec = GEMMA3_SPEC, gemma4: TinyModelSpec | None = GEMMA4_SPEC,
                          log=None) -> list[dict]:
    """Rows of {name, unit, ours, baseline, ratio, goal, met, note, ...}; asserts no speed."""
    log = log or _stderr
    engine, described = _engine(spec, max(context, prefix), log)
    vocab = engine.loaded.config["vocab_size"]
    log(f"kv bytes at {context} context ...")
    rows = [{**_kv_row(engine, _tokens(context, vocab, seed=1)), "model": described}]
    log(f"ttft: {prefix}-token prefix, cold and warm ...")
    ttft = _ttftrow(engine, _tokens(prefix, vocab, seed=2), rounds, vocab)
    rows.append({**ttft, "goal": f"<= {TTFT_GOAL:.2f}", "model": described})
    if gemma4 is not None:
        engine, described = _engine(gemma4, context, log)
        log(f"kv bytes at {context} context, two shapes in shared pages ...")
        rows.append({**_kv_row(engine, _tokens(context, vocab, seed=1), " (Gemma 4 shape)"), "model": described})
    return rows


def _engine(spec: TinyModelSpec, context: int, log) -> tuple[Engine, str]:
    loaded = load_model(str(bench_model_path(spec, log)))
    check_context(loaded, "--context", context, DECODE_TOKENS)
    # Room for a few full contexts in every layer: the cases use several cache salts.
    num_blocks = 4 * blocks_for(context + DECODE_TOKENS, BLOCK_SIZE) * spec.num_layers
    engine = Engine(loaded, CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, memory_tier_bytes=0))
    described = describe_model(engine) + f"; groups: {engine.coordinator.group_layout.describe()}"
    log(described)
    return engine, described


def _kv_row(engine: Engine, prompt: list[int], label: str = "") -> dict:
    layout = engine.kv_layout
    held = _held_in_decode(engine, prompt)
    ours = held * layout.bytes_per_block
    theirs = _mlx_lm_kv_bytes(engine.model, prompt)
    all_full = blocks_for(len(prompt) + DECODE_TOKENS, layout.block_size) * layout.block_size * kv_bytes_per_token(layout)
    ratio = ours / theirs
    return row(
        f"KV held @ {len(prompt)} ctx{label}", "MiB", ours / 2**20, theirs / 2**20, "mlx-lm RotatingKVCache layout",
        f"<= {KV_GOAL:.2f}", ratio <= KV_GOAL,
        f"{held} blocks in decode; every layer as full attention: {all_full / 2**20:.1f} MiB "
        f"({all_full / theirs:.2f}x mlx-lm's)",
        ratio=ratio, blocks=held, all_full_bytes=all_full,
    )


def _held_in_decode(engine: Engine, prompt: list[int]) -> int:
    """Blocks the one running sequence holds once it decodes (its prompt done)."""
    loop = engine.loop
    request = engine.make_request(prompt, lambda record: None, max_tokens=DECODE_TOKENS)
    loop.add(request)
    held = 0
    while loop.has_work:
        loop.step()
        seq = request.seq
        if seq is not None and seq.num_computed > len(prompt):
            held = max(held, len(engine.coordinator.held(seq)))
    return held


def _mlx_lm_kv_bytes(model, prompt: list[int]) -> int:
    """mlx-lm's caches for the model after the prompt (in its prefill chunks) and a few decode steps."""
    caches = make_prompt_cache(model)
    for start in range(0, len(prompt), PREFILL_STEP):
        model(mx.array(prompt[start : start + PREFILL_STEP])[None], cache=caches)
        mx.eval([c.state for c in caches])
    for token in range(DECODE_TOKENS):
        model(mx.array([[token + 3]]), cache=caches)
        mx.eval([c.state for c in caches])
    return sum(c.nbytes for c in caches)
