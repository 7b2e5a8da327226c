"""The SSD tier through the real engine and CLI: restart, faults, sharing.

Every case ends the same way: the output equals a cold run, the process
keeps going, and the fault shows in the counters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faults import remount_read_only, rewrite
from mlxkv.cli import main as cli_main
from mlxkv.config import CacheConfig
from mlxkv.connectors.disk.cache_dir import cache_info
from mlxkv.connectors.disk.connector import DiskKVCacheConnector
from mlxkv.connectors.disk.writer import RunWriter
from mlxkv.connectors.memory import InMemoryKVCacheConnector
from mlxkv.connectors.tiered import TieredKVCacheConnector
from mlxkv.engine.engine import Engine
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model

pytestmark = pytest.mark.slow  # real processes, restarts and faults

BLOCK = 4
PROMPT = "the ships sail on the sea and the wind is strong and cold tonight"


def tokens(n, start=1):
    return [(start + 17 * i) % 300 + 3 for i in range(n)]


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "mlxkv.cli", *args], capture_output=True, text=True, timeout=300, **kw)


def generate_json(model, disk, *extra):
    out = cli("generate", "--model", model, "--raw", "--json", "--max-tokens", "6", "--block-size", str(BLOCK),
              "--disk-tier", str(disk), "--prompt", PROMPT, *extra)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def block_files(directory) -> list[Path]:
    return sorted(Path(directory).rglob("*.safetensors"))


def disk_engine(model, disk, **fields):
    return Engine.load(model, CacheConfig(block_size=BLOCK, num_blocks=64, disk_tier=str(disk), **fields))


@pytest.fixture(scope="module")
def cold(model_dirs):
    """Tokens of a run with no tiers at all, per prompt."""
    engine = Engine.load(model_dirs["llama"], CacheConfig(block_size=BLOCK, num_blocks=64, memory_tier_bytes=0))
    return lambda prompt: engine.generate(prompt, max_tokens=6).tokens


def test_restart_reuses_the_prefix_from_disk(llama_dir, tmp_path):
    first = generate_json(llama_dir, tmp_path / "kv")
    second = generate_json(llama_dir, tmp_path / "kv")
    assert first["cached_tokens"]["disk"] == 0
    assert second["cached_tokens"]["disk"] > 0
    assert second["tokens"] == first["tokens"]
    assert second["connector"]["disk"]["hydrations"] > 0


def test_a_reply_comes_back_from_disk_after_a_restart(llama_dir, tmp_path, cold):
    """Decode offers its blocks in batches (cache/coordinator.py); all of them must land."""
    prompt = tokens(9, 7)
    with disk_engine(llama_dir, tmp_path / "kv", memory_tier_bytes=0) as engine:
        reply = engine.generate(prompt, max_tokens=100).tokens
    follow_up = prompt + reply + tokens(5, 8)
    with disk_engine(llama_dir, tmp_path / "kv", memory_tier_bytes=0) as engine:
        again = engine.generate(follow_up, max_tokens=6)
    written = (len(prompt) + len(reply) - 1) // BLOCK * BLOCK  # the last token's KV was never computed
    assert written > 100 and again.stats.cached_tokens["disk"] == written
    assert again.tokens == cold(follow_up)


def test_other_weights_same_architecture_get_no_disk_hits(llama_dir, tmp_path):
    other = write_tiny_model(tmp_path / "other", TinyModelSpec(family="llama", seed=99))
    generate_json(llama_dir, tmp_path / "kv")
    row = generate_json(str(other), tmp_path / "kv")
    assert row["cached_tokens"]["disk"] == 0


def _fill_disk(model, disk, prompt):
    with disk_engine(model, disk, memory_tier_bytes=0) as engine:
        engine.generate(prompt, max_tokens=6)
    return block_files(disk)


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


def _flip_bit(path):
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # inside the tensor bytes, which come last
    path.write_bytes(bytes(data))


def _other_version(path):
    rewrite(path, meta_changes={"format_version": "999"})


@pytest.mark.parametrize("damage", [_truncate, _flip_bit, _other_version])
def test_damaged_block_files_fall_back_to_recompute(llama_dir, tmp_path, cold, damage):
    prompt = tokens(24)
    files = _fill_disk(llama_dir, tmp_path / "kv", prompt)
    assert cache_info(tmp_path / "kv")["blocks"] >= 4 and len(files) >= 2  # runs and single blocks
    for path in files:
        damage(path)
    with disk_engine(llama_dir, tmp_path / "kv", memory_tier_bytes=0) as engine:
        result = engine.generate(prompt, max_tokens=6)
        stats = engine.stats()["connector"]["disk"]
        assert result.tokens == cold(prompt)
        assert stats["corrupt"] >= 1
        assert engine.generate(tokens(10, 5), max_tokens=3).tokens  # still working


SPILLER = """
import sys
import mlxkv
from mlxkv.cli import main as cli_main
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
engine = Engine.load(sys.argv[1], CacheConfig(block_size=4, num_blocks=64, disk_tier=sys.argv[2], memory_tier_bytes=0))
print("ready", flush=True)
for start in range(1000):
    engine.generate([(start * 31 + 17 * i) % 300 + 3 for i in range(40)], max_tokens=2)
"""


def test_sigkill_mid_spill_then_restart(llama_dir, tmp_path, cold):
    disk = tmp_path / "kv"
    child = subprocess.Popen([sys.executable, "-c", SPILLER, llama_dir, str(disk)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    deadline = time.time() + 60
    while len(block_files(disk)) < 40 and time.time() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert len(block_files(disk)) >= 40
    with disk_engine(llama_dir, disk, memory_tier_bytes=0) as engine:
        for start in range(4):  # prompts the child wrote
            prompt = [(start * 31 + 17 * i) % 300 + 3 for i in range(40)]
            assert engine.generate(prompt, max_tokens=2).tokens == cold(prompt)[:2]
        assert engine.stats()["connector"]["disk"]["corrupt"] == 0
    assert not list(disk.rglob("*.tmp"))


def test_disk_filling_up_during_spills(llama_dir, tmpfs, cold):
    mount = tmpfs("160k")  # room for a few block files only
    probe = Engine.load(llama_dir, CacheConfig(block_size=BLOCK, num_blocks=16, memory_tier_bytes=0))
    disk = DiskKVCacheConnector(mount / "kv", probe.fingerprint, block_size=BLOCK,
                                num_layers=probe.kv_layout.num_layers, dtype="float32", min_free_bytes=0)
    engine = Engine.load(llama_dir, CacheConfig(block_size=BLOCK, num_blocks=16,
                                                connector=TieredKVCacheConnector(disk, 1 << 20, BLOCK)))
    for start in range(12):
        prompt = tokens(30, start)
        assert engine.generate(prompt, max_tokens=6).tokens == cold(prompt)
    engine.close()
    assert engine.stats()["connector"]["disk"]["write_errors"] > 0
    assert not list(mount.rglob("*.tmp"))


def test_read_only_cache_directory(llama_dir, tmp_path, tmpfs, cold):
    mount = tmpfs("2g")  # above the tier's free-space floor; tmpfs takes only what is used
    _fill_disk(llama_dir, mount / "kv", tokens(24))
    remount_read_only(mount)
    with pytest.warns(Warning):
        engine = disk_engine(llama_dir, mount / "kv", memory_tier_bytes=0)
    with engine:
        for prompt in (tokens(24), tokens(24, 7)):
            assert engine.generate(prompt, max_tokens=6).tokens == cold(prompt)
        assert engine.stats()["connector"]["disk"]["hydrations"] > 0  # reads still work


def test_two_processes_share_one_disk_tier(llama_dir, tmp_path):
    disk = tmp_path / "kv"
    args = ["generate", "--model", llama_dir, "--raw", "--json", "--max-tokens", "4", "--block-size", str(BLOCK),
            "--num-blocks", "24", "--disk-tier", str(disk)]
    prompts = [f"{PROMPT} number {i} " * 2 for i in range(6)]
    procs = [subprocess.Popen([sys.executable, "-m", "mlxkv.cli", *args, *sum([["--prompt", p] for p in prompts], [])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    rows = [[json.loads(line) for line in out.splitlines()] for out, _ in outs]
    assert [r["tokens"] for r in rows[0]] == [r["tokens"] for r in rows[1]]
    assert all(r["connector"]["disk"]["corrupt"] == 0 for rs in rows for r in rs)
    after = generate_json(llama_dir, disk)
    assert after["connector"]["disk"]["corrupt"] == 0


def test_cache_info_and_clear_commands(llama_dir, tmp_path):
    disk = tmp_path / "kv"
    generate_json(llama_dir, disk)
    info = cli("cache", "info", "--disk-tier", str(disk))
    assert info.returncode == 0, info.stderr
    shown = json.loads(info.stdout)
    assert shown["files"] == len(block_files(disk)) > 0 and shown["blocks"] >= shown["files"]
    cleared = cli("cache", "clear", "--disk-tier", str(disk))
    assert cleared.returncode == 0 and f"removed {len(block_files(disk)) or ''}" in cleared.stdout
    assert block_files(disk) == []
    again = generate_json(llama_dir, disk)
    assert again["cached_tokens"]["disk"] == 0


def test_cache_clear_refuses_a_directory_that_is_not_a_cache(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    out = cli("cache", "clear", "--disk-tier", str(tmp_path))
    assert (tmp_path / "precious.txt").exists()
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_tier_flags_turn_tiers_off(llama_dir, tmp_path):
    row = generate_json(llama_dir, tmp_path / "kv", "--memory-tier-mb", "0", "--no-disk-tier")
    assert row["connector"] == {}


def test_a_json_row_counts_its_own_disk_stores(llama_dir, tmp_path, monkeypatch, capsys):
    # The writer runs in the background; a slow disk must not leave a row
    # saying fewer blocks were stored than its prompt wrote.
    write = RunWriter._write

    def slow_write(self, job):
        time.sleep(0.2)
        write(self, job)

    monkeypatch.setattr(RunWriter, "_write", slow_write)
    disk = tmp_path / "kv"
    assert cli_main(["generate", "--model", llama_dir, "--raw", "--json", "--max-tokens", "2",
                     "--block-size", str(BLOCK), "--disk-tier", str(disk), "--prompt", PROMPT]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert row["connector"]["disk"]["stores"] == cache_info(disk)["blocks"] > 0
