"""What a prefix lookup costs: one per admission, and for a hybrid model O(checkpoints)
hashes and SSD `stat`s, not one of each per block boundary of the prompt."""

from __future__ import annotations

import hashlib
import os

import mlx.core as mx
import pytest

from mlxkv.cache.checkpoints import Checkpoint, CheckpointRef
from mlxkv.cache.coordinator import KVCacheCoordinator
from mlxkv.cache.hashing import extend_block_hashes, root_hash
from mlxkv.cache.kv_pool import KVLayout, KVPool
from mlxkv.cache.layer_groups import GroupLayout, KVGroup
from mlxkv.config import CacheConfig
from mlxkv.connectors.disk.connector import DiskKVCacheConnector
from mlxkv.engine.engine import Engine

BLOCK = 16
FINGERPRINT = bytes(range(32))
ROOT = root_hash(FINGERPRINT)
# Qwen3-Next-like: attention in slot 1, recurrent state in slots 0 and 2.
HYBRID = GroupLayout((KVGroup(0, None, (1,)),), 3, 1, recurrent=(0, 2), state_sizes=(2, 1))


class Counts:
    """Counts SHA-256 calls and file-system probes (stat, scandir) while installed."""

    def __init__(self, monkeypatch):
        self.sha = self.stat = 0
        sha, stat, scandir = hashlib.sha256, os.stat, os.scandir

        def counted_sha(*args):
            self.sha += 1
            return sha(*args)

        def counted_stat(*args, **kwargs):
            self.stat += 1
            return stat(*args, **kwargs)

        def counted_scandir(*args):
            self.stat += 1
            return scandir(*args)

        monkeypatch.setattr(hashlib, "sha256", counted_sha)
        monkeypatch.setattr(os, "stat", counted_stat)
        monkeypatch.setattr(os, "scandir", counted_scandir)


def hybrid_cache(tmp_path) -> KVCacheCoordinator:
    layout = KVLayout(1, 1, 8, 8, BLOCK, mx.float16, HYBRID)
    kv_pool = KVPool(layout, 16)
    disk = DiskKVCacheConnector(tmp_path / "kv", FINGERPRINT, block_size=BLOCK, num_layers=1, dtype="float16",
                                min_free_bytes=0)
    return KVCacheCoordinator(HYBRID, BLOCK, 4096, kv_pool=kv_pool, connector=disk, initial=16,
                              checkpoint_budget=1 << 20, checkpoint_interval=2048)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(13 * i + salt) % 997 for i in range(n)]


def states():
    return ((mx.zeros((1, 4)), mx.zeros((1, 4))), (mx.zeros((1, 4)),))


@pytest.mark.parametrize("checkpoints", [0, 15])
def test_a_32k_hybrid_lookup_costs_o_checkpoints_not_o_boundaries(tmp_path, monkeypatch, checkpoints):
    """The prompt's attention blocks are all cached (as after a restart: the SSD tier has
    them) but checkpoints sit at a few boundaries, or none: the lookup must not walk
    down every block boundary with a hash and a `stat`."""
    cache = hybrid_cache(tmp_path)
    tokens = prompt(32 * 1024)
    hashes = extend_block_hashes([], ROOT, tokens, BLOCK)
    usable = (len(tokens) - 1) // BLOCK
    blocks = cache.pool.allocate(usable)
    cache.pool.register(blocks, hashes[:usable])
    cache.pool.free(blocks)
    # Other chains' checkpoints, and this one's every 2048 tokens, on the SSD tier.
    refs = [CheckpointRef(extend_block_hashes([], ROOT, prompt(2048, salt=s), BLOCK)[-1], 2048) for s in range(1, 9)]
    refs += [CheckpointRef(hashes[b // BLOCK - 1], b) for b in range(2048, 2048 * (checkpoints + 1), 2048)]
    for ref in refs:
        cache.recurrent.index.add(ref)
        cache.connector.cache_checkpoint(Checkpoint(ref, states()))
    cache.connector.flush(30)
    counts = Counts(monkeypatch)
    hit = cache.lookup(tokens, ROOT, hashes=list(hashes))
    assert hit.num_blocks == checkpoints * 2048 // BLOCK  # the last checkpoint of this chain
    # At most a probe per known checkpoint: never one per boundary (2047 of them).
    assert counts.sha <= len(refs) and counts.stat <= len(refs)
    cache.connector.close()


def test_an_admission_hashes_its_prompt_once(tmp_path, monkeypatch):
    cache = hybrid_cache(tmp_path)
    tokens = prompt(4096)
    counts = Counts(monkeypatch)
    hit = cache.lookup(tokens, ROOT)
    cache.admit(0, tokens, ROOT, hit)
    assert counts.sha == len(tokens) // BLOCK  # each block once; the hit's hashes go to the sequence
    cache.connector.close()


def test_a_waiting_request_is_looked_up_again_only_when_the_cache_changed(llama_dir):
    engine = Engine.load(llama_dir, CacheConfig(block_size=BLOCK, num_blocks=12, memory_tier_bytes=0))
    loop, scheduler = engine.loop, engine.loop.scheduler
    long = engine.make_request([t % 500 + 3 for t in prompt(120, salt=3)], lambda r: None, max_tokens=60)
    waiting = engine.make_request([t % 500 + 3 for t in prompt(90, salt=4)], lambda r: None, max_tokens=4)
    loop.add(long)
    loop.step()
    loop.add(waiting)
    steps, generations = 0, set()
    while waiting.state.value == "waiting" and loop.has_work:
        generations.add(engine.coordinator.generation)
        loop.step()
        steps += 1
    assert steps > 10  # it waited while the first request decoded
    # One lookup for the first request, and one per change of the cache while the second waited.
    assert scheduler.lookups <= 1 + len(generations) < steps
    while loop.has_work:
        loop.step()
