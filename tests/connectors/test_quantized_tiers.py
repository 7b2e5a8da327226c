"""A quantized pool's blocks through the tiers, as they are: the memory tier counts their
bytes, a restart from the SSD or the remote tier gives the output of a cold run, and a
file of another KV format is never read as this one."""

from __future__ import annotations

from pathlib import Path

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import pytest
import safetensors

from mlxkv.attention.paged_cache import PagedBatch
from mlxkv.cache.hashing import hash_block, root_hash
from mlxkv.cache.kv_format import KVFormat
from mlxkv.cache.kv_pool import KVLayout, KVPool
from mlxkv.config import CacheConfig
from mlxkv.connectors.disk.connector import DiskKVCacheConnector
from mlxkv.engine.engine import Engine
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model

BLOCK = 4


def tokens(n, start=1):
    return [(start + 17 * i) % 300 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("quantized-tiers") / "llama",
                                TinyModelSpec(family="llama", head_dim=32, seed=72)))


def engine(model, bits, **fields) -> Engine:
    fields = {"block_size": BLOCK, "num_blocks": 64, "memory_tier_bytes": 0, **fields}
    return Engine.load(model, CacheConfig(kv_bits=bits, kv_group_size=32, **fields))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_restart_from_the_ssd_tier_restores_quantized_blocks(llama_dir, tmp_path, bits):
    prompt = tokens(9 * BLOCK + 1)
    cold = engine(llama_dir, bits).generate(prompt, max_tokens=8).tokens
    with engine(llama_dir, bits, disk_tier=str(tmp_path)) as first:
        assert first.generate(prompt, max_tokens=8).tokens == cold
    (f, *_) = sorted(Path(tmp_path).rglob("*.safetensors"))
    with safetensors.safe_open(str(f), "numpy") as opened:
        assert opened.metadata()["kv_format"] == f"q{bits}g32" and opened.get_tensor("keys").dtype == "uint8"
    with engine(llama_dir, bits, disk_tier=str(tmp_path)) as restarted:
        again = restarted.generate(prompt, max_tokens=8)
        assert again.tokens == cold and again.stats.cached_tokens["disk"] == 9 * BLOCK
        held = restarted.stats()["connector"]["disk"]
    assert held["bytes_held"] < 9 * restarted.kv_layout.bytes_per_block * 2  # quantized bytes, and headers


def test_the_memory_tier_keeps_the_pools_blocks_as_they_are(llama_dir):
    prompts = [tokens(6 * BLOCK + 1, s) for s in (1, 2, 3)]
    cold = [engine(llama_dir, 4).generate(p, max_tokens=4).tokens for p in prompts]
    tiered = engine(llama_dir, 4, num_blocks=10, memory_tier_bytes=1 << 20)
    for p in prompts:
        tiered.generate(p, max_tokens=4)  # a small pool: each evicts the last one's blocks
    memory = tiered.stats()["connector"]["memory"]
    assert memory["blocks_held"] >= 6
    assert memory["bytes_held"] == memory["blocks_held"] * tiered.kv_layout.bytes_per_block
    again = tiered.generate(prompts[0], max_tokens=4)
    assert again.tokens == cold[0] and again.stats.cached_tokens["memory"] > 0


def test_a_restart_from_the_remote_tier_restores_quantized_blocks(llama_dir, redis_server):
    server = redis_server()
    prompt = tokens(7 * BLOCK + 2, 5)
    cold = engine(llama_dir, 8).generate(prompt, max_tokens=6).tokens
    fields = {"remote_tier": server.url, "remote_tier_timeout_ms": 2000}
    with engine(llama_dir, 8, **fields) as first:
        first.generate(prompt, max_tokens=6)
    with engine(llama_dir, 8, **fields) as second:
        again = second.generate(prompt, max_tokens=6)
    assert again.tokens == cold and again.stats.cached_tokens["remote"] == 7 * BLOCK


# -- another format ---------------------------------------------------------------------

FP = root_hash(b"\x05" * 32, "formats")


def quantized_blocks(kv: KVFormat, n: int):
    pool = KVPool(KVLayout(2, 2, 64, 64, BLOCK, mx.float16, kv=kv), n)
    batch = PagedBatch.build([list(range(n))], [0], n * BLOCK, BLOCK)
    x = mx.random.normal((1, 2, n * BLOCK, 64), key=mx.random.key(3)).astype(mx.float16)
    for layer in range(2):
        pool.write(layer, batch.groups[0].write_blocks, batch.write_offsets, x, -x)
    return pool.read_blocks(list(range(n)))


def open_disk(directory, kv_format: str | None, dtype="float16") -> DiskKVCacheConnector:
    # page=None: any page shape, so only the format can tell the files apart
    return DiskKVCacheConnector(directory, FP, block_size=BLOCK, num_layers=2, dtype=dtype, min_free_bytes=0,
                                kv_format=kv_format)


def test_a_file_of_another_kv_format_is_never_read_as_this_one(tmp_path):
    hashes, parent = [], root_hash(FP)
    for i in range(3):
        parent = hash_block(parent, [i] * BLOCK)
        hashes.append(parent)
    blocks = quantized_blocks(KVFormat(8, 32), 3)
    for other, dtype in (("q4g64", "float16"), (None, "float16"), ("q8g32", "bfloat16")):
        with open_disk(tmp_path, "q8g32") as disk:
            disk.cache_blocks(hashes, lambda: blocks)
            assert disk.flush(timeout=30)
        with open_disk(tmp_path, other, dtype) as disk:  # the same fingerprint and names
            assert disk.load_blocks(hashes) == []
            assert disk.stats()["disk"]["corrupt"] == 1  # and deleted, as any file that fails its checks
    with open_disk(tmp_path, "q8g32") as disk:  # the check can fail: its own format reads it
        disk.cache_blocks(hashes, lambda: blocks)
        assert disk.flush(timeout=30)
    with open_disk(tmp_path, "q8g32") as disk:
        loaded = disk.load_blocks(hashes)
    assert [mx.array_equal(b.kv.keys, want.keys).item() for b, want in zip(loaded, blocks)] == [True] * 3
