"""`mlxkv bench memory`'s rows for a quantized pool (--kv-bits), each format against its peer.

- KV bytes per token, and how many sequences of 4k tokens a 1 GiB pool
  holds, against float16: the pool's own sizing, on the demo model's shape;
- peak memory of a long decode, and decode tok/s at long contexts, against
  mlx-lm's `QuantizedKVCache` at the same bits (quantized from the first
  token, `quantized_kv_start=0`: mlx-lm's default keeps the first 5000
  tokens in full precision), on the bench model;
- warm TTFT of a prompt whose prefix comes back from the SSD tier (a new
  engine, as after a restart), quantized against full precision;
- perplexity and greedy agreement (kv_quality.py) of the demo model, each
  format against the full-precision pool. On a CPU the demo model's
  quantized weights make a prefill ~20x slower, so these rows run on a
  float32 copy of it: the KV format is what they compare.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import stream_generate

from mlxkv.benchmarks.engine import _alternate, _timed, _tokens, bench_model_path
from mlxkv.benchmarks.kv_quality import greedy_agreement, perplexity, reference_text
from mlxkv.benchmarks.rows import row
from mlxkv.cache.groups.base import blocks_for
from mlxkv.cache.kv_format import FULL, KVFormat
from mlxkv.cache.kv_pool import with_kv_format
from mlxkv.cache.pool_sizing import size_pool
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import PREFILL_STEP, Engine
from mlxkv.models import compat
from mlxkv.models.loader import load_model, probe_kv_layout

BYTES_GOALS = {8: 17 / 32, 4: 9 / 32}  # the 0.53 and 0.28: 8 or 4 bits and a float16 scale and bias per 64
PEAK_GOAL, DECODE_GOAL, PERPLEXITY_GOAL, AGREEMENT_GOAL = 1.05, 1.0, 1.01, 0.98
FIT_TOKENS, FIT_BUDGET = 4096, 1 << 30
PROMPTS = ("The history of the Roman Empire begins", "Write a short poem about the sea.\n", "def fibonacci(n):\n",
           "Explain how a refrigerator works, step by step.")


@dataclass(frozen=True)
class FormatSizes:
    """How big the rows run: the issue's sizes, or QUICK ones for a look on a CPU."""

    bits: tuple[int, ...] = (8, 4)
    group_size: int = 64
    peak_context: int = 16384
    decode_contexts: tuple[int, ...] = (4096, 16384)
    decode_tokens: int = 32
    rounds: int = 3
    restore_tokens: int = 4096
    text_tokens: int = 2048
    reply_tokens: int = 256


QUICK = FormatSizes(peak_context=2048, decode_contexts=(1024,), decode_tokens=16, rounds=1, restore_tokens=1024,
                    text_tokens=512, reply_tokens=32)


def kv_format_rows(sizes: FormatSizes = FormatSizes(), log=print, model: str | None = None,
                   quality_model: str = "demo") -> list[dict]:
    """Every row of every format in `sizes.bits`; `model`: the bench model's path (None: BENCH_SPEC's)."""
    formats = [KVFormat(bits, sizes.group_size) for bits in sizes.bits]
    quality = load_model(quality_model)
    compat.dequantize_model(quality.model)
    rows = [r for kv in formats for r in _size_rows(quality, kv)]
    loaded = load_model(model or str(bench_model_path(log=log)))
    for kv in formats:
        log(f"kv formats: {kv.name(None)} peak memory, decode and restore on the bench model ...")
        rows.append(_peak_row(loaded, kv, sizes.peak_context, sizes.decode_tokens))
        rows += [_decode_row(loaded, kv, n, sizes.decode_tokens, sizes.rounds, log) for n in sizes.decode_contexts]
        rows.append(_restore_row(loaded, kv, sizes.restore_tokens))
    log("kv formats: perplexity and greedy agreement on the demo model ...")
    return rows + _quality_rows(quality, formats, sizes)


def _size_rows(loaded, kv: KVFormat) -> list[dict]:
    full = replace(probe_kv_layout(loaded, 16), dtype=mx.float16)
    ours = with_kv_format(full, kv)
    name, ratio, goal = ours.kv_format, ours.bytes_per_token / full.bytes_per_token, BYTES_GOALS[kv.bits]
    per_seq = blocks_for(FIT_TOKENS, 16)
    fits = [size_pool(CacheConfig(memory_budget_bytes=FIT_BUDGET).engine_config(), lay, None) // per_seq for lay in (ours, full)]
    shape = f"{loaded.name}'s {full.num_layers} layers x {full.n_kv_heads} KV heads x {full.head_dim}"
    return [
        row(f"KV bytes/token, {name} / float16", "B", ours.bytes_per_token, full.bytes_per_token, "float16 pool",
            f"<= {goal:.2f}", ratio <= goal, f"{shape}; {ratio:.4f} = {kv.bits} bits and a float16 scale and bias "
            f"per {kv.group_size} values (mx.quantize's layout, as mlx-lm's QuantizedKVCache holds it)",
            ratio=ratio),
        row(f"{FIT_TOKENS}-tok sequences in a 1 GiB pool, {name}", "seqs", fits[0], fits[1], "float16 pool",
            "report", True, f"{shape}, blocks of 16 tokens"),
    ]


def peak(run) -> tuple[object, int]:
    """What `run()` returns, and the peak memory MLX counted while it ran."""
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    out = run()
    mx.synchronize()
    return out, mx.get_peak_memory()


def _mlx_lm_tokens(loaded, prompt, n, kv: KVFormat, caches=None):
    """mlx-lm's greedy tokens as they come: on prefilled `caches`, or quantized from the first token."""
    options = (dict(prompt_cache=caches) if caches is not None
               else dict(kv_bits=kv.bits, kv_group_size=kv.group_size, quantized_kv_start=0))
    return (r.token for r in stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=n, **options))


def _peak_row(loaded, kv: KVFormat, context: int, n: int) -> dict:
    prompt = _tokens(context, loaded.config["vocab_size"], seed=11)
    theirs_tokens, theirs = peak(lambda: list(_mlx_lm_tokens(loaded, prompt, n, kv)))
    config = CacheConfig(kv_bits=kv.bits, kv_group_size=kv.group_size)
    ours_tokens, ours = peak(lambda: Engine(loaded, config).generate(prompt, max_tokens=n).tokens)
    same = sum(a == b for a, b in zip(ours_tokens, theirs_tokens))
    return row(f"peak memory, {context} ctx + {n} tok, {kv.name(None)}", "MiB", ours / 2**20, theirs / 2**20,
               "mlx-lm QuantizedKVCache", f"<= {PEAK_GOAL:.2f}", ours / theirs <= PEAK_GOAL,
               f"default config but --kv-bits; {same}/{len(ours_tokens)} greedy tokens as mlx-lm's (its first "
               f"prefill chunk attends in full precision)")


def _mlx_lm_prefill(loaded, prompt: list[int], kv: KVFormat) -> list:
    """mlx-lm's QuantizedKVCaches after a prefill of all but the last prompt token, in its chunks."""
    caches = [compat.quantized_kv_cache(kv.group_size, kv.bits) for _ in loaded.model.layers]
    rest = prompt[:-1]
    for start in range(0, len(rest), PREFILL_STEP):
        loaded.model(mx.array(rest[start : start + PREFILL_STEP])[None], cache=caches)
        mx.eval([c.state[:2] for c in caches])
    return caches


def _fresh_copies(caches: list, kv: KVFormat) -> list:
    copies = []
    for c in caches:
        copy = compat.quantized_kv_cache(kv.group_size, kv.bits)
        copy.keys, copy.values = tuple(mx.array(x) for x in c.keys), tuple(mx.array(x) for x in c.values)
        copy.offset = c.offset
        copies.append(copy)
    return copies


def _decode_row(loaded, kv: KVFormat, context: int, n: int, rounds: int, log) -> dict:
    prompt = _tokens(context, loaded.config["vocab_size"], seed=12)
    engine = Engine(loaded, CacheConfig(kv_bits=kv.bits, kv_group_size=kv.group_size, memory_tier_bytes=0))
    prefilled = _mlx_lm_prefill(loaded, prompt, kv)

    def ours():
        return _timed(c.token for c in engine.stream(prompt, max_tokens=n))

    def theirs():
        return _timed(_mlx_lm_tokens(loaded, prompt[-1:], n, kv, _fresh_copies(prefilled, kv)))

    warm = ours()[0], theirs()[0]  # the engine's cold prefill; after it, each round is a prefix hit
    _, rates = _alternate({"mlxkv": ours, "mlx-lm": theirs}, rounds, log)
    ratio = statistics.median(o / t for o, t in zip(rates["mlxkv"], rates["mlx-lm"]))
    same = sum(a == b for a, b in zip(*warm))
    return row(f"decode @ {context} ctx, {kv.name(None)}", "tok/s", statistics.median(rates["mlxkv"]),
               statistics.median(rates["mlx-lm"]), "mlx-lm stream_generate, kv_bits", f">= {DECODE_GOAL:.2f}",
               ratio >= DECODE_GOAL, f"{n} tokens, {rounds} alternated rounds, ratio the median of per-round "
               f"ratios; {same}/{len(warm[0])} greedy tokens as mlx-lm's", ratio=ratio,
               tokens_identical=list(warm[0]) == list(warm[1]))


def _restore_ttft(loaded, kv: KVFormat, prefix: list[int], suffixes: list[list[int]], directory: Path):
    config = CacheConfig(block_size=16, memory_tier_bytes=0, disk_tier=str(directory), kv_bits=kv.bits,
                         kv_group_size=kv.group_size)
    with Engine(loaded, config) as engine:
        engine.generate(prefix + suffixes[0], max_tokens=1)  # writes the prefix's blocks
    with Engine(loaded, config) as engine:  # a fresh pool, as after a restart
        stats = engine.generate(prefix + suffixes[1], max_tokens=1).stats
        held = engine.stats()["connector"]["disk"]["bytes_held"]
    return stats.ttft_s, stats.cached_tokens["disk"], held


def _restore_row(loaded, kv: KVFormat, n: int) -> dict:
    vocab = loaded.config["vocab_size"]
    prefix, suffixes = _tokens(n, vocab, seed=13), [_tokens(16, vocab, seed=s) for s in (14, 15)]
    with tempfile.TemporaryDirectory(prefix="mlxkv-bench-kv-") as tmp:
        ours, hit, ours_bytes = _restore_ttft(loaded, kv, prefix, suffixes, Path(tmp) / "q")
        full, _, full_bytes = _restore_ttft(loaded, FULL, prefix, suffixes, Path(tmp) / "f")
    dtype = str(probe_kv_layout(loaded, 16).dtype).removeprefix("mlx.core.")
    return row(f"warm TTFT, {n}-tok prefix from SSD, {kv.name(None)}", "s", ours, full, f"{dtype} prefix from SSD",
               "report", True, f"{hit} tokens hydrated; files {ours_bytes / 2**20:.1f} MiB against "
               f"{full_bytes / 2**20:.1f} MiB", hydrated_tokens=hit, file_bytes=ours_bytes,
               baseline_file_bytes=full_bytes)


def _quality_rows(loaded, formats: list[KVFormat], sizes: FormatSizes) -> list[dict]:
    text = loaded.tokenizer.encode(reference_text())[: sizes.text_tokens]
    base = perplexity(loaded, FULL, text)
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    full_engine = Engine(loaded, CacheConfig(memory_tier_bytes=0))
    replies = [full_engine.generate(p, max_tokens=sizes.reply_tokens).tokens for p in prompts]
    rows = []
    for kv in formats:
        name, eight = kv.name(None), kv.bits == 8
        ppl = perplexity(loaded, kv, text)
        rows.append(row(f"perplexity, {len(text)} tok of text, {name}", "ppl", ppl, base, "full-precision pool",
                        f"<= {PERPLEXITY_GOAL:.2f}" if eight else "report", ppl / base <= PERPLEXITY_GOAL or not eight,
                        "the demo model (a float32 copy) on CPython's reference-manual prose (pydoc_data), "
                        f"in chunks of 512"))
        agree, total = greedy_agreement(loaded, kv, prompts, replies)
        engine = Engine(loaded, CacheConfig(memory_tier_bytes=0, kv_bits=kv.bits, kv_group_size=kv.group_size))
        free = [engine.generate(p, max_tokens=sizes.reply_tokens).tokens for p in prompts]
        parted = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(replies, free)]
        rows.append(row(f"greedy agreement, {name}", "share", agree / total, 1.0, "full-precision pool",
                        f">= {AGREEMENT_GOAL:.2f}" if eight else "report", agree / total >= AGREEMENT_GOAL or not eight,
                        f"{agree}/{total} positions of {len(prompts)} full-precision replies fed back (teacher-"
                        f"forced); free-running replies first differ at tokens {parted} of "
                        f"{[len(r) for r in replies]}", agreed=agree, positions=total))
    return rows
