"""The remote tier through the real engine: two processes sharing a prefix, a hybrid's checkpoint,
a server killed mid-run, the faults, and namespace secrets. Every case: output equal to a cold run.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import redis

from family_support import model_with_oracle, prompt_of
from faults import fill_redis, wait_until
from mlxkv.config import CacheConfig
from mlxkv.connectors.remote.connector import RemoteTierWarning
from mlxkv.engine.engine import Engine
from mlxkv.host.engine_thread import EngineThread
from mlxkv.models.tiny import TinyModelSpec

BLOCK = 4
PROMPT = "the ships sail on the sea and the wind is strong and cold tonight"
HEALTH_LOG = "mlxkv.connectors.health"


def tokens(n, start=1):
    return [(start + 17 * i) % 300 + 3 for i in range(n)]


def remote_engine(model, url, **fields) -> Engine:
    fields = {"memory_tier_bytes": 0, "remote_tier_timeout_ms": 2000, **fields}  # a loaded CI box: hits stay hits
    return Engine.load(model, CacheConfig(block_size=BLOCK, num_blocks=64, remote_tier=url, **fields))


@pytest.fixture(scope="module")
def cold(model_dirs):
    engine = Engine.load(model_dirs["llama"], CacheConfig(block_size=BLOCK, num_blocks=64, memory_tier_bytes=0))
    return lambda prompt, n=6: engine.generate(prompt, max_tokens=n).tokens


@pytest.mark.slow
def test_two_processes_share_a_prefix_the_second_hits_on_its_first_request(llama_dir, redis_server):
    server = redis_server()

    def generate():
        out = subprocess.run([sys.executable, "-m", "mlxkv.cli", "generate", "--model", llama_dir, "--raw", "--json",
                              "--max-tokens", "6", "--block-size", str(BLOCK), "--memory-tier-mb", "0",
                              "--remote-tier", server.url, "--remote-tier-timeout-ms", "2000", "--prompt", PROMPT],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        return json.loads(out.stdout.splitlines()[-1])

    first, second = generate(), generate()
    assert first["cached_tokens"]["remote"] == 0 and first["connector"]["remote"]["stores"] > 0
    assert second["cached_tokens"]["remote"] == (len(first["prompt_tokens"]) - 1) // BLOCK * BLOCK > 0
    assert second["connector"]["remote"]["hydrations"] > 0
    assert second["tokens"] == first["tokens"]  # the first one ran cold: nothing on the server yet


def test_a_hybrids_checkpoint_comes_through_the_remote_tier(tmp_path, redis_server):
    server = redis_server()
    _, loaded, reference = model_with_oracle(tmp_path / "qwen3_next", TinyModelSpec(family="qwen3_next",
                                                                                   num_layers=4, seed=41))
    config = CacheConfig(block_size=16, num_blocks=128, memory_tier_bytes=0, checkpoint_interval=32,
                         checkpoint_write_ratio=0, remote_tier=server.url, remote_tier_timeout_ms=2000)
    first = prompt_of(75)
    with Engine(loaded, config) as engine:
        turn1 = engine.generate(first, max_tokens=20)
    second = first + turn1.tokens + prompt_of(9, salt=3)
    with Engine(loaded, config) as engine:  # a new process's pool and tiers: only the server is shared
        turn2 = engine.generate(second, max_tokens=20)
        remote = engine.stats()["connector"]["remote"]
    # The first turn's last full block: its checkpoint came from the server with the blocks before it.
    assert turn2.stats.cached_tokens["remote"] == (len(first) + len(turn1.tokens)) // 16 * 16
    assert remote["hydrations"] > turn2.stats.cached_tokens["remote"] // 16  # the blocks, and the checkpoint
    assert turn2.tokens == reference(second, 20)


@pytest.mark.slow
def test_killing_the_server_mid_run_loses_no_request_and_the_tier_recovers(llama_dir, redis_server, cold,
                                                                           fast_backoff):
    server = redis_server()
    prompts = [tokens(40, start) for start in (1, 2, 3)]
    thread = EngineThread(llama_dir, CacheConfig(block_size=BLOCK, num_blocks=64, memory_tier_bytes=0,
                                                 remote_tier=server.url, remote_tier_timeout_ms=2000)).start()
    try:
        thread.wait_ready(timeout=120)
        handles = [thread.submit(p, max_tokens=60) for p in prompts]
        started = next(iter(handles[0]))  # running
        server.kill()
        results = [[c.token for c in h if hasattr(c, "token")] for h in handles]
        results[0].insert(0, started.token)
        assert results == [cold(p, 60) for p in prompts]
        later = tokens(40, 9)
        assert [c.token for c in thread.submit(later, max_tokens=6) if hasattr(c, "token")] == cold(later)
        assert wait_until(lambda: thread.published["connector"]["remote"]["state"] == "down")
        server.start()  # the same port, empty
        assert wait_until(lambda: thread.published["connector"]["remote"]["state"] == "ok")
        again = tokens(40, 11)
        assert [c.token for c in thread.submit(again, max_tokens=6) if hasattr(c, "token")] == cold(again)
        assert thread.call(lambda engine: engine.connector.flush(30)).result(60)
    finally:
        thread.close()
    with remote_engine(llama_dir, server.url) as engine:  # written after the server came back
        result = engine.generate(again, max_tokens=6)
    assert result.stats.cached_tokens["remote"] > 0 and result.tokens == cold(again)


def _wrong_password(redis_server, model):
    server = redis_server(password="right")
    with pytest.warns(RemoteTierWarning, match="authentication failed"):
        return remote_engine(model, server.url_with("wrong")), "down", server


def _full_server(redis_server, model):
    server = redis_server(settings={"maxmemory-policy": "noeviction"})
    fill_redis(server.url)
    return remote_engine(model, server.url), "dropping-writes", server


def _flipped_values(redis_server, model):
    server = redis_server()
    with remote_engine(model, server.url) as engine:
        engine.generate(tokens(33), max_tokens=6)
    client = redis.Redis.from_url(server.url)
    for key in client.scan_iter(match="mlxkv:*"):
        value = bytearray(client.get(key))
        value[-3] ^= 0x40
        client.set(key, bytes(value))
    return remote_engine(model, server.url), "ok", server


@pytest.mark.parametrize("fault", [_wrong_password, _full_server, _flipped_values])
def test_a_fault_is_a_miss_or_a_dropped_write_with_identical_output(llama_dir, redis_server, cold, caplog, fault):
    engine, state, _ = fault(redis_server, llama_dir)
    with engine, caplog.at_level(logging.WARNING):
        for prompt in (tokens(33), tokens(33) + tokens(8, 5), tokens(21, 4)):
            assert engine.generate(prompt, max_tokens=6).tokens == cold(prompt)
        engine.connector.flush(30)
        remote = engine.stats()["connector"]["remote"]
    assert remote["state"] == state
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) <= 1  # the wrong password warned at start; the others say it once here
    if fault is _flipped_values:
        assert remote["corrupt"] > 0 and "corrupt" in said[0].getMessage()
    if fault is _full_server:
        assert remote["stores"] == 0 and "full" in said[0].getMessage()


def test_another_namespace_secret_never_hits(llama_dir, redis_server, cold):
    server = redis_server()
    prompt = tokens(33)
    with remote_engine(llama_dir, server.url, remote_tier_salt="team-a") as engine:
        engine.generate(prompt, max_tokens=6)
    for salt, hit in (("team-b", False), (None, False), ("team-a", True)):
        with remote_engine(llama_dir, server.url, remote_tier_salt=salt) as engine:
            result = engine.generate(prompt, max_tokens=6)
            assert (result.stats.cached_tokens["remote"] > 0) == hit, salt
            assert result.tokens == cold(prompt)
    with remote_engine(llama_dir, server.url, remote_tier_salt="team-a") as engine:  # a request's own salt too
        assert engine.generate(prompt, max_tokens=6, cache_salt="me").stats.cached_tokens["remote"] == 0
