"""The SSD tier: round trips, visibility, restart, faults, budget, sharing.

Synthetic KV with small shapes; no model. Fault tests that need a real
filesystem condition (a full disk, a read-only mount) mount a small tmpfs and
skip with the reason when that is not permitted. Child processes run this
file as a script (see the bottom) so they share its data generator.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import mlxkv  # noqa: F401  (before mlx: it loads OpenBLAS)
import mlx.core as mx
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from block_chains import block_chain
from mlxkv.cache.block_kv import BlockKV
from mlxkv.connectors.disk.cache_dir import STALE_TEMP_SECONDS, cache_clear, cache_info
from mlxkv.connectors.disk.connector import DiskCacheWarning, DiskKVCacheConnector
from mlxkv.connectors.disk.file_io import LinuxIO
from mlxkv.connectors.disk.run_file import FORMAT_VERSION, MAX_RUN_BLOCKS
from mlxkv.connectors.disk.read_buffer import HUGE_PAGE, ReadBuffer, huge_pages_available
from mlxkv.errors import MlxkvError
from mlxkv.cache.hashing import root_hash

from faults import remount_read_only, rewrite

# This file runs itself as a child process; the helpers it imports live in tests/.
CHILD_ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

FP = root_hash(b"\x01" * 32, "fingerprint-a")
FP_OTHER = root_hash(b"\x02" * 32, "fingerprint-b")
LAYERS, HEADS, BS, HEAD_DIM = 2, 2, 4, 8
MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
BITS = {"float32": mx.uint32, "float16": mx.uint16, "bfloat16": mx.uint16}


# -- helpers -----------------------------------------------------------------


def chain(n: int, salt: str = "") -> list[bytes]:
    return block_chain(FP, BS, n, salt)


def make_kv(seed: int, dtype: str = "float32", heads: int = HEADS, head_dim: int = HEAD_DIM) -> BlockKV:
    """Deterministic K/V for `seed`, with a few awkward values (NaN, inf, -0)."""
    rng = np.random.default_rng(seed)
    shape = (LAYERS, heads, BS, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k.reshape(-1)[:3] = [np.nan, np.inf, -0.0]
    return BlockKV(mx.array(k).astype(MX_DTYPES[dtype]), mx.array(v).astype(MX_DTYPES[dtype]))


def same_bits(a: BlockKV, b: BlockKV) -> bool:
    if a.keys.dtype != b.keys.dtype or a.values.dtype != b.values.dtype:
        return False
    bits = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16}[a.keys.dtype]
    return all(
        x.shape == y.shape and mx.array_equal(x.view(bits), y.view(bits)).item()
        for x, y in ((a.keys, b.keys), (a.values, b.values))
    )


def open_disk(directory, fingerprint=FP, dtype="float32", **kw) -> DiskKVCacheConnector:
    kw.setdefault("min_free_bytes", 0)
    return DiskKVCacheConnector(
        directory, fingerprint, block_size=BS, num_layers=LAYERS, dtype=dtype, **kw
    )


def block_files(directory) -> list[Path]:
    return sorted(Path(directory).glob("*/*/*.safetensors"))


def temp_files(directory) -> list[Path]:
    return sorted(Path(directory).glob("**/*.tmp"))


def fill(conn, hashes, dtype="float32", start=0):
    for i, h in enumerate(hashes):
        assert conn.store(h, make_kv(start + i, dtype))
    assert conn.flush(timeout=30)


def disk_stats(conn) -> dict[str, int]:
    return conn.stats()["disk"]


# -- round trips and visibility ----------------------------------------------


def test_a_file_says_which_layer_group_its_blocks_belong_to(tmp_path):
    hashes = chain(5)
    with open_disk(tmp_path) as disk:
        kvs = [make_kv(i) for i in range(5)]
        for kv, group in zip(kvs, [0, 0, 2, 2, 2]):
            kv.group = group
        disk.cache_blocks(hashes, lambda: kvs)  # one call, split into a run per group
        assert disk.flush(timeout=30)
        assert [b.kv.group for b in disk.load_blocks(hashes)] == [0, 0, 2, 2, 2]
    groups = sorted(safetensors.safe_open(str(f), "np").metadata()["group"] for f in block_files(tmp_path))
    assert groups == ["0", "2"]


def test_a_file_written_before_groups_holds_group_0(tmp_path):
    hashes = chain(2)
    with open_disk(tmp_path) as disk:
        fill(disk, hashes)
    for f in block_files(tmp_path):
        tensors, meta = safetensors.numpy.load_file(str(f)), safetensors.safe_open(str(f), "np").metadata()
        del meta["group"]
        f.write_bytes(safetensors.numpy.save(tensors, metadata=meta))
    with open_disk(tmp_path) as disk:
        loaded = disk.load_blocks(hashes)
        assert [b.kv.group for b in loaded] == [0, 0] and disk_stats(disk)["corrupt"] == 0


def test_a_run_of_two_groups_is_refused(tmp_path):
    kvs = [make_kv(0), make_kv(1)]
    kvs[1].group = 1
    with open_disk(tmp_path) as disk, pytest.raises(ValueError, match="one layer group"):
        disk.store_run(chain(2), kvs)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    hashes = chain(3)
    with open_disk(tmp_path, dtype=dtype) as disk:
        fill(disk, hashes, dtype)
        assert disk.get_computed_blocks(hashes + chain(1, "other")) == 3
        loaded = disk.load_blocks(hashes)
        assert [b.block_hash for b in loaded] == hashes
        assert all(b.tier == "disk" for b in loaded)
        for i, block in enumerate(loaded):
            assert same_bits(block.kv, make_kv(i, dtype))
        s = disk_stats(disk)
    assert s["stores"] == 3 and s["hydrations"] == 3 and s["blocks_held"] == 3
    assert s["lookups"] == 1 and s["hit_blocks"] == 3 and s["hit_tokens"] == 3 * BS
    assert s["bytes_held"] == sum(p.stat().st_size for p in block_files(tmp_path))
    assert s["corrupt"] == s["write_errors"] == 0


def test_file_is_self_describing(tmp_path):
    hashes = chain(3)
    with open_disk(tmp_path, dtype="bfloat16") as disk:
        disk.cache_blocks(hashes, lambda: [make_kv(i, "bfloat16") for i in range(3)])
        disk.flush()
    [path] = block_files(tmp_path)  # one run, named after its last block
    h = hashes[-1]
    assert path.name == f"{h.hex()}.safetensors"
    assert path.parent.name == h.hex()[:2] and path.parent.parent.name == FP.hex()
    data = path.read_bytes()
    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    assert meta["fingerprint"] == FP.hex() and meta["block_hashes"] == ",".join(x.hex() for x in hashes)
    assert meta["dtype"] == "bfloat16" and meta["block_size"] == str(BS)
    assert meta["num_layers"] == str(LAYERS) and meta["format_version"] == FORMAT_VERSION
    tensors = safetensors.numpy.load(data)
    keys = tensors["keys"]
    assert meta["checksum_algo"] == "xxh3_64"
    assert meta["checksum"] == xxhash.xxh3_64(keys.tobytes() + tensors["values"].tobytes()).hexdigest()
    assert keys.dtype == np.uint16  # raw bf16 bits
    assert keys.shape == (LAYERS, 3, HEADS, BS, HEAD_DIM)  # layer-major: a layer's run is contiguous


def test_write_is_invisible_until_it_completes(tmp_path):
    h = chain(1)[0]
    release = threading.Event()
    disk = open_disk(tmp_path)
    real_write = disk.writer.write_atomic

    def slow_write(path, data):
        release.wait(10)
        real_write(path, data)

    disk.writer.write_atomic = slow_write
    assert disk.store(h, make_kv(0))
    assert disk.health()["pending_writes"] == 1 and not disk.contains(h)
    assert disk.get_computed_blocks([h]) == 0
    assert disk.load_blocks([h]) == []
    assert not disk.store(h, make_kv(0))  # already queued: no second write
    release.set()
    assert disk.flush(timeout=10)
    assert disk.contains(h) and disk.get_computed_blocks([h]) == 1
    disk.close()


def test_close_drains_the_queue(tmp_path):
    hashes = chain(20)
    disk = open_disk(tmp_path)
    for i, h in enumerate(hashes):
        disk.store(h, make_kv(i))
    disk.close()
    assert disk_stats(disk)["stores"] == 20 and len(block_files(tmp_path)) == 20
    assert not disk.store(chain(1, "late")[0], make_kv(0))  # closed: dropped, no error
    assert disk.health()["dropped_writes"] == 1


def test_full_queue_drops_writes_instead_of_blocking(tmp_path):
    release = threading.Event()
    one_block = make_kv(0).nbytes
    disk = open_disk(tmp_path, max_pending_bytes=2 * one_block)
    real_write = disk.writer.write_atomic
    disk.writer.write_atomic = lambda path, data: (release.wait(10), real_write(path, data))
    hashes = chain(5)
    t0 = time.monotonic()
    accepted = [disk.store(h, make_kv(i)) for i, h in enumerate(hashes)]
    reads = []
    disk.evict_blocks([chain(1, "x")[0]], lambda: reads.append(1) or [make_kv(9)])
    assert time.monotonic() - t0 < 5
    assert accepted == [True, True, False, False, False]
    assert reads == []  # a full queue does not even read the bytes
    assert disk.health()["dropped_writes"] == 4
    release.set()
    disk.close()
    assert disk_stats(disk)["stores"] == 2


def test_cache_blocks_and_evict_blocks_read_only_what_they_need(tmp_path):
    hashes = chain(3)
    reads = []

    def reader(idx):
        return lambda: reads.append(idx) or [make_kv(i) for i in idx]

    with open_disk(tmp_path) as disk:
        disk.cache_blocks(hashes[:2], reader([0, 1]))
        disk.flush()
        disk.cache_blocks(hashes[:2], reader([0, 1]))  # all there: no read
        disk.evict_blocks([hashes[1]], reader([1]))  # there: no read
        disk.evict_blocks([hashes[2]], reader([2]))
        disk.flush()
        assert reads == [[0, 1], [2]]
        assert disk.get_computed_blocks(hashes) == 3
        assert same_bits(disk.load_blocks(hashes)[2].kv, make_kv(2))
        s = disk_stats(disk)
    assert s["stores"] == 3 and s["spills"] == 1


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(ValueError, match="fingerprint"):
        DiskKVCacheConnector(tmp_path, b"short", block_size=BS, num_layers=LAYERS, dtype="float32")
    with pytest.raises(ValueError, match="dtype"):
        DiskKVCacheConnector(tmp_path, FP, block_size=BS, num_layers=LAYERS, dtype="int8")
    with open_disk(tmp_path, dtype="float16") as disk:
        with pytest.raises(ValueError, match="float16"):
            disk.store(chain(1)[0], make_kv(0, "float32"))
        with pytest.raises(ValueError, match="shape"):
            wrong = mx.zeros((LAYERS, 2, BS + 1, 8), mx.float16)
            disk.store(chain(1)[0], BlockKV(wrong, wrong))
    assert open_disk(tmp_path, dtype=mx.float16).dtype == "float16"  # an mx dtype is fine too


# -- runs: one file per run of consecutive blocks -------------------------------


def write_runs(conn, hashes, start=0):
    """Blocks handed over together, as the engine registers a prefill's blocks."""
    conn.cache_blocks(hashes, lambda: [make_kv(start + i) for i in range(len(hashes))])
    assert conn.flush(timeout=30)


def path_of(directory, h) -> Path:
    return Path(directory) / FP.hex() / h.hex()[:2] / f"{h.hex()}.safetensors"


def test_a_prefill_is_written_as_runs_named_by_their_last_block(tmp_path):
    hashes = chain(MAX_RUN_BLOCKS + 3)
    with open_disk(tmp_path) as disk:
        write_runs(disk, hashes)
        assert block_files(tmp_path) == sorted([path_of(tmp_path, hashes[MAX_RUN_BLOCKS - 1]),
                                                path_of(tmp_path, hashes[-1])])
        s = disk_stats(disk)
        assert s["stores"] == s["blocks_held"] == len(hashes)
        assert disk.get_computed_blocks(hashes) == len(hashes)
        loaded = disk.load_blocks(hashes)
        assert [b.block_hash for b in loaded] == hashes
        assert all(same_bits(b.kv, make_kv(i)) for i, b in enumerate(loaded))
        assert loaded[0].kv.run is loaded[MAX_RUN_BLOCKS - 1].kv.run  # one file, one run


def test_a_file_is_a_small_share_of_the_budget(tmp_path):
    hashes = chain(8)
    with open_disk(tmp_path, budget_bytes=12 * make_kv(0).nbytes) as disk:
        write_runs(disk, hashes)
        assert len(block_files(tmp_path)) == 3  # 3 + 3 + 2 blocks: a file is at most a quarter
        assert disk.get_computed_blocks(hashes) == 8 and disk_stats(disk)["evictions"] == 0


@pytest.mark.parametrize("restart", [False, True])
def test_any_stretch_of_a_run_is_found(tmp_path, restart):
    hashes = chain(8)
    disk = open_disk(tmp_path)
    write_runs(disk, hashes)
    if restart:  # the index comes back from the headers
        disk.close()
        disk = open_disk(tmp_path)
        assert disk_stats(disk)["blocks_held"] == 8
    other = chain(2, "other")
    assert disk.get_computed_blocks(hashes[:3] + other) == 3  # a prompt sharing part of the run
    assert disk.get_computed_blocks(hashes[5:]) == 3  # the pool held the first five
    loaded = disk.load_blocks(hashes[5:])
    assert [b.block_hash for b in loaded] == hashes[5:]
    assert all(same_bits(b.kv, make_kv(5 + i)) for i, b in enumerate(loaded))
    assert [same_bits(b.kv, make_kv(i)) for i, b in enumerate(disk.load_blocks(hashes[:3]))] == [True] * 3
    disk.close()


def test_a_run_written_by_another_instance_is_found_without_restart(tmp_path):
    hashes = chain(6)
    reader = open_disk(tmp_path)
    with open_disk(tmp_path) as writer:
        write_runs(writer, hashes)
    # Found by its name (the last block's hash) when the lookup reaches it ...
    assert reader.get_computed_blocks(hashes) == 6
    assert disk_stats(reader)["blocks_held"] == 6
    # ... and from then on by any of its blocks, as its header lists them.
    assert all(same_bits(b.kv, make_kv(i)) for i, b in enumerate(reader.load_blocks(hashes[:4])))
    reader.close()


def test_part_of_a_run_written_by_another_instance_is_found_without_restart(tmp_path):
    hashes = chain(8)
    reader = open_disk(tmp_path)
    reader.scanner.rescan_interval = 3600  # one look, then none for an hour
    other = chain(2, "other")
    assert reader.get_computed_blocks(hashes[:3] + other) == 0  # the first miss looks: nothing yet
    with open_disk(tmp_path) as writer:
        write_runs(writer, hashes)
    # The prompt leaves the run before its last block, so the run's name
    # is never probed; only listing the changed shard finds it.
    assert reader.get_computed_blocks(hashes[:3] + other) == 0  # rate-limited: no second look yet
    reader.scanner.next_rescan = 0.0  # the hour has passed
    assert reader.get_computed_blocks(hashes[:3] + other) == 3
    assert [same_bits(b.kv, make_kv(i)) for i, b in enumerate(reader.load_blocks(hashes[:3]))] == [True] * 3
    assert disk_stats(reader)["blocks_held"] == 8
    reader.close()


@pytest.mark.parametrize("io", ["as the OS allows", "no huge pages", "no O_DIRECT", "no preadv"])
def test_every_read_path_is_bit_exact(tmp_path, monkeypatch, io):
    from mlxkv.connectors.disk import reader as disk_module, run_file

    views = []
    real_view = ReadBuffer.view
    monkeypatch.setattr(ReadBuffer, "view", lambda self, size: views.append(size) or real_view(self, size))
    if io == "no huge pages":  # THP off, or not Linux: O_DIRECT straight into MLX memory
        monkeypatch.setattr(disk_module, "huge_pages_available", lambda: False)
    if io == "no O_DIRECT":  # tmpfs: through the page cache, with prefetch after the first load
        monkeypatch.setattr(LinuxIO, "prepare", lambda self, fd, size: False)
    if io == "no preadv":  # older Pythons on macOS
        monkeypatch.setattr(LinuxIO, "prepare", lambda self, fd, size: False)
        monkeypatch.delattr(os, "preadv")
    hashes = chain(2 * MAX_RUN_BLOCKS + 3)
    with open_disk(tmp_path) as disk:
        write_runs(disk, hashes)
    with open_disk(tmp_path) as disk:
        for _ in range(2):
            loaded = disk.load_blocks(hashes)
            assert [b.block_hash for b in loaded] == hashes
            assert all(same_bits(b.kv, make_kv(i)) for i, b in enumerate(loaded))
        if io in ("no O_DIRECT", "no preadv"):
            assert disk.reader.direct_io is False
        staged = disk.reader.direct_io and disk.reader.huge_pages
        assert len(views) == (2 * 3 if staged else 0)  # 3 files, loaded twice
        assert disk_stats(disk)["corrupt"] == 0


def test_a_device_that_refuses_an_o_direct_read_is_read_through_the_cache(tmp_path, monkeypatch):
    from mlxkv.connectors.disk import run_file

    real_pread = run_file._pread_into

    def pread(fd, view, offset):  # open with O_DIRECT works; the read wants more alignment
        if hasattr(os, "O_DIRECT") and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pread(fd, view, offset)

    monkeypatch.setattr(run_file, "_pread_into", pread)
    hashes = chain(2 * MAX_RUN_BLOCKS + 3)
    with open_disk(tmp_path) as disk:
        write_runs(disk, hashes)
    with open_disk(tmp_path) as disk:
        loaded = disk.load_blocks(hashes)
        assert [b.block_hash for b in loaded] == hashes
        assert all(same_bits(b.kv, make_kv(i)) for i, b in enumerate(loaded))
        assert disk.reader.direct_io is False and disk_stats(disk)["corrupt"] == 0


def test_a_failed_buffer_allocation_raises_and_leaves_no_reader_waiting(tmp_path, monkeypatch):
    from mlxkv.connectors.disk.reader import READ_THREADS

    hashes = chain(READ_THREADS * MAX_RUN_BLOCKS)  # a file for every reader thread
    with open_disk(tmp_path) as disk:
        write_runs(disk, hashes)
        real_buffers = disk.reader.buffers
        monkeypatch.setattr(disk.reader, "buffers", lambda plan: (_ for _ in ()).throw(MemoryError("no room")))
        with pytest.raises(MemoryError):
            disk.load_blocks(hashes)
        monkeypatch.setattr(disk.reader, "buffers", real_buffers)
        done = []  # a reader still waiting for its buffer would hold up this load for ever

        def load():  # on its own thread, MLX arrays and all
            done.append([same_bits(b.kv, make_kv(i)) for i, b in enumerate(disk.load_blocks(hashes))])

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        loader.join(30)
        assert done, "a reader thread is stuck"
        assert done[0] == [True] * len(hashes)
        assert disk_stats(disk)["corrupt"] == 0


def test_a_read_buffer_starts_on_a_huge_page_grows_and_is_reused():
    buffer = ReadBuffer()
    small = buffer.view(5000)
    assert len(small) == 5000 and small.ctypes.data % HUGE_PAGE == 0
    small[:] = 7  # writable
    same = buffer.view(HUGE_PAGE)
    assert same.ctypes.data == small.ctypes.data
    grown = buffer.view(HUGE_PAGE + 1)
    assert len(grown) == HUGE_PAGE + 1 and grown.ctypes.data % HUGE_PAGE == 0
    grown[-1] = 1


def test_a_read_buffer_works_where_the_kernel_refuses_huge_pages(monkeypatch):
    from mlxkv.connectors.disk import read_buffer

    if not hasattr(read_buffer.mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE on this OS; the buffer is used only where it exists")
    monkeypatch.setattr(read_buffer.mmap, "MADV_HUGEPAGE", 12345)  # madvise fails with EINVAL
    view = ReadBuffer().view(3 * 4096)
    view[:] = 5
    assert int(view.sum()) == 5 * 3 * 4096


@pytest.mark.parametrize("setting, available", [
    ("always [madvise] never", True), ("[always] madvise never", True), ("always madvise [never]", False), (None, False),
])
def test_huge_pages_are_used_only_where_the_kernel_gives_them(tmp_path, monkeypatch, setting, available):
    from mlxkv.connectors.disk import read_buffer

    if not hasattr(read_buffer.mmap, "MADV_HUGEPAGE"):
        available = False  # macOS: never
    path = tmp_path / "enabled"
    if setting is not None:
        path.write_text(setting + "\n")
    monkeypatch.setattr(read_buffer, "THP_SETTING", path)
    assert huge_pages_available() is available


def test_a_corrupt_run_stops_the_load_at_its_first_block(tmp_path):
    hashes = chain(MAX_RUN_BLOCKS + 4)
    with open_disk(tmp_path) as disk:
        write_runs(disk, hashes)
    _flip_tensor_bit(path_of(tmp_path, hashes[-1]))
    with open_disk(tmp_path) as disk:
        loaded = disk.load_blocks(hashes)
        assert [b.block_hash for b in loaded] == hashes[:MAX_RUN_BLOCKS]
        s = disk_stats(disk)
        assert s["corrupt"] == 1 and s["blocks_held"] == MAX_RUN_BLOCKS
        assert disk.get_computed_blocks(hashes) == MAX_RUN_BLOCKS


def test_a_file_replaced_by_another_run_serves_only_what_its_header_lists(tmp_path):
    """Another process wrote a shorter run ending at the same block: same name."""
    hashes = chain(5)
    with open_disk(tmp_path) as disk:
        write_runs(disk, hashes)
        with open_disk(tmp_path / "elsewhere") as other:
            write_runs(other, hashes[3:], start=3)
        path_of(tmp_path / "elsewhere", hashes[-1]).replace(path_of(tmp_path, hashes[-1]))
        assert disk.get_computed_blocks(hashes) == 5  # the index still says five
        assert disk.load_blocks(hashes) == []  # block 0 is in no file now
        assert disk.get_computed_blocks(hashes) == 0 and disk.get_computed_blocks(hashes[3:]) == 2
        loaded = disk.load_blocks(hashes[3:])
        assert [same_bits(b.kv, make_kv(3 + i)) for i, b in enumerate(loaded)] == [True, True]
        assert disk_stats(disk)["corrupt"] == 0


# -- restart -----------------------------------------------------------------


def test_restart_finds_blocks_and_other_fingerprint_finds_none(tmp_path):
    hashes = chain(4)
    with open_disk(tmp_path) as disk:
        fill(disk, hashes)
    with open_disk(tmp_path) as again:
        assert disk_stats(again)["blocks_held"] == 4
        assert again.get_computed_blocks(hashes) == 4
        assert all(same_bits(b.kv, make_kv(i)) for i, b in enumerate(again.load_blocks(hashes)))
    with open_disk(tmp_path, fingerprint=FP_OTHER) as other:
        assert disk_stats(other)["blocks_held"] == 0
        assert other.get_computed_blocks(hashes) == 0 and other.load_blocks(hashes) == []


def test_blocks_written_by_another_instance_are_found_without_restart(tmp_path):
    hashes = chain(2)
    reader = open_disk(tmp_path)
    with open_disk(tmp_path) as writer:
        fill(writer, hashes)
    assert reader.get_computed_blocks(hashes) == 2
    assert len(reader.load_blocks(hashes)) == 2
    assert disk_stats(reader)["blocks_held"] == 2
    reader.close()


def test_stale_temp_files_are_removed_on_start(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    fp_dir = tmp_path / FP.hex() / "ab"
    fp_dir.mkdir(parents=True)
    name = "ab" * 32
    stale = fp_dir / f".{name}.{dead.pid}.0123abcd.tmp"
    mine = fp_dir / f".{name}.{os.getpid()}.0123abcd.tmp"  # a live writer's
    stuck = fp_dir / f".{name}.{os.getpid()}.4567cdef.tmp"  # a live pid's, but untouched for hours
    other = fp_dir / "notes.txt"
    for p in (stale, mine, stuck, other):
        p.write_bytes(b"partial")
    hours_ago = time.time() - 2 * STALE_TEMP_SECONDS
    os.utime(stuck, (hours_ago, hours_ago))
    with open_disk(tmp_path) as disk:
        assert disk_stats(disk)["blocks_held"] == 0
    assert not stale.exists() and not stuck.exists() and mine.exists() and other.exists()


# -- faults: corrupt files -------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])


def _flip_tensor_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10  # inside the values tensor
    path.write_bytes(bytes(data))


def _flip_header_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated": _truncate,
    "emptied": lambda p: p.write_bytes(b""),
    "tensor bit flip": _flip_tensor_bit,
    "header bit flip": _flip_header_bit,
    "other format version": lambda p: rewrite(p, meta_changes={"format_version": "999"}),
    "other fingerprint": lambda p: rewrite(p, meta_changes={"fingerprint": FP_OTHER.hex()}),
    "other block hash": lambda p: rewrite(p, meta_changes={"block_hashes": "00" * 32}),
    "other block size": lambda p: rewrite(p, meta_changes={"block_size": str(BS * 2)}),
    "other dtype": lambda p: rewrite(p, meta_changes={"dtype": "float16"}),
    "wrong shape": lambda p: rewrite(
        p, tensors={name: np.zeros((LAYERS, 1, HEADS, BS, 4), np.float32) for name in ("keys", "values")}
    ),
    "no checksum": lambda p: rewrite(p, meta_changes={"checksum": ""}),
    "unknown checksum algorithm": lambda p: rewrite(p, meta_changes={"checksum_algo": "md5"}),
    "CRC-32 file, tensor bit flip": lambda p: (_as_crc32_file(p), _flip_tensor_bit(p)),
}


def _as_crc32_file(path: Path) -> None:
    """Re-save a file as the previous release wrote it: checksummed with CRC-32."""
    tensors = safetensors.numpy.load(path.read_bytes())
    crc = zlib.crc32(tensors["values"].tobytes(), zlib.crc32(tensors["keys"].tobytes()))
    rewrite(path, meta_changes={"checksum_algo": "crc32", "checksum": f"{crc:08x}"})


def test_files_checksummed_with_crc32_are_still_read(tmp_path):
    hashes = chain(MAX_RUN_BLOCKS + 2)
    with open_disk(tmp_path) as disk:
        write_runs(disk, hashes)
    for path in block_files(tmp_path):
        _as_crc32_file(path)
    with open_disk(tmp_path) as disk:
        loaded = disk.load_blocks(hashes)
        assert [b.block_hash for b in loaded] == hashes
        assert all(same_bits(b.kv, make_kv(i)) for i, b in enumerate(loaded))
        assert disk_stats(disk)["corrupt"] == 0


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_block_stops_the_load(tmp_path, corruption):
    hashes = chain(3)
    with open_disk(tmp_path) as disk:
        fill(disk, hashes)
    bad = tmp_path / FP.hex() / hashes[1].hex()[:2] / f"{hashes[1].hex()}.safetensors"
    CORRUPTIONS[corruption](bad)
    with open_disk(tmp_path) as disk:
        assert disk.get_computed_blocks(hashes) == 3  # the index trusts names
        loaded = disk.load_blocks(hashes)
        assert [b.block_hash for b in loaded] == hashes[:1]  # the leading good run
        assert same_bits(loaded[0].kv, make_kv(0))
        s = disk_stats(disk)
        assert s["corrupt"] == 1 and s["hydrations"] == 1 and s["blocks_held"] == 2
        assert not bad.exists() and not disk.contains(hashes[1])
        assert disk.get_computed_blocks(hashes) == 1
        # The process carries on: the block is recomputed and written again.
        disk.store(hashes[1], make_kv(1))
        disk.flush()
        assert [same_bits(b.kv, make_kv(i)) for i, b in enumerate(disk.load_blocks(hashes))] == [True] * 3


def test_a_file_deleted_behind_our_back_is_a_miss(tmp_path):
    hashes = chain(2)
    with open_disk(tmp_path) as disk:
        fill(disk, hashes)
        block_files(tmp_path)[0].unlink()
        block_files(tmp_path)[0].unlink()
        assert disk.load_blocks(hashes) == []
        assert disk.get_computed_blocks(hashes) == 0
        s = disk_stats(disk)
    # Only the first miss is noticed (the load stops there); the rest is lazy.
    assert s["corrupt"] == 0 and s["blocks_held"] == 1


def _spill_child(directory: str) -> None:
    """Spill block after block until killed."""
    disk = open_disk(directory, max_pending_bytes=1 << 20)
    hashes = chain(300)
    for i, h in enumerate(hashes):
        while not disk.store(h, make_kv(i, heads=8, head_dim=64)):
            time.sleep(0.001)  # queue full: wait for the writer (a test child may)
    time.sleep(60)


@pytest.mark.slow
def test_sigkill_mid_spill_serves_no_corrupt_block(tmp_path):
    child = subprocess.Popen([sys.executable, __file__, "spill", str(tmp_path)], env=CHILD_ENV)
    try:
        deadline = time.monotonic() + 20
        while len(block_files(tmp_path)) < 30 and time.monotonic() < deadline:
            time.sleep(0.01)
        while not temp_files(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.0005)  # aim the kill at a write in flight
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    written = len(block_files(tmp_path))
    assert written >= 30, "the child never got going"
    hashes = chain(300)
    with open_disk(tmp_path) as disk:
        assert temp_files(tmp_path) == []  # the dead child's are gone
        n = disk.get_computed_blocks(hashes)
        loaded = disk.load_blocks(hashes)
        assert n == len(loaded) == written  # written in order, no holes
        for i, block in enumerate(loaded):
            assert same_bits(block.kv, make_kv(i, heads=8, head_dim=64))
        assert disk_stats(disk)["corrupt"] == 0


# -- faults: full disk, read-only directory ---------------------------------------


def test_enospc_on_a_full_tmpfs(tmpfs):
    mnt = tmpfs("1m")
    big = dict(heads=4, head_dim=64)  # 16 KiB per block: 1 MiB holds about 60
    hashes = chain(100)
    with open_disk(mnt) as disk:
        for i, h in enumerate(hashes):
            disk.store(h, make_kv(i, **big))
        disk.flush(timeout=30)
        s = disk_stats(disk)
        assert s["write_errors"] > 0 and s["stores"] > 0
        assert s["stores"] + s["write_errors"] == 100
        assert "ENOSPC" in disk.health()["last_error"]
        assert temp_files(mnt) == []
        assert len(block_files(mnt)) == s["stores"] == s["blocks_held"]
        loaded = disk.load_blocks(hashes)
        assert len(loaded) == s["stores"]
        assert all(same_bits(b.kv, make_kv(i, **big)) for i, b in enumerate(loaded))
        assert disk_stats(disk)["corrupt"] == 0


def test_free_space_floor_on_a_small_tmpfs_keeps_the_newest_blocks(tmpfs):
    """The floor is kept as a budget is: the least recently used files make room, no write is lost."""
    mnt = tmpfs("1m")
    big = dict(heads=4, head_dim=64)
    hashes = chain(60)
    with open_disk(mnt, min_free_bytes=512 << 10) as disk:
        for i, h in enumerate(hashes):
            disk.store(h, make_kv(i, **big))
        disk.flush(timeout=30)
        s = disk_stats(disk)
        assert s["stores"] == 60 and s["write_errors"] == 0 and s["state"] == "ok"
        assert 0 < s["blocks_held"] < 60 and s["evictions"] == 60 - s["blocks_held"]
        assert disk.contains(hashes[-1]) and not disk.contains(hashes[0])
    assert os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize >= 512 << 10


def test_free_space_floor_skips_writes(tmp_path):
    with open_disk(tmp_path, min_free_bytes=1 << 62) as disk:
        for i, h in enumerate(chain(3)):
            disk.store(h, make_kv(i))
        disk.flush()
        s = disk_stats(disk)
        assert s["write_errors"] == 3 and s["stores"] == 0
        assert disk.health()["low_space_skips"] == 3
    assert block_files(tmp_path) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_injected_write_error_is_counted_and_cleaned_up(tmp_path, monkeypatch, code):
    hashes = chain(2)
    real_fsync = os.fsync

    def failing_fsync(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(code, os.strerror(code))
        real_fsync(fd)

    with open_disk(tmp_path) as disk:
        monkeypatch.setattr(os, "fsync", failing_fsync)
        disk.store(hashes[0], make_kv(0))
        disk.flush()
        monkeypatch.setattr(os, "fsync", real_fsync)
        assert disk_stats(disk)["write_errors"] == 1
        assert errno.errorcode[code] in disk.health()["last_error"]
        assert temp_files(tmp_path) == [] and block_files(tmp_path) == []
        assert disk.get_computed_blocks(hashes) == 0
        fill(disk, hashes)  # the writer lives on
        assert disk.get_computed_blocks(hashes) == 2


def _read_only_dir(tmp_path, tmpfs) -> tuple[Path, callable]:
    """A directory and a function making it read-only, for this user."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        return d, lambda: d.chmod(0o500)
    # root ignores permission bits: use a tmpfs remounted read-only instead
    d = tmpfs("4m")
    return d, lambda: remount_read_only(d)


def test_read_only_directory_serves_reads_and_skips_writes(tmp_path, tmpfs):
    directory, make_read_only = _read_only_dir(tmp_path, tmpfs)
    hashes = chain(3)
    with open_disk(directory) as disk:
        fill(disk, hashes[:2])
    make_read_only()
    with pytest.warns(DiskCacheWarning, match="read-only"):
        disk = open_disk(directory)
    assert disk.health()["read_only"] and not disk.health()["disabled"]
    assert disk.get_computed_blocks(hashes) == 2
    assert all(same_bits(b.kv, make_kv(i)) for i, b in enumerate(disk.load_blocks(hashes)))
    assert disk.store(hashes[2], make_kv(2)) is False
    disk.evict_blocks([hashes[2]], lambda: pytest.fail("a read-only tier must not read"))
    disk.close()
    assert disk_stats(disk)["write_errors"] == 0 and disk_stats(disk)["stores"] == 0


def test_missing_cache_dir_under_read_only_parent_disables_the_tier(tmp_path, tmpfs):
    parent, make_read_only = _read_only_dir(tmp_path, tmpfs)
    make_read_only()
    with pytest.warns(DiskCacheWarning, match="disabled"):
        disk = open_disk(parent / "cache")
    assert disk.health()["disabled"]
    assert disk.get_computed_blocks(chain(2)) == 0 and disk.load_blocks(chain(2)) == []
    assert disk.store(chain(1)[0], make_kv(0)) is False
    disk.close()


def test_directory_going_read_only_under_a_running_tier(tmpfs):
    mnt = tmpfs("4m")
    hashes = chain(3)
    with open_disk(mnt) as disk:
        fill(disk, hashes[:1])
        remount_read_only(mnt)
        disk.store(hashes[1], make_kv(1))
        disk.flush()
        s = disk_stats(disk)
        assert s["write_errors"] == 1 and s["stores"] == 1
        assert "EROFS" in disk.health()["last_error"]
        assert len(disk.load_blocks(hashes)) == 1


def test_a_cache_cleared_by_another_process_is_started_again_not_left_unwritable(tmp_path):
    hashes = chain(4)
    with open_disk(tmp_path, min_free_bytes=1) as disk:  # a floor, so writes check the space first
        fill(disk, hashes[:2])
        assert cache_clear(tmp_path) == 2  # `mlxkv cache clear`, while this process runs
        fill(disk, hashes[2:], start=2)  # the space check failed on the missing directory: no write ever again
        s = disk_stats(disk)
        assert s["write_errors"] == 0 and s["stores"] == 4
        assert s["blocks_held"] == 2 and s["bytes_held"] == sum(f.stat().st_size for f in block_files(tmp_path))
        assert not disk.contains(hashes[0]) and disk.contains(hashes[3])
    with open_disk(tmp_path) as restarted:
        assert [restarted.contains(h) for h in hashes] == [False, False, True, True]


# -- budget ------------------------------------------------------------------


def test_budget_evicts_least_recently_used(tmp_path):
    hashes = chain(5)
    with open_disk(tmp_path) as probe:
        fill(probe, hashes[:1])
        file_size = disk_stats(probe)["bytes_held"]
    cache_clear(tmp_path)
    with open_disk(tmp_path, budget_bytes=3 * file_size) as disk:
        fill(disk, hashes[:3])
        assert len(disk.load_blocks(hashes[:1])) == 1  # h0 is now most recent
        fill(disk, hashes[3:4], start=3)
        assert [disk.contains(h) for h in hashes[:4]] == [True, False, True, True]
        s = disk_stats(disk)
        assert s["evictions"] == 1 and s["blocks_held"] == 3 and s["bytes_held"] <= 3 * file_size
        assert len(block_files(tmp_path)) == 3


def test_restart_keeps_lru_order_and_trims_to_a_smaller_budget(tmp_path):
    hashes = chain(4)
    with open_disk(tmp_path) as disk:
        for i, h in enumerate(hashes):
            fill(disk, [h], start=i)
            time.sleep(0.02)  # file times are coarse
        file_size = disk_stats(disk)["bytes_held"] // 4
        disk.load_blocks(hashes[:1])  # touches h0's mtime
    with open_disk(tmp_path, budget_bytes=2 * file_size) as disk:
        assert [disk.contains(h) for h in hashes] == [True, False, False, True]
        assert disk_stats(disk)["evictions"] == 2
    assert len(block_files(tmp_path)) == 2


# -- two processes, one directory ----------------------------------------------


def _share_child(directory: str, seed: str, iterations: str) -> None:
    """Write and read a shared set of blocks; report what the loads returned."""
    rng = np.random.default_rng(int(seed))
    hashes = chain(12)
    disk = open_disk(directory, budget_bytes=6 * 1500)
    loaded = mismatched = 0
    for step in range(int(iterations)):
        i = int(rng.integers(len(hashes)))
        disk.store(hashes[i], make_kv(i))
        if step % 4 == 0:
            disk.flush()
        n = disk.get_computed_blocks(hashes)
        for j, block in enumerate(disk.load_blocks(hashes[:n])):
            loaded += 1
            mismatched += not same_bits(block.kv, make_kv(j))
    disk.close()
    s = disk_stats(disk)
    report = {"loaded": loaded, "mismatched": mismatched, "corrupt": s["corrupt"], "stores": s["stores"]}
    print(json.dumps(report))


@pytest.mark.slow
def test_two_processes_share_a_directory(tmp_path):
    args = [sys.executable, __file__, "share", str(tmp_path)]
    children = [subprocess.Popen(args + [seed, "150"], stdout=subprocess.PIPE, text=True, env=CHILD_ENV)
                for seed in ("1", "2")]
    results = []
    for child in children:
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["corrupt"] == 0 and r["mismatched"] == 0
        assert r["stores"] > 0
    assert sum(r["loaded"] for r in results) > 0
    assert temp_files(tmp_path) == []


# -- a random program of store / load / corrupt / delete / restart --------------


class DiskTierMachine(RuleBasedStateMachine):
    """The tier against a model: an LRU of block ids, some files bad or gone."""

    N, KEEP = 8, 4  # distinct blocks, blocks the budget holds

    @initialize()
    def open(self):
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix="mlxkv-disk-machine-"))
        self.hashes = [root_hash(FP, f"block-{i}") for i in range(self.N)]
        with open_disk(self.dir) as probe:
            fill(probe, self.hashes[:1])
            self.file_size = disk_stats(probe)["bytes_held"]
        cache_clear(self.dir)
        self.lru: list[int] = []  # least recent first
        self.bad: set[int] = set()  # corrupt on disk, still indexed
        self.gone: set[int] = set()  # deleted behind its back, still indexed
        self.corrupt = 0
        self.disk = open_disk(self.dir, budget_bytes=self.KEEP * self.file_size)

    def teardown(self):
        import shutil

        if hasattr(self, "disk"):
            self.disk.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _used(self, i):
        self.lru.remove(i)
        self.lru.append(i)

    @rule(i=st.integers(0, N - 1))
    def store(self, i):
        queued = self.disk.store(self.hashes[i], make_kv(i))
        assert queued == (i not in self.lru)
        self.disk.flush()
        if i in self.lru:
            self._used(i)
            return
        self.lru.append(i)
        while len(self.lru) > self.KEEP:
            victim = self.lru.pop(0)
            self.bad.discard(victim)
            self.gone.discard(victim)

    @rule(ids=st.lists(st.integers(0, N - 1), min_size=1, max_size=4, unique=True))
    def load(self, ids):
        loaded = self.disk.load_blocks([self.hashes[i] for i in ids])
        expect = []
        for i in ids:
            if i not in self.lru:
                break
            if i in self.bad or i in self.gone:
                self.corrupt += i in self.bad
                self.lru.remove(i)
                self.bad.discard(i)
                self.gone.discard(i)
                break
            expect.append(i)
            self._used(i)
        assert [b.block_hash for b in loaded] == [self.hashes[i] for i in expect]
        for i, block in zip(expect, loaded):
            assert same_bits(block.kv, make_kv(i))

    def _path(self, i):
        h = self.hashes[i].hex()
        return self.dir / FP.hex() / h[:2] / f"{h}.safetensors"

    @precondition(lambda self: set(self.lru) - self.bad - self.gone)
    @rule(data=st.data())
    def flip_a_bit(self, data):
        i = data.draw(st.sampled_from(sorted(set(self.lru) - self.bad - self.gone)))
        _flip_tensor_bit(self._path(i))
        self.bad.add(i)

    @precondition(lambda self: set(self.lru) - self.gone)
    @rule(data=st.data())
    def delete_behind_its_back(self, data):
        i = data.draw(st.sampled_from(sorted(set(self.lru) - self.gone)))
        self._path(i).unlink()
        self.bad.discard(i)
        self.gone.add(i)

    @rule()
    def restart(self):
        self.disk.close()
        self.corrupt -= disk_stats(self.disk)["corrupt"]
        self.disk = open_disk(self.dir, budget_bytes=self.KEEP * self.file_size)
        on_disk = [i for i, h in enumerate(self.hashes) if self.disk.contains(h)]
        assert set(on_disk) == set(self.lru) - self.gone
        # mtimes are coarse, so take the new process's order as the model's
        order = list(self.disk.index.files)
        self.lru = [self.hashes.index(h) for h in order]
        self.gone.clear()

    @invariant()
    def counters_match(self):
        if not hasattr(self, "disk"):
            return
        s = disk_stats(self.disk)
        assert s["blocks_held"] == len(self.lru)
        assert s["bytes_held"] == len(self.lru) * self.file_size <= self.KEEP * self.file_size
        assert s["corrupt"] == self.corrupt
        assert temp_files(self.dir) == []


TestDiskTierMachine = DiskTierMachine.TestCase
TestDiskTierMachine.settings = settings(max_examples=15, stateful_step_count=20, deadline=None)


# -- privacy -----------------------------------------------------------------


def test_directories_are_private_and_names_are_hex(tmp_path):
    old_umask = os.umask(0)
    try:
        directory = tmp_path / "a" / "b" / "cache"
        with open_disk(directory) as disk:
            fill(disk, chain(2))
    finally:
        os.umask(old_umask)
    created = [tmp_path / "a", tmp_path / "a" / "b", directory, directory / FP.hex()]
    created += [p.parent for p in block_files(directory)]
    for d in created:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in block_files(directory):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        assert set(f.name.removesuffix(".safetensors")) <= set("0123456789abcdef")


# -- cache info / clear --------------------------------------------------------


def test_cache_info_and_clear(tmp_path):
    with open_disk(tmp_path) as a, open_disk(tmp_path, fingerprint=FP_OTHER) as b:
        fill(a, chain(3))  # three one-block files
        b.cache_blocks(chain(2), lambda: [make_kv(0), make_kv(1)])  # one file of a two-block run
        b.flush()
        a_bytes = disk_stats(a)["bytes_held"]
    (tmp_path / "keep-me.txt").write_text("not ours")
    info = cache_info(tmp_path)
    assert info["blocks"] == 5 and info["files"] == 4
    assert info["fingerprints"][FP.hex()] == {"files": 3, "blocks": 3, "bytes": a_bytes}
    assert info["fingerprints"][FP_OTHER.hex()]["blocks"] == 2
    assert cache_clear(tmp_path) == 4  # files
    assert cache_info(tmp_path)["blocks"] == 0 and block_files(tmp_path) == []
    assert (tmp_path / "keep-me.txt").exists()
    assert cache_clear(tmp_path / "never-made") == 0
    assert cache_info(tmp_path / "never-made")["exists"] is False


def test_cache_clear_refuses_a_directory_that_is_not_a_cache(tmp_path):
    (tmp_path / "thesis.tex").write_text("precious")
    (tmp_path / ("ab" * 32)).mkdir()
    with pytest.raises(MlxkvError, match="does not look like"):
        cache_clear(tmp_path)
    assert (tmp_path / "thesis.tex").exists()
    # Fingerprint directories only (a cache whose marker was lost) is accepted.
    bare = tmp_path / "bare"
    with open_disk(bare) as disk:
        fill(disk, chain(1))
    (bare / "CACHEDIR.TAG").unlink()
    assert cache_clear(bare) == 1


def test_cache_info_and_clear_on_a_read_only_disk_or_a_file_are_one_line_errors(tmpfs):
    mnt = tmpfs("4m")
    with open_disk(mnt) as disk:
        fill(disk, chain(2))
    remount_read_only(mnt)
    assert cache_info(mnt)["blocks"] == 2  # reading needs no write access
    with pytest.raises(MlxkvError, match=r"cannot clear .* \(0 block files removed\): Read-only file system"):
        cache_clear(mnt)
    assert cache_info(mnt)["blocks"] == 2
    with pytest.raises(MlxkvError, match="is not a directory"):
        cache_info(mnt / "CACHEDIR.TAG")


# -- child processes run this file as a script -----------------------------------

if __name__ == "__main__":
    {"spill": _spill_child, "share": _share_child}[sys.argv[1]](*sys.argv[2:])
