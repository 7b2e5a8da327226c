"""`mlxkv bench tiers`' remote rows: a Redis or Valkey server on loopback, measured side by side.

- restore: time to first token of a prompt whose 4k-token prefix comes
  back from the remote tier (a new engine, the server its only tier, as on
  a second Mac) against the same prompt with the prefix recomputed.
- read: `RemoteKVCacheConnector.load_blocks` throughput (MGETs, checksums,
  one copy into MLX memory) against a raw redis-py GET of the same values,
  one by one, on a client at its defaults: what the tier adds to a plain
  read of the bytes. Best of a few reads each.

The server is the one given, else a redis-server of the bench's own
(local_server.py) in the bench's temporary directory. Keys go under a
prefix of their own, so nothing a user keeps is read, and are removed after.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import mlx.core as mx

from mlxkv.benchmarks.engine import _tokens
from mlxkv.benchmarks.rows import row
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine

REMOTE_RESTORE_GOAL, REMOTE_READ_GOAL = 0.25, 0.80
READ_REPEATS = 5
SUFFIX = 16
# Reads wait this long, not the default 50 ms: a busy machine (the bench's
# own threads, the server, anything else) can hold the server off the CPU
# for longer, and a row measures restore speed, not the timeout.
TIMEOUT_S = 2.0


def remote_rows(loaded, engine: Engine, block_ids: list[int], restore_tokens: int, url: str | None,
                directory: Path, log) -> list[dict]:
    """The remote rows, on `url` or a server of our own; none (with a line saying why) without either."""
    from mlxkv.connectors.remote.local_server import LocalRedisServer, server_binary

    if url is not None:
        return _rows(loaded, engine, block_ids, restore_tokens, url, log)
    if server_binary() is None:
        log("remote rows: no redis-server or valkey-server on PATH, and no --remote-tier: left out")
        return []
    with LocalRedisServer(directory / "redis") as server:
        return _rows(loaded, engine, block_ids, restore_tokens, server.url, log)


def _rows(loaded, engine, block_ids, restore_tokens, url, log) -> list[dict]:
    from mlxkv.connectors.remote.admin import remote_clear

    prefix = f"mlxkv-bench-{secrets.token_hex(4)}:"
    try:
        return [_restore_row(loaded, url, prefix, restore_tokens, log), _read_row(engine, block_ids, url, prefix, log)]
    finally:
        remote_clear(url, prefix)


def _restore_row(loaded, url: str, prefix: str, n: int, log) -> dict:
    vocab = loaded.config["vocab_size"]
    prefix_tokens, suffix = _tokens(n, vocab, seed=1), _tokens(SUFFIX, vocab, seed=2)
    config = CacheConfig(block_size=16, num_blocks=2 * (n + SUFFIX) // 16 + 4, memory_tier_bytes=0,
                         remote_tier=url, remote_tier_prefix=prefix, remote_tier_timeout_ms=TIMEOUT_S * 1000)
    log(f"remote restore: computing a {n}-token prefix onto the remote tier ...")
    with Engine(loaded, config) as engine:
        cold = engine.generate(prefix_tokens + suffix, max_tokens=1).stats.ttft_s
        engine.connector.flush(120)
    with Engine(loaded, config) as engine:  # a fresh pool and no other tier, as on another Mac
        result = engine.generate(prefix_tokens + _tokens(SUFFIX, vocab, seed=3), max_tokens=1)
        state = engine.stats()["connector"]["remote"]["state"]
    hit = result.stats.cached_tokens["remote"]
    ttft = result.stats.ttft_s
    return row(f"restore {n} tok from remote", "s", ttft, cold, "recompute (cold TTFT)",
               f"<= {REMOTE_RESTORE_GOAL}", ttft / cold <= REMOTE_RESTORE_GOAL and hit > 0,
               note=f"{hit} tokens hydrated from the server on loopback (tier {state}); reads time out after "
                    f"{TIMEOUT_S:.0f} s here, not 50 ms: the bench's processes share one machine")


def _read_row(engine: Engine, block_ids: list[int], url: str, prefix: str, log) -> dict:
    import redis

    from mlxkv.connectors.remote.connector import RemoteKVCacheConnector

    log(f"remote read: {len(block_ids)} blocks ...")
    lay = engine.kv_layout
    tier = RemoteKVCacheConnector(url, engine.fingerprint, block_size=lay.block_size, num_layers=lay.num_layers,
                                  dtype=lay.dtype, block_nbytes=lay.bytes_per_block, prefix=prefix,
                                  timeout_s=TIMEOUT_S)
    kvs = engine.kv_pool.read_blocks(block_ids)
    hashes = [secrets.token_bytes(32) for _ in kvs]
    tier.cache_blocks(hashes, lambda: kvs)
    tier.flush(120)
    keys = [tier.space.block(h) for h in hashes]
    client = redis.Redis.from_url(url)
    total = sum(len(v) for v in client.mget(keys))
    best_tier = best_raw = float("inf")
    for _ in range(READ_REPEATS):
        start = time.perf_counter()
        loaded = tier.load_blocks(hashes)
        mx.eval(loaded[0].kv.run.keys, loaded[0].kv.run.values)  # one run holds them all
        best_tier = min(best_tier, time.perf_counter() - start)
        assert len(loaded) == len(hashes), "the tier missed blocks the server holds"
        del loaded
        start = time.perf_counter()
        for key in keys:
            client.get(key)
        best_raw = min(best_raw, time.perf_counter() - start)
    tier.close()
    client.close()
    tier_rate, raw_rate = total / best_tier, total / best_raw
    return row("remote tier read", "MB/s", tier_rate / 1e6, raw_rate / 1e6, "raw client GET",
               f">= {REMOTE_READ_GOAL}", tier_rate / raw_rate >= REMOTE_READ_GOAL,
               note=f"{len(hashes)} blocks, {total / 1e6:.0f} MB on loopback, checksums verified and copied into "
                    f"MLX memory; the raw side GETs each value with redis-py at its defaults; best of {READ_REPEATS}")
