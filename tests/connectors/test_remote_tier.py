"""The remote tier against a real redis-server: round trips, the format, checkpoints, and every fault
the issue names (a server paused, killed, down at start, a wrong password, a full server, a flipped
bit, a queue the server cannot drain), each a miss or a dropped write, said once, never raised.

Synthetic KV with small shapes; no model. Reads get a generous timeout
(a loaded CI machine must not turn hits into misses) except where the
bound itself is tested.
"""

from __future__ import annotations

import json
import logging
import time
import warnings

import mlxkv  # noqa: F401  (before mlx: it loads OpenBLAS)
import mlx.core as mx
import numpy as np
import pytest
import redis

from faults import fill_redis, wait_until
from block_chains import block_chain
from mlxkv.cache.block_kv import BlockKV, KVRun
from mlxkv.cache.checkpoints import Checkpoint, CheckpointRef
from mlxkv.config import CacheConfig
from mlxkv.connectors.disk import run_file
from mlxkv.connectors.disk.connector import DiskKVCacheConnector
from mlxkv.connectors.remote import connector as remote_connector
from mlxkv.connectors.remote.connector import RemoteKVCacheConnector, RemoteTierWarning
from mlxkv.connectors.remote.local_server import LocalRedisServer
from mlxkv.connectors.remote.url import redact
from mlxkv.errors import MlxkvError

FP = b"\x07" * 32
LAYERS, HEADS, BS, DIM = 2, 2, 4, 8
MX = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
HEALTH_LOG = "mlxkv.connectors.health"


def chain(n: int, salt: str = "") -> list[bytes]:
    return block_chain(FP, BS, n, salt)


def pool_read(n: int, dtype: str = "float32", seed: int = 0) -> list[BlockKV]:
    """n blocks as a pool read gives them: views of one layer-major run."""
    rng = np.random.default_rng(seed)
    shape = (LAYERS, n, HEADS, BS, DIM)
    k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)).astype(MX[dtype]) for _ in range(2))
    return KVRun(k, v).blocks()


def same_bits(a: BlockKV, b: BlockKV) -> bool:
    bits = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16}[a.keys.dtype]
    return a.keys.dtype == b.keys.dtype and all(
        x.shape == y.shape and mx.array_equal(x.view(bits), y.view(bits)).item()
        for x, y in ((a.keys, b.keys), (a.values, b.values)))


def open_remote(url: str, fingerprint: bytes = FP, dtype: str = "float32", **kw) -> RemoteKVCacheConnector:
    kw.setdefault("timeout_s", 2.0)
    return RemoteKVCacheConnector(url, fingerprint, block_size=BS, num_layers=LAYERS, dtype=dtype,
                                  block_nbytes=2 * LAYERS * HEADS * BS * DIM * 4, **kw)


def written(url: str, hashes, dtype: str = "float32", **kw) -> list[BlockKV]:
    """Blocks written through one connector and flushed; returns their K/V."""
    kvs = pool_read(len(hashes), dtype)
    writer = open_remote(url, dtype=dtype, **kw)
    writer.cache_blocks(hashes, lambda: kvs)
    assert writer.flush(timeout=30)
    assert writer.stats()["remote"]["stores"] == len(hashes)
    writer.close()
    return kvs


def health_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == HEALTH_LOG]


# -- round trips and the format ------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_blocks_come_back_from_another_connector_bit_for_bit_as_one_run(redis_server, dtype):
    server = redis_server()
    hashes = chain(6)
    kvs = written(server.url, hashes, dtype)
    reader = open_remote(server.url, dtype=dtype)
    assert reader.get_computed_blocks(hashes + chain(1, "other")) == 6
    loaded = reader.load_blocks(hashes)
    assert [b.block_hash for b in loaded] == hashes and {b.tier for b in loaded} == {"remote"}
    assert all(same_bits(b.kv, kv) for b, kv in zip(loaded, kvs))
    assert len({id(b.kv.run) for b in loaded}) == 1  # one stretch: one slice copy per layer into the pool
    reader.close()


def test_a_lookup_is_one_round_trip_and_a_hydrate_one_mget_per_few_mb(redis_server, monkeypatch):
    server = redis_server()
    hashes = chain(40)
    written(server.url, hashes)
    reader = open_remote(server.url)
    before = reader.link.round_trips
    assert reader.get_computed_blocks(hashes) == 40
    assert reader.link.round_trips == before + 1
    assert len(reader.load_blocks(hashes)) == 40
    assert reader.link.round_trips == before + 2
    monkeypatch.setattr(remote_connector, "MGET_BYTES", 10 * reader.block_nbytes)
    assert len(reader.load_blocks(hashes)) == 40
    assert reader.link.round_trips == before + 2 + 4
    reader.close()


def test_a_value_is_the_ssd_tiers_file_of_a_one_block_run(redis_server, tmp_path):
    server = redis_server()
    [h] = chain(1)
    [kv] = written(server.url, [h])
    with DiskKVCacheConnector(tmp_path, FP, block_size=BS, num_layers=LAYERS, dtype="float32",
                              min_free_bytes=0) as disk:
        disk.store(h, kv)
        disk.flush()
        [path] = tmp_path.rglob("*.safetensors")
    value = redis.Redis.from_url(server.url).get(f"mlxkv:{FP.hex()}:v3:kv:{h.hex()}")
    # The same file but for the order of its metadata (safetensors writes a hash map's).
    from_server, from_disk = (run_file.parse(np.frombuffer(b, np.uint8)) for b in (value, path.read_bytes()))
    assert from_server[0] == from_disk[0] and from_server[0]["checksum_algo"] == "xxh3_64"
    assert all(np.array_equal(from_server[1][t], from_disk[1][t]) for t in ("keys", "values"))
    assert len(value) == path.stat().st_size


def test_keys_are_namespaced_by_prefix_fingerprint_and_format_and_expire_when_asked(redis_server):
    server = redis_server()
    hashes = chain(3)
    written(server.url, hashes, prefix="team-a:", ttl_s=300)
    client = redis.Redis.from_url(server.url)
    keys = sorted(client.scan_iter())
    assert keys == sorted(f"team-a:{FP.hex()}:v3:kv:{h.hex()}".encode() for h in hashes)
    assert all(0 < client.ttl(k) <= 300 for k in keys)
    for other in (open_remote(server.url, prefix="mlxkv:"), open_remote(server.url, fingerprint=b"\x08" * 32,
                                                                          prefix="team-a:")):
        assert other.get_computed_blocks(hashes) == 0 and other.load_blocks(hashes) == []
        other.close()


def test_a_block_the_server_has_is_not_sent_again(redis_server):
    server = redis_server()
    hashes = chain(4)
    written(server.url, hashes[:2])
    second = open_remote(server.url)
    kvs = pool_read(4)
    second.cache_blocks(hashes, lambda: kvs)
    assert second.flush(timeout=30)
    stats = second.stats()["remote"]
    assert stats["stores"] == 2 and stats["already_there"] == 2
    second.close()


def test_a_checkpoint_and_where_it_sits_reach_another_process(redis_server):
    server = redis_server()
    hashes = chain(4)
    states = ((None, mx.arange(6, dtype=mx.float32).reshape(1, 6)), (mx.ones((1, 3), mx.bfloat16),))
    checkpoint = Checkpoint(CheckpointRef(hashes[3], 4 * BS), states)
    writer = open_remote(server.url, checkpoints=True)
    writer.cache_checkpoint(checkpoint)
    assert writer.flush(timeout=30)
    writer.close()
    reader = open_remote(server.url, checkpoints=True)  # a process started later
    assert checkpoint.ref in reader.checkpoint_refs()
    assert reader.has_checkpoint(checkpoint.key) and not reader.has_checkpoint(hashes[0])
    loaded = reader.load_checkpoint(checkpoint.key)
    assert loaded.tier == "remote"
    assert loaded.states[0][0] is None and mx.array_equal(loaded.states[0][1], states[0][1]).item()
    assert loaded.states[1][0].dtype == mx.bfloat16 and mx.array_equal(loaded.states[1][0], states[1][0]).item()
    reader.close()


def test_the_url_is_checked_and_its_password_never_shown():
    with pytest.raises(MlxkvError, match="redis://"):
        CacheConfig(remote_tier="http://host:6379")
    with pytest.raises(MlxkvError, match="database"):
        CacheConfig(remote_tier="redis://host:6379/zero")
    with pytest.raises(MlxkvError, match="TTL"):
        CacheConfig(remote_tier="redis://host", remote_tier_ttl_s=0)
    assert redact("redis://me:s3cret@host:6379/1") == "redis://me:***@host:6379/1"
    assert "s3cret" not in redact("rediss://:s3cret@host/0")


# -- faults: each a miss or a dropped write, said once --------------------------------


def test_a_paused_server_costs_a_lookup_one_timeout_then_nothing_until_it_answers(redis_server, caplog,
                                                                                 fast_backoff):
    server = redis_server()
    hashes = chain(8)
    written(server.url, hashes)
    reader = open_remote(server.url, timeout_s=0.05)
    assert reader.get_computed_blocks(hashes) == 8
    server.pause()
    try:
        for late in range(1, 4):  # one slow read is a miss; three in a row and the tier is down
            start = time.monotonic()
            assert reader.get_computed_blocks(hashes) == 0
            assert time.monotonic() - start < 0.5  # a 50 ms timeout, on a loaded machine
            assert reader.stats()["remote"]["timeouts"] == late
            assert reader.stats()["remote"]["state"] == ("down" if late == 3 else "ok")
        trips = reader.link.round_trips
        assert reader.load_blocks(hashes) == [] and reader.get_computed_blocks(hashes) == 0
        assert reader.link.round_trips == trips  # down: no wait, not even a connect
    finally:
        server.resume()
    assert wait_until(lambda: reader.stats()["remote"]["state"] == "ok")
    assert reader.get_computed_blocks(hashes) == 8
    lines = health_lines(caplog)
    assert len(lines) == 2 and "remote tier down" in lines[0] and "remote tier ok again" in lines[1]
    reader.close()


def test_a_server_killed_and_started_again_is_used_again_by_itself(redis_server, caplog, fast_backoff):
    server = redis_server()
    hashes = chain(6)
    tier = open_remote(server.url)
    kvs = pool_read(6)
    tier.cache_blocks(hashes[:2], lambda: kvs[:2])
    assert tier.flush(timeout=30)
    server.kill()
    assert tier.get_computed_blocks(hashes) == 0 and tier.stats()["remote"]["state"] == "down"
    tier.cache_blocks(hashes[2:4], lambda: kvs[2:4])  # dropped and counted, not queued
    assert tier.stats()["remote"]["dropped_writes"] == 2
    server.start()  # the same port, empty (no persistence)
    assert wait_until(lambda: tier.stats()["remote"]["state"] == "ok")
    tier.cache_blocks(hashes[2:4], lambda: kvs[2:4])  # offered again: the dropped ones were not marked sent
    assert tier.flush(timeout=30)
    assert tier.get_computed_blocks(hashes[2:]) == 2
    assert len(health_lines(caplog)) == 2
    tier.close()


def test_a_server_down_at_start_is_one_warning_and_comes_back_by_itself(tmp_path, redis_server, caplog,
                                                                        fast_backoff):
    redis_server()  # skips where there is no redis-server
    server = LocalRedisServer(tmp_path / "later")
    with pytest.warns(RemoteTierWarning, match="remote tier down: .*refused") as said:
        tier = open_remote(server.url)
    assert len(said) == 1 and tier.stats()["remote"]["state"] == "down"
    assert tier.get_computed_blocks(chain(2)) == 0
    with server:
        assert wait_until(lambda: tier.stats()["remote"]["state"] == "ok")
        written(server.url, chain(2))
        assert tier.get_computed_blocks(chain(2)) == 2
        tier.close()
    assert health_lines(caplog) == [l for l in health_lines(caplog) if "ok again" in l]


def test_a_wrong_password_is_a_miss_and_a_dropped_write_said_once(redis_server, caplog, fast_backoff):
    server = redis_server(password="right")
    hashes = chain(3)
    written(server.url, hashes)
    with pytest.warns(RemoteTierWarning, match="authentication failed"):
        tier = open_remote(server.url_with("wrong"))
    kvs = pool_read(3)
    for _ in range(3):
        assert tier.get_computed_blocks(hashes) == 0 and tier.load_blocks(hashes) == []
        tier.cache_blocks(hashes, lambda: kvs)
        time.sleep(0.1)  # probes come and fail
    stats = tier.stats()["remote"]
    assert stats["state"] == "down" and "authentication failed" in stats["reason"]
    assert stats["dropped_writes"] >= 3 and health_lines(caplog) == []
    tier.close()


def test_a_full_server_drops_writes_says_so_once_and_still_serves_reads(redis_server, caplog):
    server = redis_server(settings={"maxmemory-policy": "noeviction"})
    first = chain(2)
    written(server.url, first)
    tier = open_remote(server.url)
    fill_redis(server.url)
    hashes = chain(12, "more")
    kvs = pool_read(12)
    for i in range(0, 12, 3):
        tier.cache_blocks(hashes[i : i + 3], lambda: kvs[:3])
        tier.flush(timeout=30)
    stats = tier.stats()["remote"]
    assert stats["state"] == "dropping-writes" and "full" in stats["reason"] and "allkeys-lru" in stats["reason"]
    assert stats["stores"] == 0 and stats["write_errors"] + stats["dropped_writes"] == 12
    assert tier.get_computed_blocks(first) == 2 and len(tier.load_blocks(first)) == 2
    lines = health_lines(caplog)
    assert len(lines) == 1 and "dropping writes" in lines[0]
    tier.close()


def test_a_bit_flipped_value_is_a_miss_counted_removed_and_said_once(redis_server, caplog):
    server = redis_server()
    hashes = chain(5)
    kvs = written(server.url, hashes)
    client = redis.Redis.from_url(server.url)
    for h in (hashes[2], hashes[4]):
        key = f"mlxkv:{FP.hex()}:v3:kv:{h.hex()}"
        value = bytearray(client.get(key))
        value[-5] ^= 0x08  # a bit of the tensor bytes, which come last
        client.set(key, bytes(value))
    reader = open_remote(server.url)
    with caplog.at_level(logging.WARNING):
        loaded = reader.load_blocks(hashes)
        assert [b.block_hash for b in loaded] == hashes[:2]
        assert all(same_bits(b.kv, kv) for b, kv in zip(loaded, kvs))
        assert reader.load_blocks(hashes[4:]) == []
    assert reader.flush(timeout=30)
    assert reader.stats()["remote"]["corrupt"] == 2
    assert reader.get_computed_blocks(hashes) == 2  # both removed: whoever computes them writes them again
    said = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(said) == 1 and "checksum mismatch" in said[0]
    reader.close()


def test_a_full_queue_drops_and_counts_and_never_makes_a_step_wait(redis_server, caplog):
    server = redis_server()
    block = 2 * LAYERS * HEADS * BS * DIM * 4
    tier = open_remote(server.url, max_pending_bytes=3 * block)
    server.pause()  # the writer waits on its first write; the queue fills behind it
    try:
        kvs, hashes = pool_read(3), chain(12)
        start = time.monotonic()
        for i in range(0, 12, 3):
            tier.cache_blocks(hashes[i : i + 3], lambda: kvs)
        assert time.monotonic() - start < 0.5
        stats = tier.stats()["remote"]
        assert stats["dropped_writes"] == 9 and stats["state"] == "dropping-writes"
        assert "queue is full" in stats["reason"]
    finally:
        server.resume()
    assert tier.flush(timeout=30)
    tier.close()
    assert sum("dropping writes" in line for line in health_lines(caplog)) == 1


def test_no_fault_reaches_the_caller_as_an_exception(redis_server):
    """Every public call on a tier whose server is gone returns a miss."""
    server = redis_server()
    tier = open_remote(server.url, checkpoints=True)
    server.kill()
    hashes = chain(2)
    checkpoint = Checkpoint(CheckpointRef(hashes[1], 2 * BS), ((mx.zeros((1, 2)),),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tier.get_computed_blocks(hashes) == 0
        assert tier.load_blocks(hashes) == []
        assert not tier.has_checkpoint(checkpoint.key) and tier.load_checkpoint(checkpoint.key) is None
        tier.cache_blocks(hashes, lambda: pool_read(2))
        tier.evict_blocks(hashes, lambda: pool_read(2))
        tier.cache_checkpoint(checkpoint)
        tier.evict_checkpoint(checkpoint)
        assert tier.checkpoint_refs() == []
        assert tier.flush(timeout=10)
        tier.close()


def test_the_documented_acl_user_works_and_a_read_only_one_makes_the_tier_read_only(redis_server, caplog):
    server = redis_server()
    admin = redis.Redis.from_url(server.url)
    # docs/tiers.md's user line, then one that may only read.
    admin.execute_command("ACL", "SETUSER", "mlxkv", "on", ">pw", "~mlxkv:*", *(
        "+ping +info +exists +get +mget +set +del +unlink +expire +xadd +xrange +scan +strlen +xlen "
        "+config|get").split())
    admin.execute_command("ACL", "SETUSER", "reader", "on", ">pw", "~mlxkv:*",
                          *"+ping +exists +get +mget +xrange".split())
    url = server.url.replace("redis://", "redis://{}:pw@")
    hashes = chain(4)
    written(url.format("mlxkv"), hashes[:2], checkpoints=True)
    reader = open_remote(url.format("reader"))
    kvs = pool_read(4)
    reader.cache_blocks(hashes, lambda: kvs)
    assert reader.flush(timeout=30)
    stats = reader.stats()["remote"]
    assert stats["state"] == "read-only" and "ACL" in stats["reason"] and stats["stores"] == 0
    assert reader.get_computed_blocks(hashes) == 2 and len(reader.load_blocks(hashes)) == 2
    lines = health_lines(caplog)
    assert len(lines) == 1 and lines[0].startswith("remote tier read-only: refused by the server's ACL")
    reader.close()


def test_cache_info_verify_and_clear_on_a_remote_tier(redis_server, capsys):
    from mlxkv.cli import main as cli_main

    server = redis_server(settings={"maxmemory-policy": "noeviction"})
    hashes = chain(3)
    written(server.url, hashes)
    client = redis.Redis.from_url(server.url)
    client.set("someone-else", b"kept")
    key = f"mlxkv:{FP.hex()}:v3:kv:{hashes[1].hex()}"
    client.setrange(key, client.strlen(key) - 1, b"\xff")
    assert cli_main(["cache", "info", "--remote-tier", server.url, "--verify"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fingerprints"] == {FP.hex(): {"blocks": 3, "checkpoints": 0, "bytes": info["bytes"]}}
    assert info["verified"] == 3 and info["corrupt"] == 1 and info["corrupt_keys"] == [f"{key}: checksum mismatch"]
    assert any("noeviction" in line for line in info["advice"]) and any("maxmemory" in a for a in info["advice"])
    assert cli_main(["cache", "clear", "--remote-tier", server.url]) == 0
    assert "removed 3 keys" in capsys.readouterr().out
    assert list(client.scan_iter()) == [b"someone-else"]
    assert cli_main(["cache", "info", "--remote-tier", "redis://127.0.0.1:1/0"]) == 2
    assert capsys.readouterr().err.startswith("mlxkv: error: remote tier redis://127.0.0.1:1/0: ")


def test_doctor_says_whether_the_remote_tier_answers_and_what_its_settings_mean(redis_server):
    from mlxkv.connectors.doctor import remote_report, tier_lines

    server = redis_server(password="pw", settings={"maxmemory": "100mb", "maxmemory-policy": "allkeys-lru"})
    good = remote_report(server.url)
    assert good["state"] == "ok" and good["advice"] == [] and good["url"] == "redis://:***@127.0.0.1:" \
        f"{server.port}/0"
    assert tier_lines({"remote": good})[0][1].startswith("ok: redis://:***@")
    wrong = remote_report(server.url_with("nope"))
    assert wrong["state"] == "down" and "authentication failed" in wrong["reason"]
    assert remote_report("redis://127.0.0.1:1/0")["state"] == "down"


def test_behind_memory_and_ssd_a_remote_hit_is_promoted_into_the_ssd_tier(redis_server, tmp_path):
    from mlxkv.connectors.tiered import TieredKVCacheConnector

    server = redis_server()
    hashes = chain(6)
    kvs = written(server.url, hashes[3:])  # another Mac wrote the last three
    disk = DiskKVCacheConnector(tmp_path, FP, block_size=BS, num_layers=LAYERS, dtype="float32", min_free_bytes=0)
    tiers = TieredKVCacheConnector(disk, 1 << 20, BS, remote=open_remote(server.url))
    first = pool_read(3, seed=1)
    tiers.cache_blocks(hashes[:3], lambda: first)  # written through to SSD and offered to the server
    assert tiers.flush(timeout=30)
    assert tiers.get_computed_blocks(hashes) == 6
    loaded = tiers.load_blocks(hashes)
    assert [b.tier for b in loaded] == ["disk"] * 3 + ["remote"] * 3
    assert all(same_bits(b.kv, kv) for b, kv in zip(loaded[3:], kvs))
    assert tiers.flush(timeout=30)
    assert all(disk.contains(h) for h in hashes)  # the remote hits now survive a restart without the network
    assert tiers.stats()["remote"]["stores"] == 3 and tiers.stats()["remote"]["already_there"] == 0
    tiers.close()


def test_health_says_where_and_what_is_queued_never_the_password(redis_server):
    server = redis_server(password="s3cret")
    tier = open_remote(server.url)
    health = tier.health()
    assert health["url"] == server.url.replace("s3cret", "***") and health["state"] == "ok"
    assert health["pending_writes"] == 0 and health["round_trips"] >= 1
    assert "s3cret" not in json.dumps(tier.stats())
    tier.close()
