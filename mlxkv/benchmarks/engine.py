"""`mlxkv bench engine`: the engine beside mlx-lm, measured in one run.

Three ratios, each measured side by side in the same process so machine
noise hits both sides alike. It reports; it asserts nothing about speed.

- decode: tokens/s of `Engine.stream` against `mlx_lm.stream_generate`,
  same model, same prompt, same number of tokens, rounds alternated
  (AB BA AB ...). Rate on both sides is (tokens - 1) / (last - first token
  time), so prefill is excluded identically. The ratio is the median of the
  per-round ratios: a round's two runs share that moment's machine load.
  Greedy tokens are compared.
- ttft: time to first token of a prompt whose first `context` tokens are
  in the pool against the same kind of prompt cold (another cache salt).
- KV bytes: what a sequence holds in the pool against tokens x
  bytes/token; the waste must stay under one block. mlx-lm's KVCache
  (grown in 256-token steps) is shown for comparison.

The bench model is shaped like a real one where it matters for KV (head dim
128, 4:1 GQA) but has 4 layers so a 2k-context run fits in minutes on CPU.
It is written once into the mlxkv cache directory and reused.
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxkv.cache.groups.base import blocks_for
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import PREFILL_STEP, Engine
from mlxkv.errors import MlxkvError
from mlxkv.models.loader import load_model
from mlxkv.benchmarks.rows import format_rows, row  # noqa: F401  (format_rows: the suite's printer)
from mlxkv.models.tiny import TinyModelSpec, cached_tiny_model

# A 4-layer slice of a ~1B llama: head dim 128, 8 query heads over 2 KV heads.
BENCH_SPEC = TinyModelSpec(
    family="llama",
    num_layers=4,
    hidden_size=1024,
    num_heads=8,
    num_kv_heads=2,
    head_dim=128,
    intermediate_size=2816,
    vocab_size=32000,
    dtype="float32",
    seed=0,
    max_position_embeddings=32768,
)
ROUNDS = 7  # timed decode rounds per side, and warm TTFT rounds
SUFFIX_TOKENS = 32  # new tokens after the cached prefix in the TTFT case
PREFIX_SALT = "bench-prefix"  # the cache salt under which the prompt is warm
BLOCK_SIZE = 16
DECODE_GOAL = 0.95  # engine decode tok/s over mlx-lm's, at least
TTFT_GOAL = 0.10  # warm TTFT over cold TTFT, at most


def bench_model_path(spec: TinyModelSpec | None = None, log=None) -> Path:
    """The bench model (BENCH_SPEC by default) in the mlxkv cache, written on first use."""
    spec = spec or BENCH_SPEC
    name = f"bench-{spec.family}-{spec.num_layers}l-{spec.hidden_size}h-s{spec.seed}"
    return cached_tiny_model(name, spec, log or _stderr)


def check_context(loaded, flag: str, tokens: int, new_tokens: int) -> None:
    """A bench size past the model's context is named before a pool is sized for it."""
    limit = loaded.max_context
    if limit is not None and tokens + new_tokens > limit:
        raise MlxkvError(f"{flag} {tokens} plus new tokens exceeds the model's context of {limit}")


def run_engine_benchmark(
    context: int = 2048,
    decode_tokens: int = 64,
    rounds: int | None = None,
    model: str | None = None,
    block_size: int = BLOCK_SIZE,
    log=None,
) -> list[dict]:
    """Rows of {name, unit, ours, baseline, baseline_name, ratio, goal, met, note, ...}."""
    log, rounds = log or _stderr, ROUNDS if rounds is None else rounds
    if context < 1 or decode_tokens < 2 or rounds < 1:
        raise MlxkvError("bench needs --context >= 1, --decode-tokens >= 2 and at least one round")
    if model is None:
        model = str(bench_model_path(log=log))
    loaded = load_model(model)
    check_context(loaded, "--context", context, max(SUFFIX_TOKENS, decode_tokens))
    # Room for a few full contexts; the cases use several cache salts.
    num_blocks = 8 * blocks_for(context + SUFFIX_TOKENS + decode_tokens + 1, block_size)
    engine = Engine(loaded, CacheConfig(block_size=block_size, num_blocks=num_blocks))
    vocab = engine.loaded.config["vocab_size"]
    prompt = _tokens(context, vocab, seed=0)
    described = describe_model(engine)
    log(described)
    log(f"decode: {rounds} rounds per side at {context} context ...")
    rows = [_decoderow(engine, prompt, decode_tokens, rounds, log)]
    log("ttft: cold and warm prefix ...")
    rows.append(_ttftrow(engine, prompt, rounds, vocab))
    log("kv bytes ...")
    rows += _kv_rows(engine, prompt)
    for row in rows:
        row["model"] = described
    return rows


def describe_model(engine: Engine) -> str:
    c, lay = engine.loaded.config, engine.kv_layout
    params = sum(v.size for _, v in tree_flatten(engine.model.parameters()))
    layers = lay.group_layout.num_slots
    pages = "" if lay.num_layers == layers else f" x {lay.num_layers} layers (a page)"
    return (
        f"{c['model_type']} {layers} layers, hidden {c['hidden_size']}, "
        f"{c['num_attention_heads']} query / {lay.n_kv_heads} KV heads, head dim {lay.head_dim}, "
        f"vocab {c['vocab_size']}, {str(lay.dtype).removeprefix('mlx.core.')} "
        f"({params / 1e6:.3g}M params); "
        f"KV {kv_bytes_per_token(lay) / 1024:g} KiB/token, "
        f"block {lay.block_size} tokens{pages} = {lay.bytes_per_block / 1024:g} KiB"
    )


def kv_bytes_per_token(layout) -> int:
    """K and V bytes one token takes in every attention layer of the model (a block holds a page of them;
    slots of a smaller shape share a page layer, `pack` to one)."""
    if not layout.num_layers:
        return 0
    per_layer = layout.bytes_per_token // layout.num_layers
    return sum(len(g.slots) * per_layer // g.pack for g in layout.group_layout.groups)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    """Reproducible ordinary tokens (ids 0-2 are the tiny models' specials)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


# -- (a) decode ------------------------------------------------------------


def _timed(tokens) -> tuple[list[int], float]:
    """Drain a token iterator; tokens/s between the first and last token."""
    out, stamps = [], []
    for token in tokens:
        stamps.append(time.perf_counter())
        out.append(token)
    span = stamps[-1] - stamps[0]
    return out, (len(out) - 1) / span if len(out) > 1 and span > 0 else math.nan


def _mlx_lm_prefill(model, prompt: list[int]) -> list:
    """mlx-lm's caches after its own prefill of all but the last prompt token."""
    caches = make_prompt_cache(model)
    rest = prompt[:-1]
    for start in range(0, len(rest), PREFILL_STEP):  # generate_step's chunks
        model(mx.array(rest[start : start + PREFILL_STEP])[None], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def _fresh_copy(caches: list) -> list:
    """New caches over the same prefilled K/V; writes to them leave `caches` intact."""
    copies = []
    for c in caches:
        copy = type(c)()
        if c.keys is not None:
            copy.keys, copy.values, copy.offset = mx.array(c.keys), mx.array(c.values), c.offset
        copies.append(copy)
    return copies


def _alternate(sides: dict, rounds: int, log) -> tuple[dict, dict]:
    """Run both sides `rounds` times, AB then BA, so drift and noise hit both."""
    outputs, rates = {k: [] for k in sides}, {k: [] for k in sides}
    order = list(sides)
    for r in range(rounds):
        for side in order if r % 2 == 0 else order[::-1]:
            tokens, rate = sides[side]()
            outputs[side].append(tokens)
            rates[side].append(rate)
        log(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} tok/s" for k, v in rates.items()))
    return outputs, rates


def _decoderow(engine: Engine, prompt: list[int], n: int, rounds: int, log) -> dict:
    model, tokenizer = engine.model, engine.tokenizer
    prefilled = _mlx_lm_prefill(model, prompt)
    last = mx.array(prompt[-1:])

    def ours():
        return _timed(c.token for c in engine.stream(prompt, max_tokens=n))

    def theirs():
        caches = _fresh_copy(prefilled)
        return _timed(r.token for r in stream_generate(model, tokenizer, last, max_tokens=n, prompt_cache=caches))

    # Untimed warm-up: the engine's cold prefill, and the reference tokens.
    reference, warm_up = theirs()[0], ours()[0]
    outputs, rates = _alternate({"mlxkv": ours, "mlx-lm": theirs}, rounds, log)
    identical = all(t == reference for t in [warm_up, *outputs["mlxkv"], *outputs["mlx-lm"]])
    # A round's two runs ran back to back, so their ratio shares that moment's
    # noise; the median of those ratios is the headline.
    ratio = statistics.median(o / t for o, t in zip(rates["mlxkv"], rates["mlx-lm"]))
    best = max(rates["mlxkv"]) / max(rates["mlx-lm"])
    return row(
        f"decode @ {len(prompt)} ctx", "tok/s", statistics.median(rates["mlxkv"]),
        statistics.median(rates["mlx-lm"]), "mlx-lm stream_generate",
        f">= {DECODE_GOAL:.2f}", ratio >= DECODE_GOAL,
        f"{len(reference)} tokens, {rounds} alternated rounds; rates are medians, ratio is the median "
        f"of per-round ratios (best/best {best:.3f}); greedy tokens {'identical' if identical else 'DIFFER'}",
        ratio=ratio, tokens_identical=identical, decode_tokens=len(reference),
        samples_ours=rates["mlxkv"], samples_baseline=rates["mlx-lm"], best_ratio=best,
    )


# -- (b) time to first token -------------------------------------------------


def _ttft(engine: Engine, prompt: list[int], salt: str):
    stats = engine.generate(prompt, max_tokens=1, cache_salt=salt).stats
    return stats.ttft_s, stats.cached_tokens["pool"]


def _ttftrow(engine: Engine, prefix: list[int], rounds: int, vocab: int) -> dict:
    suffixes = [_tokens(SUFFIX_TOKENS, vocab, seed=100 + i) for i in range(rounds + 1)]
    cold_rounds = min(rounds, 3)  # seconds each at 2k; warm rounds are cheap
    # A fresh salt hits nothing: cold. The last cold run leaves the prefix cached.
    salts = [f"cold-{i}" for i in range(cold_rounds - 1)] + [PREFIX_SALT]
    cold = [_ttft(engine, prefix + suffixes[0], salt)[0] for salt in salts]
    # New suffixes, so only the prefix hits.
    warm = [_ttft(engine, prefix + s, PREFIX_SALT) for s in suffixes[1:]]
    cached = min(hit for _, hit in warm)
    best_warm, best_cold = min(t for t, _ in warm) * 1e3, min(cold) * 1e3
    ratio = best_warm / best_cold
    return row(
        f"ttft, {len(prefix)} cached + {SUFFIX_TOKENS} new", "ms", best_warm, best_cold,
        "same prompt, cold", f"<= {TTFT_GOAL:.2f}", ratio <= TTFT_GOAL,
        f"best of {len(warm)} warm / {len(cold)} cold; {cached} tokens hit",
        cached_tokens=cached, prompt_tokens=len(prefix) + SUFFIX_TOKENS,
        samples_ours=[t * 1e3 for t, _ in warm], samples_baseline=[t * 1e3 for t in cold],
    )


# -- (c) KV bytes held -------------------------------------------------------


def kv_lengths(context: int, block_size: int) -> list[int]:
    return sorted({n for n in (1, block_size + 1, 100, 1000, context) if 1 <= n <= context})


def _held_blocks(engine: Engine, prompt: list[int], salt: str) -> int:
    """Most blocks in use while the request runs (the only one in flight).

    Stepped by hand: a request's blocks are back before its last record.
    """
    loop = engine.loop
    loop.add(engine.make_request(prompt, lambda record: None, max_tokens=1, cache_salt=salt))
    held = 0
    while loop.has_work:
        loop.step()
        held = max(held, engine.block_pool.usage()["in_use"])
    return held


def mlx_lm_kv_bytes(layout, tokens: int) -> int:
    """What mlx-lm's KVCache allocates for a prompt of `tokens` tokens, all layers."""
    total = 0
    for _ in range(layout.num_layers):
        cache = KVCache()
        k = mx.zeros((1, layout.n_kv_heads, tokens, layout.head_dim), layout.dtype)
        v = mx.zeros((1, layout.n_kv_heads, tokens, layout.v_head_dim), layout.dtype)
        cache.update_and_fetch(k, v)
        total += cache.nbytes  # shapes only; nothing needs evaluating
    return total


def _kv_rows(engine: Engine, prefix: list[int]) -> list[dict]:
    layout, rows = engine.kv_layout, []
    bs = layout.block_size
    for n in kv_lengths(len(prefix), bs):
        # A prefix of the prompt cached by the TTFT case, so little is computed;
        # held blocks count hits and new blocks alike.
        blocks = _held_blocks(engine, prefix[:n], PREFIX_SALT)
        held, ideal = blocks * layout.bytes_per_block, n * layout.bytes_per_token
        waste = blocks * bs - n
        theirs = mlx_lm_kv_bytes(layout, n)
        rows.append(row(
            f"KV held @ {n} tok", "KiB", held / 1024, ideal / 1024, "tokens x bytes/token",
            "waste < 1 block", 0 <= waste < bs,
            f"{blocks} blocks, waste {waste} tok; mlx-lm KVCache {theirs / 1024:g} KiB ({theirs / ideal:.2f}x)",
            tokens=n, blocks=blocks, waste_tokens=waste, mlx_lm_bytes=theirs, mlx_lm_ratio=theirs / ideal,
        ))
    return rows
