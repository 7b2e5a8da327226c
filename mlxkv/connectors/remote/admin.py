"""`mlxkv cache info | clear --remote-tier URL`: a server's mlxkv keys, without opening a tier.

Info lists the keys under the prefix (SCAN, never KEYS) by model
fingerprint, with their bytes, and says what the server's settings mean
for a cache (docs/tiers.md: maxmemory, allkeys-lru, persistence off);
`--verify` reads every value and checks its checksum as the SSD tier's
files are checked. Clear unlinks those keys and nothing else.
"""

from __future__ import annotations

import numpy as np

from mlxkv.connectors.disk.verify import CORRUPT_LISTED, problem
from mlxkv.connectors.remote.keys import DEFAULT_PREFIX
from mlxkv.connectors.remote.url import check_url, redact
from mlxkv.errors import MlxkvError, first_line

BATCH = 500
TIMEOUT_S = 5.0


def admin_client(url: str):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    check_url(url)
    return redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S,
                                retry=Retry(NoBackoff(), 0))


def _kind(key: bytes, prefix: bytes) -> tuple[str, str] | None:
    """(fingerprint hex, "blocks" | "checkpoints" | "streams") of one of our keys."""
    parts = key[len(prefix):].decode(errors="replace").split(":")
    if len(parts) < 3 or len(parts[0]) != 64:
        return None
    kind = {"kv": "blocks", "state": "checkpoints", "checkpoints": "streams"}.get(parts[2])
    return (parts[0], kind) if kind else None


def remote_info(url: str, prefix: str = DEFAULT_PREFIX, verify: bool = False) -> dict:
    from redis.exceptions import RedisError

    client = admin_client(url)
    info = {"remote_tier": redact(url), "prefix": prefix, "fingerprints": {}, "keys": 0, "bytes": 0}
    try:
        info["server"] = server_settings(client)
        keys = list(client.scan_iter(match=prefix.encode() + b"*", count=1000))
        _count(client, keys, prefix.encode(), info)
        if verify:
            info.update(_verify(client, [k for k in keys if not k.endswith(b":checkpoints")]))
    except (RedisError, OSError) as e:
        raise MlxkvError(f"remote tier {redact(url)}: {first_line(e)}") from None
    finally:
        client.close()
    info["advice"] = advice(info["server"])
    return info


def server_settings(client) -> dict:
    from redis.exceptions import ResponseError

    server, memory = client.info("server"), client.info("memory")
    out = {"version": server.get("valkey_version") or server.get("redis_version"),
           "used_memory": memory.get("used_memory"), "maxmemory": memory.get("maxmemory"),
           "maxmemory_policy": memory.get("maxmemory_policy")}
    try:
        config = client.config_get("save")
        config.update(client.config_get("appendonly"))
        out["save"], out["appendonly"] = config.get("save"), config.get("appendonly")
    except ResponseError:  # an ACL may refuse CONFIG: the advice then says nothing of persistence
        pass
    return out


def advice(server: dict) -> list[str]:
    """What a cache server's settings should change, in one line each (docs/tiers.md)."""
    out = []
    if not server.get("maxmemory"):
        out.append("no maxmemory: the server grows until its machine runs out of memory; set maxmemory")
    if server.get("maxmemory_policy") == "noeviction":
        out.append("maxmemory-policy noeviction: a full server refuses every write; use allkeys-lru")
    if server.get("save") or server.get("appendonly") == "yes":
        out.append('persistence is on: a cache needs none (save "", appendonly no)')
    return out


def _count(client, keys: list[bytes], prefix: bytes, info: dict) -> None:
    ours = [(key, kind) for key in keys if (kind := _kind(key, prefix)) is not None]
    for start in range(0, len(ours), BATCH):
        part = ours[start : start + BATCH]
        pipe = client.pipeline(transaction=False)
        for key, (_, kind) in part:
            (pipe.xlen if kind == "streams" else pipe.strlen)(key)
        for (key, (fingerprint, kind)), size in zip(part, pipe.execute(raise_on_error=False)):
            if isinstance(size, Exception):
                continue  # gone meanwhile (a TTL, eviction)
            info["keys"] += 1
            if kind == "streams":
                continue
            entry = info["fingerprints"].setdefault(fingerprint, {"blocks": 0, "checkpoints": 0, "bytes": 0})
            entry[kind] += 1
            entry["bytes"] += size
            info["bytes"] += size


def _verify(client, keys: list[bytes]) -> dict:
    corrupt = []
    for start in range(0, len(keys), BATCH // 10):
        part = keys[start : start + BATCH // 10]
        for key, value in zip(part, client.mget(part)):
            if value is not None and (why := problem(np.frombuffer(value, np.uint8))) is not None:
                corrupt.append(f"{key.decode(errors='replace')}: {why}")
    return {"verified": len(keys), "corrupt": len(corrupt), "corrupt_keys": corrupt[:CORRUPT_LISTED]}


def remote_clear(url: str, prefix: str = DEFAULT_PREFIX) -> int:
    """Unlink every key under the prefix; how many."""
    from redis.exceptions import RedisError

    if not prefix:
        raise MlxkvError("refusing to clear a remote tier with an empty key prefix: that is every key")
    client = admin_client(url)
    removed = 0
    try:
        batch = []
        for key in client.scan_iter(match=prefix.encode() + b"*", count=1000):
            batch.append(key)
            if len(batch) == BATCH:
                removed += client.unlink(*batch)
                batch = []
        if batch:
            removed += client.unlink(*batch)
    except (RedisError, OSError) as e:
        raise MlxkvError(f"remote tier {redact(url)} ({removed} keys removed): {first_line(e)}") from None
    finally:
        client.close()
    return removed
