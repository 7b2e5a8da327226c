"""The SSD tier's health, on real small file systems (tmpfs): a disk full of other data, out of
inodes, full at start, small. Every request succeeds with the cold output, the state says what is
wrong, and one warning line says why."""

from __future__ import annotations

import json
import logging

import mlx.core as mx
import pytest

from faults import fill_disk, remount_read_only, use_up_inodes
from mlxkv.cli import main as cli_main
from mlxkv.cache.block_kv import KVRun
from mlxkv.config import CacheConfig
from mlxkv.connectors.disk.cache_dir import cache_info
from mlxkv.connectors.disk.connector import DiskCacheWarning, DiskKVCacheConnector
from mlxkv.connectors.doctor import disk_report, tier_lines
from mlxkv.engine.engine import Engine

BLOCK = 4
HEALTH_LOG = "mlxkv.connectors.health"


def tokens(n, start=1):
    return [(start + 17 * i) % 300 + 3 for i in range(n)]


PROMPTS = [tokens(33, s) for s in (1, 2, 3)]


@pytest.fixture(scope="module")
def cold(model_dirs):
    engine = Engine.load(model_dirs["llama"], CacheConfig(block_size=BLOCK, num_blocks=64, memory_tier_bytes=0))
    return lambda prompt: engine.generate(prompt, max_tokens=6).tokens


def disk_engine(model, directory, **fields) -> Engine:
    return Engine.load(model, CacheConfig(block_size=BLOCK, num_blocks=64, memory_tier_bytes=0,
                                          disk_tier=str(directory), **fields))


def open_disk(directory) -> DiskKVCacheConnector:
    return DiskKVCacheConnector(directory, b"\x05" * 32, block_size=BLOCK, num_layers=2, dtype="float32")


def health_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == HEALTH_LOG]


def serve_all(engine, cold) -> dict:
    for prompt in PROMPTS:
        assert engine.generate(prompt, max_tokens=6).tokens == cold(prompt)
    engine.connector.flush(30)
    return engine.stats()["connector"]["disk"]


def test_a_disk_full_of_other_data_drops_writes_and_says_why_once(tmpfs, llama_dir, cold, caplog):
    mnt = tmpfs("2m")
    with disk_engine(llama_dir, mnt / "kv") as engine:
        ballast = fill_disk(mnt)
        disk = serve_all(engine, cold)
        assert disk["state"] == "dropping-writes" and "under the floor" in disk["reason"]
        assert disk["stores"] == 0 and disk["write_errors"] > 1 and disk["low_space_skips"] == disk["write_errors"]
        [line] = health_lines(caplog)
        assert line.startswith("SSD tier dropping writes:") and "no file left to delete" in line
        ballast.unlink()  # room again: the next write works, and the tier says so
        engine.connector.tier_health.hold_s = 0
        assert engine.generate(tokens(21, 7), max_tokens=6).tokens == cold(tokens(21, 7))
        engine.connector.flush(30)
        assert engine.stats()["connector"]["disk"]["state"] == "ok"
    assert health_lines(caplog)[1].startswith("SSD tier ok again (was dropping-writes")


def test_out_of_inodes_drops_writes_and_says_so_once(tmpfs, llama_dir, cold, caplog):
    mnt = tmpfs("4m", inodes=64)
    with disk_engine(llama_dir, mnt / "kv") as engine:
        use_up_inodes(mnt)
        disk = serve_all(engine, cold)
    assert disk["state"] == "dropping-writes" and "out of inodes" in disk["reason"]
    assert disk["stores"] == 0 and disk["write_errors"] > 1
    [line] = health_lines(caplog)
    assert "SSD tier dropping writes: out of inodes" in line


@pytest.mark.parametrize("restart", [True, False])
def test_out_of_inodes_at_start_is_dropping_writes_not_read_only_and_recovers(tmpfs, restart):
    """Restarted on a full disk (its directory there), or started on one (none yet)."""
    mnt = tmpfs("4m", inodes=64)
    if restart:
        open_disk(mnt / "kv").close()
    ballast = use_up_inodes(mnt)
    with pytest.warns(DiskCacheWarning, match="SSD tier dropping writes: out of inodes"):
        disk = open_disk(mnt / "kv")
    assert not disk.health()["read_only"] and disk.stats()["disk"]["state"] == "dropping-writes"
    for path in ballast[:16]:
        path.unlink()
    disk.tier_health.hold_s = 0
    hashes = [bytes([i]) * 32 for i in range(2)]
    kvs = KVRun(mx.zeros((2, 2, 2, BLOCK, 8)), mx.ones((2, 2, 2, BLOCK, 8))).blocks()
    disk.cache_blocks(hashes, lambda: kvs)
    assert disk.flush(timeout=30)
    assert disk.stats()["disk"]["state"] == "ok" and disk.stats()["disk"]["stores"] == 2
    assert [b.block_hash for b in disk.load_blocks(hashes)] == hashes
    disk.close()


def test_a_read_only_disk_at_start_shows_as_read_only(tmpfs):
    mnt = tmpfs("1m")
    open_disk(mnt / "kv").close()
    remount_read_only(mnt)
    with pytest.warns(DiskCacheWarning, match="SSD tier read-only"):
        disk = open_disk(mnt / "kv")
    stats = disk.stats()["disk"]
    assert stats["state"] == "read-only" and "Read-only file system" in stats["reason"]
    disk.close()


def test_a_small_disk_gets_a_floor_scaled_to_it_and_files(tmpfs, llama_dir, cold, caplog):
    """A 20 MB disk: a 1 MiB floor (5%), not 1 GiB, so the tier writes."""
    mnt = tmpfs("20m")
    with disk_engine(llama_dir, mnt / "kv") as engine:
        assert engine.connector.min_free_bytes == (20 << 20) // 20
        disk = serve_all(engine, cold)
    assert disk["state"] == "ok" and disk["stores"] > 0 and health_lines(caplog) == []
    with disk_engine(llama_dir, mnt / "kv", disk_tier_min_free_bytes=0) as engine:
        assert engine.connector.min_free_bytes == 0


def test_cache_info_verify_counts_the_corrupt_files(tmp_path, llama_dir, capsys):
    with disk_engine(llama_dir, tmp_path / "kv") as engine:
        engine.generate(tokens(33), max_tokens=6)
    files = sorted((tmp_path / "kv").rglob("*.safetensors"))
    data = bytearray(files[0].read_bytes())
    data[-2] ^= 0x01
    files[0].write_bytes(bytes(data))
    info = cache_info(tmp_path / "kv", verify=True)
    assert info["verified"] == len(files) > 1 and info["corrupt"] == 1
    assert info["corrupt_files"] == [f"{files[0]}: checksum mismatch"]
    assert "corrupt" not in cache_info(tmp_path / "kv")  # without --verify, no file is read
    assert cli_main(["cache", "info", "--disk-tier", str(tmp_path / "kv"), "--verify"]) == 0
    assert json.loads(capsys.readouterr().out)["corrupt"] == 1


def test_doctor_says_what_state_the_ssd_tier_would_open_in(tmpfs, tmp_path):
    assert disk_report(str(tmp_path / "kv"))["state"] == "ok"
    mnt = tmpfs("1m")
    remount_read_only(mnt)
    report = disk_report(str(mnt / "kv"))
    assert report["state"] == "read-only"
    assert tier_lines({"disk": report})[0][1].startswith("read-only:")


def test_stats_and_logs_of_a_state_change_are_one_line_each(tmp_path, caplog):
    from mlxkv.connectors.health import DROPPING, TierHealth

    now = [0.0]
    health = TierHealth("SSD tier", hold_s=5, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            health.trouble(DROPPING, "disk full")
            health.fine()  # a write that worked right after: not yet ok
        now[0] = 4.0
        health.fine()
        now[0] = 9.0
        health.fine()
    assert health_lines(caplog) == ["SSD tier dropping writes: disk full",
                                    "SSD tier ok again (was dropping-writes: disk full)"]
    assert health.as_dict() == {"state": "ok", "reason": None} and health.changes == 2
