"""`mlxkv bench batch`: many sequences on one pool, beside mlx-lm's batch_generate.

Measured in one run, on the bench model (benchmarks/engine.py):

- scaling: aggregate decode tokens/s with 1, 4, 8 and 16 concurrent
  sequences (distinct prompts), relative to 1. Decode rate is tokens
  sampled after the last sequence's first token, over that time.
- against batch_generate: 16 prompts sharing a `prefix`-token prefix, same
  model and max_tokens; aggregate throughput is all generated tokens over
  the whole wall time (prefill included: sharing the prefix is the point).
  KV memory: our peak referenced blocks x bytes per block, plus the shared
  prefix's contiguous copy (cascade attention), against mlx-lm's batch
  cache, B rows padded to the longest, grown in 256-token steps.
  Greedy tokens are compared.
- capacity: the largest number of such sequences a fixed KV byte budget
  holds, ours (shared prefix once, at most one partial block each) against
  the padded batch cache. Computed from the layouts, not timed.
"""

from __future__ import annotations

import time

from mlx_lm.generate import batch_generate

from mlxkv.benchmarks.engine import (
    _stderr, _tokens, bench_model_path, check_context, describe_model, mlx_lm_kv_bytes,
)
from mlxkv.benchmarks.rows import format_rows, row  # noqa: F401  (format_rows: the suite's printer)
from mlxkv.cache.groups.base import blocks_for
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.loader import load_model

SCALES = (1, 4, 8, 16)
SHARED = 16  # prompts sharing the prefix in the batch_generate case
SUFFIX = 32  # distinct tokens after the shared prefix
BLOCK_SIZE = 16
THROUGHPUT_GOAL = 1.5
BUDGET_BYTES = 1 << 30  # the fixed KV budget of the capacity row


def run_batch_benchmark(prefix: int = 1024, decode_tokens: int = 64, model=None, log=_stderr) -> list[dict]:
    loaded = load_model(str(model or bench_model_path(log=log)))
    check_context(loaded, "--prefix", prefix, SUFFIX + decode_tokens)
    vocab = loaded.config["vocab_size"]
    per_seq = blocks_for(prefix + SUFFIX + decode_tokens, BLOCK_SIZE)
    engine = Engine(loaded, CacheConfig(block_size=BLOCK_SIZE, num_blocks=SHARED * per_seq + 8, memory_tier_bytes=0))
    name = describe_model(engine)
    rows = _scaling_rows(engine, vocab, decode_tokens, log)
    prompts = [_tokens(prefix, vocab, 7) + _tokens(SUFFIX, vocab, 100 + i) for i in range(SHARED)]
    rows += _against_mlx_lm(engine, prompts, decode_tokens, log)
    rows.append(_capacity_row(engine, prefix, decode_tokens))
    for r in rows:
        r["model"] = name
    return rows


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Run prompts as one batch; token lists, timings, peak blocks in use and peak copy bytes."""
    salt = f"bench-batch-{time.perf_counter_ns()}"  # cold: no hits from an earlier run
    loop = engine.loop
    outs: list[list[int]] = [[] for _ in prompts]
    stamps: list[float] = []
    for i, p in enumerate(prompts):
        loop.add(engine.make_request(p, lambda r, i=i: (outs[i].append(r.token), stamps.append(time.perf_counter())),
                                     max_tokens=max_tokens, cache_salt=salt))
    start, peak, peak_copy, all_started = time.perf_counter(), 0, 0, None
    while loop.has_work:
        loop.step()
        peak = max(peak, engine.block_pool.in_use)
        peak_copy = max(peak_copy, engine.runner.prefix_nbytes)
        if all_started is None and all(outs):
            all_started = (time.perf_counter(), sum(map(len, outs)))
    end = time.perf_counter()
    t0, n0 = all_started
    decode_rate = (sum(map(len, outs)) - n0) / (end - t0) if end > t0 else float("nan")
    return dict(tokens=outs, wall=end - start, decode_rate=decode_rate, peak_blocks=peak,
                peak_copy_bytes=peak_copy)


def _scaling_rows(engine: Engine, vocab: int, decode_tokens: int, log) -> list[dict]:
    rates = {}
    for n in SCALES:
        prompts = [_tokens(64, vocab, 1000 + i) for i in range(n)]
        log(f"batch: decode with {n} concurrent sequences")
        rates[n] = _run(engine, prompts, decode_tokens)["decode_rate"]
    return [
        row(f"decode x{n}", "tok/s", rates[n], rates[1], "x1 (ours)", "-", True,
            note="" if n != SCALES[-1] else "aggregate decode tok/s over all sequences, relative to one")
        for n in SCALES
    ]


def _against_mlx_lm(engine: Engine, prompts: list[list[int]], decode_tokens: int, log) -> list[dict]:
    log(f"batch: {len(prompts)} prompts sharing a {len(prompts[0]) - SUFFIX}-token prefix, ours")
    ours = _run(engine, prompts, decode_tokens)
    log("batch: the same with mlx-lm's batch_generate")
    start = time.perf_counter()
    theirs = batch_generate(engine.model, engine.tokenizer, prompts, max_tokens=decode_tokens,
                            return_token_ids=True)
    wall = time.perf_counter() - start
    their_tokens = [list(t) for t in theirs.token_ids] if hasattr(theirs, "token_ids") else None
    same = their_tokens is None or sum(a == b for a, b in zip(ours["tokens"], their_tokens))
    n_ours, n_theirs = sum(map(len, ours["tokens"])), sum(map(len, their_tokens or ours["tokens"]))
    layout = engine.kv_layout
    longest = max(map(len, prompts)) + decode_tokens
    our_kv = ours["peak_blocks"] * layout.bytes_per_block + ours["peak_copy_bytes"]
    their_kv = len(prompts) * mlx_lm_kv_bytes(layout, longest)
    tps, their_tps = n_ours / ours["wall"], n_theirs / wall
    return [
        row("aggregate x16, shared prefix", "tok/s", tps, their_tps, "mlx-lm batch_generate",
            f">= {THROUGHPUT_GOAL}x", tps / their_tps >= THROUGHPUT_GOAL,
            note=f"generated tokens over wall time, prefill included; greedy tokens equal for {same}/"
                 f"{len(prompts)} sequences"),
        row("KV bytes x16, shared prefix", "MB", our_kv / 1e6, their_kv / 1e6, "mlx-lm batch cache",
            "<= 1x", our_kv <= their_kv,
            note="our peak referenced blocks + the shared prefix's copy; theirs padded to the longest"),
    ]


def _capacity_row(engine: Engine, prefix: int, decode_tokens: int) -> dict:
    layout = engine.kv_layout
    budget_blocks = BUDGET_BYTES // layout.bytes_per_block
    shared = prefix // BLOCK_SIZE  # the prefix's full blocks, held once
    own = blocks_for(prefix + SUFFIX + decode_tokens, BLOCK_SIZE) - shared
    ours = (budget_blocks - shared) // own
    theirs = BUDGET_BYTES // mlx_lm_kv_bytes(layout, prefix + SUFFIX + decode_tokens)
    return row("sequences in 1 GiB of KV", "seqs", ours, theirs, "mlx-lm padded batch cache", "> 1x",
               ours > theirs, note=f"{prefix}-token shared prefix + {SUFFIX} own + {decode_tokens} generated")
