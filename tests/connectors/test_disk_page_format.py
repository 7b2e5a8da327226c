"""The SSD tier and pages of one format (cache/page_format.py): K and V apart, each run checked
against the page format, and a tier of no page layers (a model of states alone) for checkpoints."""

from __future__ import annotations

from pathlib import Path

import mlxkv  # noqa: F401  (before mlx: it loads OpenBLAS)
import mlx.core as mx
import numpy as np
import safetensors.numpy

from mlxkv.cache.block_kv import BlockKV
from mlxkv.cache.checkpoints import Checkpoint, CheckpointRef
from mlxkv.cache.hashing import hash_block, root_hash
from mlxkv.connectors.disk.connector import DiskKVCacheConnector

FP = root_hash(b"\x03" * 32, "pages")
PAGE = (2, 16, 1, 8)  # K: 2 unit heads of 16; V: 1 of 8 (a latent and its rotary part)


def chain(n: int) -> list[bytes]:
    hashes, parent = [], root_hash(FP)
    for i in range(n):
        parent = hash_block(parent, [i] * 4)
        hashes.append(parent)
    return hashes


def kv(seed: int) -> BlockKV:
    rng = np.random.default_rng(seed)
    return BlockKV(mx.array(rng.standard_normal((3, 2, 4, 16)).astype(np.float32)),
                   mx.array(rng.standard_normal((3, 1, 4, 8)).astype(np.float32)))


def open_disk(directory, num_layers=3, page=PAGE) -> DiskKVCacheConnector:
    return DiskKVCacheConnector(directory, FP, block_size=4, num_layers=num_layers, dtype="float32",
                                min_free_bytes=0, page=page)


def test_pages_whose_k_and_v_differ_in_heads_round_trip(tmp_path):
    hashes, blocks = chain(3), [kv(i) for i in range(3)]
    with open_disk(tmp_path) as disk:
        disk.cache_blocks(hashes, lambda: blocks)
        assert disk.flush(timeout=30)
        loaded = disk.load_blocks(hashes)
    assert len(loaded) == 3
    for block, want in zip(loaded, blocks):
        assert mx.array_equal(block.kv.keys, want.keys).item() and mx.array_equal(block.kv.values, want.values).item()


def test_a_run_of_another_page_format_is_corrupt_not_served(tmp_path):
    hashes = chain(2)
    with open_disk(tmp_path) as disk:
        disk.cache_blocks(hashes, lambda: [kv(0), kv(1)])
        assert disk.flush(timeout=30)
    (f,) = Path(tmp_path).glob("*/*/*.safetensors")
    assert safetensors.numpy.load_file(str(f))["values"].shape == (3, 2, 1, 4, 8)  # [layers, blocks, heads, ...]
    with open_disk(tmp_path, page=(1, 32, 1, 8)) as disk:  # the same fingerprint, pages of another shape
        assert disk.load_blocks(hashes) == []
        assert disk.stats()["disk"]["corrupt"] == 1


def test_a_tier_of_no_page_layers_keeps_checkpoints(tmp_path):
    """A model of states alone (Mamba): its SSD tier holds checkpoints and no blocks."""
    ref = CheckpointRef(chain(1)[0], 4)
    checkpoint = Checkpoint(ref, ((mx.ones((1, 3)), mx.zeros((1, 2, 2))),))
    with open_disk(tmp_path, num_layers=0, page=None) as disk:
        disk.cache_checkpoint(checkpoint)
        assert disk.flush(timeout=30)
    with open_disk(tmp_path, num_layers=0, page=None) as disk:
        assert [r.boundary for r in disk.checkpoint_refs()] == [4]
        cancelled = disk.begin_checkpoint_load(checkpoint.key)
        cancelled.run()  # staged on the loader thread, then its request went away: never taken
        assert cancelled.staged and disk.stats()["disk"]["hydrations"] == 0
        loaded = disk.load_checkpoint(checkpoint.key)
        assert disk.stats()["disk"]["hydrations"] == 1
    assert loaded is not None and loaded.states[0][0].tolist() == [[1.0, 1.0, 1.0]]
