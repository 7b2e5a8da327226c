"""`mlxkv bench tiers`: does a long cached prefix stall the rest of the batch?

On a random-weight model with 128 KiB of KV per token (an 8B model's
size: 2 layers of 64 KV heads x 256, float16), one stream decodes while a
request whose 6k-token prefix is cached arrives (one new token). The
stream's inter-token gaps are timed:

- pool hit: its largest gap while the request is served, against its
  median step before it arrived (goal <= 3x);
- SSD restore: the same with the prefix on the SSD tier (a fresh pool on
  the tier's files, page cache dropped), against the pool hit's (goal <= 1.5x).

The prefix's KV is planted, not computed: random values written into pool
blocks registered under the prompt's block hashes (and stored to the SSD
tier), so the bench costs seconds, not a 6k-token prefill of this model on
two cores. What is timed (lookup, read, install, the suffix's forward over
the whole prefix) is what a computed prefix costs.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import mlx.core as mx

from mlxkv.benchmarks.engine import _tokens, bench_model_path
from mlxkv.benchmarks.rows import row
from mlxkv.cache.block_kv import KVRun
from mlxkv.cache.hashing import extend_block_hashes
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.engine.request import RequestState
from mlxkv.errors import MlxkvError
from mlxkv.models.loader import load_model
from mlxkv.models.tiny import TinyModelSpec

GAP_SPEC = TinyModelSpec(family="llama", num_layers=2, hidden_size=256, num_heads=64, num_kv_heads=64,
                         head_dim=256, intermediate_size=512, vocab_size=4096, dtype="float16", seed=128,
                         max_position_embeddings=16384)
GAP_TOKENS = 6144
BLOCK = 16
SUFFIX = 16
WARM_TOKENS = 12  # stream tokens before the request arrives: the median step's sample
AFTER_TOKENS = 3  # stream tokens after it is served
STREAM_TOKENS = 2000  # the stream's reply: longer than the bench needs, never reached
POOL_GOAL, RESTORE_GOAL = 3.0, 1.5
PLANT_BLOCKS = 32  # blocks of random KV made per MLX op while planting


def gap_rows(prompt_tokens: int, directory: Path, log, drop_page_cache) -> list[dict]:
    loaded = load_model(str(bench_model_path(GAP_SPEC, log=log)))
    log(f"gaps: a stream decoding while a {prompt_tokens}-token prefix hits the pool ...")
    pool = _gaps(loaded, prompt_tokens, None, drop_page_cache)
    log(f"gaps: ... and while it is restored from the SSD tier ...")
    ssd = _gaps(loaded, prompt_tokens, directory, drop_page_cache)
    per_token = pool["bytes_per_token"] >> 10
    where = f"{per_token} KiB of KV per token, {prompt_tokens}-token prefix"
    pool_ratio = pool["max_gap"] / pool["median_step"]
    ssd_ratio = ssd["max_gap"] / pool["max_gap"]
    return [
        row("stream gap, pool hit", "s", pool["max_gap"], pool["median_step"], "its median step",
            f"<= {POOL_GOAL}", pool_ratio <= POOL_GOAL,
            note=f"{where}; the hit's TTFT {pool['ttft']:.2f} s"),
        row("stream gap, SSD restore", "s", ssd["max_gap"], pool["max_gap"], "its gap during a pool hit",
            f"<= {RESTORE_GOAL}", ssd_ratio <= RESTORE_GOAL,
            note=f"{where}; {ssd['disk_tokens']} tokens from disk, page cache dropped; the restore's TTFT "
                 f"{ssd['ttft']:.2f} s (read and installed over {ssd['loading_s']:.2f} s, "
                 f"median step {ssd['median_step']:.3f} s)"),
    ]


def _config(prompt_tokens: int, disk: Path | None) -> CacheConfig:
    return CacheConfig(block_size=BLOCK, num_blocks=(prompt_tokens + STREAM_TOKENS) // BLOCK + 64, memory_tier_bytes=0,
                       disk_tier=str(disk) if disk else None)


def _gaps(loaded, prompt_tokens: int, disk: Path | None, drop_page_cache) -> dict:
    vocab = loaded.config["vocab_size"]
    prefix = _tokens(prompt_tokens, vocab, seed=11)
    prompt = prefix + _tokens(SUFFIX, vocab, seed=12)
    config = _config(prompt_tokens, disk)
    if disk is not None:
        with Engine(loaded, config) as setup:
            _plant(setup, prefix, store=True)
        drop_page_cache(disk.rglob("*.safetensors"))
        engine = Engine(loaded, config)  # a fresh pool on the tier's files
    else:
        engine = Engine(loaded, config)
        _plant(engine, prefix, store=False)
    try:
        return _measure(engine, prompt, vocab)
    finally:
        engine.close()


def _plant(engine: Engine, prefix: list[int], store: bool) -> None:
    """Random KV in pool blocks registered under the prefix's block hashes (and written to the tier)."""
    coordinator = engine.coordinator
    manager = coordinator.attention[0]
    hashes = extend_block_hashes([], engine.core.hash_root(None), prefix, BLOCK)
    # Room for the suffix and the stream too, as after an earlier turn on this prefix: the pool
    # does not grow (a copy of all of it) while the request is measured.
    spare = coordinator.pool.allocate(len(hashes) + (SUFFIX + 32 + STREAM_TOKENS) // BLOCK + 4)
    blocks, spare = spare[: len(hashes)], spare[len(hashes) :]
    coordinator.pool.free(spare)
    shape = engine.kv_pool.read_blocks([blocks[0].block_id])[0]
    for start in range(0, len(blocks), PLANT_BLOCKS):
        part = blocks[start : start + PLANT_BLOCKS]
        k = (mx.random.normal((shape.keys.shape[0], len(part), *shape.keys.shape[1:])) * 0.5).astype(shape.keys.dtype)
        v = (mx.random.normal((shape.values.shape[0], len(part), *shape.values.shape[1:])) * 0.5).astype(
            shape.values.dtype)
        engine.kv_pool.write_blocks([b.block_id for b in part], KVRun(k, v).blocks())
    keys = [manager.key(h) for h in hashes]
    coordinator.pool.register(blocks, keys, manager.index)
    if store:  # in parts, each written before the next: the tier drops what overflows its write queue
        for start in range(0, len(blocks), PLANT_BLOCKS):
            part = slice(start, start + PLANT_BLOCKS)
            engine.connector.cache_blocks(keys[part], coordinator.writes.reader(blocks[part]))
            engine.connector.flush()
    coordinator.pool.free(blocks[::-1])


def _measure(engine: Engine, prompt: list[int], vocab: int) -> dict:
    core = engine.core
    times: list[float] = []
    stream = engine.make_request(_tokens(32, vocab, seed=13), lambda r: times.append(time.perf_counter()),
                                 max_tokens=STREAM_TOKENS)
    core.add(stream)
    while len(times) < WARM_TOKENS:
        core.step()
    hit_records = []
    arrived = time.perf_counter()
    hit = engine.make_request(prompt, lambda r: hit_records.append((time.perf_counter(), r)), max_tokens=1)
    core.add(hit)
    while not hit_records or len([t for t in times if t > hit_records[-1][0]]) < AFTER_TOKENS:
        if stream.state is RequestState.FINISHED:
            raise MlxkvError(f"the stream's {STREAM_TOKENS} tokens ended before the request was served; "
                             "a shorter --gap-tokens, or a less busy machine")
        core.step()
    core.abort(stream)
    served = hit_records[-1][0]
    gaps = [(a, b) for a, b in zip(times, times[1:])]
    before = [b - a for a, b in gaps if b <= arrived][2:]  # the first steps warm up
    during = [b - a for a, b in gaps if b > arrived and a <= served]
    stats = hit_records[-1][1].stats
    return {"max_gap": max(during), "median_step": statistics.median(before), "ttft": stats.ttft_s,
            "loading_s": stats.loading_s, "disk_tokens": stats.cached_tokens["disk"],
            "bytes_per_token": engine.kv_layout.bytes_per_token}
