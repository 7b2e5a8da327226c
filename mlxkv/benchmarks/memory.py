"""`mlxkv bench memory`: peak memory of a short generation, default config, against mlx-lm;
then the rows of each quantized KV format (kv_formats.py).

The pool grows on demand (cache/block_pool.py), so a short prompt should
cost about what mlx-lm's own cache costs, not a pool sized for many long
contexts. Both sides run in this process on the same loaded model, each
after `mx.reset_peak_memory()`, so the weights count on both sides alike;
the engine is built inside its side, pool and tiers included.
"""

from __future__ import annotations

from mlx_lm.generate import stream_generate

from mlxkv.benchmarks.engine import _stderr, _tokens, bench_model_path, describe_model
from mlxkv.benchmarks.kv_formats import FormatSizes, kv_format_rows, peak as _peak
from mlxkv.benchmarks.rows import format_rows, row  # noqa: F401  (format_rows: the suite's printer)
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.loader import load_model

MEMORY_GOAL = 1.15  # our peak over mlx-lm's, at most
PROMPT_TOKENS = 64
NEW_TOKENS = 32


def run_memory_benchmark(model: str | None = None, log=None, formats: FormatSizes | None = None,
                         quality_model: str = "demo") -> list[dict]:
    """The default-config row; with `formats`, the quantized pool's rows at those sizes."""
    log = log or _stderr
    rows = [_default_config_row(model, log)]
    if formats is not None:
        rows += kv_format_rows(formats, log, model, quality_model)
        for r in rows[1:]:
            r.setdefault("model", rows[0]["model"])
    return rows


def _default_config_row(model: str | None, log) -> dict:
    loaded = load_model(model or str(bench_model_path(log=log)))
    prompt = _tokens(PROMPT_TOKENS, loaded.config["vocab_size"], seed=9)
    theirs_tokens, theirs = _peak(lambda: [r.token for r in stream_generate(
        loaded.model, loaded.tokenizer, prompt, max_tokens=NEW_TOKENS)])
    engine_box = []

    def ours_run():
        engine_box.append(Engine(loaded, CacheConfig()))
        return engine_box[0].generate(prompt, max_tokens=NEW_TOKENS).tokens

    ours_tokens, ours = _peak(ours_run)
    engine = engine_box[0]
    stats = engine.stats()
    ratio = ours / theirs
    return row(
        f"peak memory, {PROMPT_TOKENS} + {NEW_TOKENS} tok, default config", "MiB", ours / 2**20, theirs / 2**20,
        "mlx-lm stream_generate", f"<= {MEMORY_GOAL:.2f}", ratio <= MEMORY_GOAL,
        f"pool {stats['pool']['size_blocks']} of {stats['pool']['budget_blocks']:,} blocks made "
        f"({stats['pool_bytes'] / 2**20:.1f} of {stats['pool_budget_bytes'] / 2**20:,.0f} MiB); "
        f"greedy tokens {'identical' if ours_tokens == theirs_tokens else 'DIFFER'}",
        ratio=ratio, tokens_identical=ours_tokens == theirs_tokens, model=describe_model(engine),
    )

