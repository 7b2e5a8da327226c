"""The SSD tier: safetensors files of block runs, content-addressed by hash.

Layout: one file per run of consecutive blocks, named after its last block's
hash, under a directory per model fingerprint (cache_dir.py has the layout,
run_file.py the format and why). Every directory this tier creates is 0700
and every file 0600.

Threads. The caller (the engine thread) turns MLX arrays into numpy copies
before a write is queued; a background writer thread serialises, writes a
temp file, fsyncs it and renames it into place, so decode never waits for
the disk. A block becomes visible to `get_computed_blocks` only once its
file's rename is done. Reads run on a few reader threads that fill numpy
views of MLX buffers the caller allocated (on Linux by way of a huge-page
buffer each: see read_buffer); no MLX call is made off the caller's thread.

Trust. A read checks every metadata field and the checksum of the tensor
bytes (XXH3-64, or CRC-32 in files written before); a bad file is counted
as corrupt, deleted and the load stops there. Atomic renames plus the
checksum are also what make two processes sharing one directory safe: a
file the other process removed is just a miss, and a block is only ever
taken from a file whose header lists its hash.

Restart. The index (file -> size and block hashes, in LRU order, and block
hash -> file) is rebuilt from names, sizes, mtimes and headers; contents are
verified lazily on read. Hits touch the mtime so the next process starts
from about the same LRU order. Files another process writes meanwhile are
found on a lookup miss: by name when the lookup reaches a run's last
block, else by listing the shard directories whose mtime changed.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from queue import SimpleQueue

import mlx.core as mx
import numpy as np

from mlxkv.errors import MlxkvWarning
from mlxkv.connectors import cache_dir, run_file
from mlxkv.connectors.base import BlockKV, KVRun, LoadedBlock, ReadKV, TierStats
from mlxkv.connectors.read_buffer import ReadBuffer, huge_pages_available
from mlxkv.connectors.run_file import FORMAT_VERSION, MAX_RUN_BLOCKS, CorruptBlockError, FileSpec  # noqa: F401
from mlxkv.hashing import BlockHash

# Files read and verified at once during a hydrate (reads, copies and
# checksums drop the GIL). Enough to keep most of a 4k-token prefix's files
# in flight: measured paired against 4 threads, 12 read 5-6% faster (medians
# of 12-16 rounds), bench tiers 0.66-0.88x against 0.62-0.69x alternated.
# On Linux each keeps a huge-page ReadBuffer the size of a file (about
# 4 MiB for 2 MiB runs), so up to 48 MiB while the tier is open.
READ_THREADS = 12
DEFAULT_MIN_FREE_BYTES = 1 << 30
DEFAULT_MAX_PENDING_BYTES = 256 << 20
BUDGET_SHARE = 4  # a file is at most a quarter of the byte budget
RESCAN_INTERVAL_S = 1.0  # a lookup miss looks for other processes' new files at most this often

# Real dtype -> (mx dtype, numpy dtype it is stored as). numpy has no
# bfloat16, so bfloat16 is stored as its raw uint16 bit patterns.
_DTYPES = {
    "float32": (mx.float32, np.dtype(np.float32)),
    "float16": (mx.float16, np.dtype(np.float16)),
    "bfloat16": (mx.bfloat16, np.dtype(np.uint16)),
}


class DiskCacheWarning(MlxkvWarning):
    """The disk tier could not use its directory and runs read-only or disabled."""


@dataclass(slots=True)
class _Write:
    block_hashes: tuple[BlockHash, ...]
    keys: np.ndarray  # [num_layers, n, heads, block_size, head_dim]
    values: np.ndarray
    spill: bool

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@dataclass(slots=True)
class _File:
    size: int
    block_hashes: tuple[BlockHash, ...]


@dataclass(slots=True)
class _Read:
    """Blocks wanted from one file (of `size` bytes): `block_hashes` from position `pos` on."""

    name: BlockHash
    pos: int
    size: int
    block_hashes: list[BlockHash] = field(default_factory=list)


def _normalize_dtype(dtype) -> str:
    name = str(dtype).removeprefix("mlx.core.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return name


def _consecutive(indices: list[int], limit: int) -> list[list[int]]:
    """Split indices into stretches of consecutive values, at most `limit` long."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][-1] + 1 == i and len(out[-1]) < limit:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class DiskKvCacheConnector:
    """A KV cache connector that keeps blocks as files on local SSD.

    Writes are queued (`store`, `cache_blocks`, `evict_block`) and done by a
    writer thread; `flush()` waits for them, `close()` drains and stops it.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        fingerprint: bytes,
        *,
        block_size: int,
        num_layers: int,
        dtype: str,
        budget_bytes: int | None = None,
        min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        tier_name: str = "disk",
    ):
        if not isinstance(fingerprint, bytes) or len(fingerprint) != cache_dir.HASH_LEN:
            raise ValueError("the model fingerprint must be 32 bytes")
        if block_size < 1 or num_layers < 1:
            raise ValueError("block_size and num_layers must be positive")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0 (or None for no budget)")
        self.root = Path(directory).expanduser()
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.num_layers = num_layers
        self.dtype = _normalize_dtype(dtype)
        self._mx_dtype, self._np_dtype = _DTYPES[self.dtype]
        self.spec = FileSpec(fingerprint, block_size, num_layers, self.dtype, self._np_dtype)
        self.budget_bytes = budget_bytes
        self.min_free_bytes = min_free_bytes
        self.max_pending_bytes = max_pending_bytes
        self.tier_name = tier_name
        self.dir = self.root / fingerprint.hex()

        self._lock = threading.Condition()
        self._readers = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="mlxkv-disk-read")
        self._index: OrderedDict[BlockHash, _File] = OrderedDict()  # file (last hash) -> run; LRU first
        self._where: dict[BlockHash, tuple[BlockHash, int]] = {}  # block hash -> (file, position)
        self._pending: dict[BlockHash, int] = {}
        self._pending_bytes = 0
        self._stats = TierStats()
        self.dropped_writes = 0  # the queue was full (or the tier closed)
        self.low_space_skips = 0  # free space under the floor (also write_errors)
        self.last_error: str | None = None
        self.read_only = False
        self.disabled = False
        self.reason: str | None = None
        self._closed = False
        self._direct_io: bool | None = None  # reads bypass the page cache (learnt on the first read)
        self._huge_pages = huge_pages_available()
        self._read_buffers = threading.local()  # each reader thread's ReadBuffer
        self._shard_mtimes: dict[str, int] = {}  # shard dir -> mtime_ns when last listed
        self._next_rescan = 0.0
        self.rescan_interval = RESCAN_INTERVAL_S

        self._open_directory()
        self._queue: SimpleQueue[_Write | None] = SimpleQueue()
        self._writer: threading.Thread | None = None
        if self.writable:
            self._writer = threading.Thread(target=self._writer_loop, name="mlxkv-disk-writer", daemon=True)
            self._writer.start()

    # -- start-up ------------------------------------------------------------

    def _open_directory(self) -> None:
        try:
            cache_dir.make_private_dirs(self.dir)
        except OSError as e:
            if not self.dir.is_dir():
                self._degrade(e, disabled=True)
                return
        try:
            self._probe_write()
        except OSError as e:
            self._degrade(e, disabled=False)
        try:
            self._scan()
        except OSError as e:
            self._degrade(e, disabled=True)
            return
        if not self.read_only:
            cache_dir.write_marker(self.root)
        self._enforce_budget()

    def _degrade(self, error: OSError, *, disabled: bool) -> None:
        self.read_only = True
        self.disabled = disabled
        # The OS's reason first, then the directory the user gave, not the
        # fingerprint one under it: 64 hex digits would push the reason off
        # the chat app's notification.
        self.reason = f"{error.strerror or error}: {self.root}"
        mode = "disabled" if disabled else "read-only"
        warnings.warn(f"mlxkv: SSD tier {mode}: {self.reason}", DiskCacheWarning, stacklevel=4)

    def _probe_write(self) -> None:
        probe = cache_dir.temp_path(self.dir, '0' * 64)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)

    def _scan(self) -> None:
        """Index the files already on disk (oldest mtime first); drop dead temps.

        Headers are read (on the reader threads) for the block hashes inside
        each run; a file whose header lists none is indexed under its name
        alone. Nothing else is checked here: a bad file is found when read
        and counted then.
        """
        found = []
        for entry in os.scandir(self.dir):
            if entry.is_file(follow_symlinks=False):
                self._maybe_remove_temp(Path(entry.path))
            elif cache_dir.is_shard(entry):
                self._shard_mtimes[entry.name] = entry.stat(follow_symlinks=False).st_mtime_ns
                found.extend(self._scan_shard(entry.path, entry.name))
        self._index_found(found)

    def _index_found(self, found: list[tuple[float, BlockHash, int]]) -> None:
        """Index files (mtime, name, size), oldest first, from their headers (read on the reader threads)."""
        found.sort(key=lambda f: f[0])
        names = [name for _, name, _ in found]
        for (_, name, size), hashes in zip(found, self._readers.map(self._file_hashes, names)):
            self._add(name, size, hashes or (name,))

    def _rescan(self) -> bool:
        """Index the files other processes added since we last looked; True if any.

        A run is named after its last block, so a lookup that stops inside
        another process's run cannot guess its name (`_adopt`). Creating a
        file changes its shard directory's mtime: only changed shards are
        listed again, at most once per `rescan_interval`, on a miss.
        """
        now = time.monotonic()
        if now < self._next_rescan:
            return False
        self._next_rescan = now + self.rescan_interval
        found = []
        try:
            entries = list(os.scandir(self.dir))
        except OSError:
            return False
        for entry in entries:
            if not cache_dir.is_shard(entry):
                continue
            try:
                mtime = entry.stat(follow_symlinks=False).st_mtime_ns
            except OSError:
                continue
            if self._shard_mtimes.get(entry.name) != mtime:
                self._shard_mtimes[entry.name] = mtime
                try:
                    found += self._scan_shard(entry.path, entry.name, known=self._indexed)
                except OSError:
                    continue  # unreadable now: a miss, as before
        self._index_found(found)
        return bool(found)

    def _indexed(self, name: BlockHash) -> bool:
        with self._lock:
            return name in self._index

    def _scan_shard(self, path: str, prefix: str, known=lambda name: False) -> list[tuple[float, BlockHash, int]]:
        """(mtime, name, size) of the block files in a shard, but those `known` (no stat for them)."""
        found = []
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:  # another process cleared it
            return found
        for entry in entries:
            m = cache_dir.BLOCK_NAME.fullmatch(entry.name)
            if m is None:
                self._maybe_remove_temp(Path(entry.path))
            elif m.group(1).startswith(prefix) and not known(bytes.fromhex(m.group(1))):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime, bytes.fromhex(m.group(1)), st.st_size))
        return found

    def _file_hashes(self, name: BlockHash) -> tuple[BlockHash, ...] | None:
        """The block hashes a file's header lists (checked when read), or None if it lists none."""
        try:
            return run_file.listed_hashes(run_file.read_metadata(self._path(name)), name)
        except (OSError, CorruptBlockError):
            return None

    def _maybe_remove_temp(self, path: Path) -> None:
        """Remove a temp file left by a process that is gone (or long stuck)."""
        if self.read_only or not cache_dir.is_dead_temp(path):
            return
        try:
            cache_dir.unlink(path)
        except OSError:
            pass

    # -- the index (callers hold no lock; these take it) -----------------------

    def _path(self, block_hash: BlockHash) -> Path:
        return cache_dir.block_path(self.dir, block_hash)

    def _add(self, name: BlockHash, size: int, block_hashes: tuple[BlockHash, ...]) -> None:
        with self._lock:
            self._drop_entry(name)
            self._index[name] = _File(size, block_hashes)
            for pos, block_hash in enumerate(block_hashes):
                self._where[block_hash] = (name, pos)
            self._stats.bytes_held += size
            self._stats.blocks_held = len(self._where)

    def _drop_entry(self, name: BlockHash) -> int:
        """Unindex a file (lock held); returns how many blocks it was the place of."""
        entry = self._index.pop(name, None)
        if entry is None:
            return 0
        dropped = 0
        for block_hash in entry.block_hashes:
            if self._where.get(block_hash, (None,))[0] == name:
                del self._where[block_hash]
                dropped += 1
        self._stats.bytes_held -= entry.size
        self._stats.blocks_held = len(self._where)
        return dropped

    def _forget(self, name: BlockHash) -> None:
        with self._lock:
            self._drop_entry(name)

    # -- the connector protocol ----------------------------------------------

    @property
    def writable(self) -> bool:
        return not self.read_only and not self._closed

    def contains(self, block_hash: BlockHash) -> bool:
        """True if the block is on disk (written and indexed), not merely queued."""
        with self._lock:
            return block_hash in self._where

    def is_pending(self, block_hash: BlockHash) -> bool:
        """True if a write of the block is queued or in progress."""
        with self._lock:
            return block_hash in self._pending

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        if self.disabled:
            return 0
        n = 0
        for i, block_hash in enumerate(block_hashes):
            found = self.contains(block_hash) or self._adopt(block_hashes, i)
            if not found and self._rescan():
                found = self.contains(block_hash)
            if not found:
                break
            n += 1
        with self._lock:
            self._stats.lookups += 1
            self._stats.hit_blocks += n
            self._stats.hit_tokens += n * self.block_size
        return n

    def _adopt(self, block_hashes: Sequence[BlockHash], i: int) -> bool:
        """Index a file another process wrote since our scan that holds block i.

        Runs are consecutive blocks named after their last, so such a file is
        named after one of the next MAX_RUN_BLOCKS hashes: a stat each. A run
        that ends past the lookup's last hash is left to `_rescan`.
        """
        for name in block_hashes[i : i + MAX_RUN_BLOCKS]:
            with self._lock:
                if name in self._index:
                    continue
            try:
                size = os.stat(self._path(name)).st_size
            except OSError:
                continue
            self._add(name, size, self._file_hashes(name) or (name,))
            if self.contains(block_hashes[i]):
                return True
        return False

    def load_blocks(self, block_hashes: Sequence[BlockHash]) -> list[LoadedBlock]:
        """The leading run of blocks that are on disk and pass verification.

        Each file is read into the MLX buffer its blocks will live in and
        verified there, on a few threads that release the GIL for both; this
        thread, the only one making MLX arrays, allocates the buffers and
        makes views of them. Through the page cache a file is read straight
        into its buffer (measured a third faster than reading into numpy and
        copying into MLX); with O_DIRECT on Linux it lands in the thread's
        huge-page ReadBuffer first, as the device reads those much faster,
        so the reads start before the buffers exist and wait for them only
        to copy (measured 0.78x of a sequential read against 0.71x).
        """
        loaded = []
        if self.disabled or not block_hashes:
            return loaded
        plan = self._plan(block_hashes)
        if len(plan) > 1 and self._direct_io is False:
            self._readers.submit(run_file.prefetch, [self._path(job.name) for job in plan])
        buffers = [Future() for _ in plan]
        reads = [self._readers.submit(self._read, job, buffer) for job, buffer in zip(plan, buffers)]
        try:
            for buffer, allocated in zip(buffers, self._buffers(plan)):
                buffer.set_result(allocated)
        except BaseException as e:
            for buffer in buffers:
                if not buffer.done():
                    buffer.set_exception(e)  # readers waiting for it stop
            raise
        for job, buffer, read in zip(plan, buffers, reads):
            # Side effects happen here, in order, up to the first bad file:
            # files read ahead past it are dropped untouched.
            data, problem = read.result()
            if data is None:
                if problem is None:  # gone or replaced (the other process, or budget): a miss
                    self._forget(job.name)
                else:
                    self._discard_corrupt(job.name, problem)
                break
            blocks = self._take(job, data, buffer.result()[0])
            if blocks:
                self._touch(job.name)
            loaded += blocks
            if len(blocks) < len(job.block_hashes):
                break
        with self._lock:
            self._stats.hydrations += len(loaded)
        return loaded

    def _plan(self, block_hashes: Sequence[BlockHash]) -> list[_Read]:
        """The file reads that cover the leading indexed blocks, one per stretch of a file."""
        plan: list[_Read] = []
        for i, block_hash in enumerate(block_hashes):
            with self._lock:
                where = self._where.get(block_hash)
            if where is None and self._adopt(block_hashes, i):
                with self._lock:
                    where = self._where.get(block_hash)
            if where is None:
                break
            name, pos = where
            last = plan[-1] if plan else None
            if last is None or last.name != name or last.pos + len(last.block_hashes) != pos:
                with self._lock:
                    entry = self._index.get(name)
                if entry is None:
                    break  # deleted for the budget meanwhile
                last = _Read(name, pos, entry.size)
                plan.append(last)
            last.block_hashes.append(block_hash)
        return plan

    def _buffers(self, plan: list[_Read]) -> list[tuple[mx.array, np.ndarray]]:
        """New MLX buffers for the files, made in one eval, each with a numpy view where its file goes.

        The reader threads write into the views, the one thing of MLX's they
        touch (numpy views of MLX memory are writable by design). A view
        starts ALIGN-aligned, as O_DIRECT wants.
        """
        padded = [-(-job.size // run_file.ALIGN) * run_file.ALIGN for job in plan]
        bufs = [mx.zeros((n + run_file.ALIGN,), mx.uint8) for n in padded]
        mx.eval(bufs)
        views = []
        for buf, n in zip(bufs, padded):
            view = np.array(buf, copy=False)
            at = -view.ctypes.data % run_file.ALIGN
            views.append((buf, view[at : at + n]))
        return views

    def _read(self, job: _Read, buffer: Future) -> tuple[run_file.RunData | None, str | None]:
        """(the file's run, verified, None), (None, None) if it is gone or replaced, or
        (None, why it is corrupt). No side effects but learning whether O_DIRECT works here."""
        try:
            data, direct = run_file.read_into(self._path(job.name), lambda: buffer.result()[1], job.size,
                                              self._read_buffer())
        except OSError:
            return None, None
        if data is None:
            return None, None
        self._direct_io = direct
        try:
            run = run_file.decode(self.spec, data, job.name)
            run.verify()
        except CorruptBlockError as e:
            return None, str(e)
        return run, None

    def _read_buffer(self) -> ReadBuffer | None:
        """This reader thread's buffer for O_DIRECT reads, where huge pages make it pay."""
        if not self._huge_pages:
            return None
        buffer = getattr(self._read_buffers, "buffer", None)
        if buffer is None:
            buffer = self._read_buffers.buffer = ReadBuffer()
        return buffer

    def _take(self, job: _Read, data: run_file.RunData, buf: mx.array) -> list[LoadedBlock]:
        """The wanted blocks of a verified file, as views of its run in `buf`.

        The header, not the index, says where a block is: another process
        may have replaced the file with a longer or shorter run since.
        """
        hashes, first = data.block_hashes, job.block_hashes[0]
        pos = hashes.index(first) if first in hashes else 0
        n = 0
        while n < len(job.block_hashes) and pos + n < len(hashes) and hashes[pos + n] == job.block_hashes[n]:
            n += 1
        if n == 0 or pos != job.pos:
            self._add(job.name, job.size, hashes)  # re-index from the header
        if n == 0:
            return []
        base = np.array(buf, copy=False).ctypes.data
        run = KVRun(self._mx_view(buf, base, data.keys), self._mx_view(buf, base, data.values))
        return [LoadedBlock(h, run.block(pos + i), self.tier_name) for i, h in enumerate(job.block_hashes[:n])]

    def _mx_view(self, buf: mx.array, base: int, tensor: np.ndarray) -> mx.array:
        """The MLX view of `buf` that `tensor` (a numpy view of it) is; bfloat16 comes back from its bits here."""
        at = tensor.ctypes.data - base
        return buf[at : at + tensor.nbytes].view(self._mx_dtype).reshape(tensor.shape)

    def _touch(self, name: BlockHash) -> None:
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
        try:
            os.utime(self._path(name))  # so a restart keeps roughly this LRU order
        except OSError:
            pass

    def _discard_corrupt(self, name: BlockHash, why: str) -> None:
        with self._lock:
            self._drop_entry(name)
            self._stats.corrupt += 1
            self.last_error = f"corrupt block file {name.hex()[:16]}: {why}"
        try:
            cache_dir.unlink(self._path(name))
        except OSError:
            pass  # read-only: it stays, and fails again next time

    def cache_blocks(self, block_hashes: Sequence[BlockHash], read: ReadKV) -> None:
        """Write-through: queue every block not already on disk or queued, a file per run."""
        wanted = [i for i, h in enumerate(block_hashes) if self._wants(h)]
        if not wanted:
            return
        blocks = read()
        block_nbytes = blocks[wanted[0]].nbytes
        per_file = run_file.run_blocks(block_nbytes)
        if self.budget_bytes is not None:  # a file leaves whole: keep it a small share of the budget
            per_file = max(1, min(per_file, self.budget_bytes // (BUDGET_SHARE * block_nbytes)))
        for run in _consecutive(wanted, per_file):
            self.store_run([block_hashes[i] for i in run], [blocks[i] for i in run])

    def evict_block(self, block_hash: BlockHash, read: ReadKV) -> None:
        """Spill: the block leaves the pool; keep a copy unless we have one."""
        if self._wants(block_hash):
            self.store(block_hash, read()[0], spill=True)

    def _wants(self, block_hash: BlockHash) -> bool:
        if not self.writable:
            return False
        with self._lock:
            if block_hash in self._where or block_hash in self._pending:
                return False
            if self._pending_bytes >= self.max_pending_bytes:
                self.dropped_writes += 1  # skip even the read
                return False
        return True

    def store(self, block_hash: BlockHash, kv: BlockKV, *, spill: bool = False) -> bool:
        """Queue a background write of one block's K/V; False if it was not queued."""
        return self.store_run([block_hash], [kv], spill=spill)

    def store_run(self, block_hashes: Sequence[BlockHash], kvs: Sequence[BlockKV], *, spill: bool = False) -> bool:
        """Queue a background write of consecutive blocks as one file; False if it was not queued.

        Blocks already on disk or queued are left out. Converts to numpy here,
        on the caller's thread: the writer thread never touches an MLX array.
        Never blocks on the disk.
        """
        for block_hash in block_hashes:
            self._path(block_hash)  # validates the hash
        if not self.writable:
            if self._closed:
                with self._lock:
                    self.dropped_writes += 1
            return False
        with self._lock:
            fresh = [i for i, h in enumerate(block_hashes) if h not in self._where and h not in self._pending]
            for h in block_hashes:
                if h in self._where:
                    self._index.move_to_end(self._where[h][0])
        if not fresh:
            return False
        keys, values = self._to_numpy([kvs[i] for i in fresh])
        job = _Write(tuple(block_hashes[i] for i in fresh), keys, values, spill)
        with self._lock:
            if self._pending_bytes + job.nbytes > self.max_pending_bytes:
                self.dropped_writes += 1
                return False
            for h in job.block_hashes:
                self._pending[h] = job.nbytes
            self._pending_bytes += job.nbytes
        self._queue.put(job)
        return True

    def _to_numpy(self, kvs: list[BlockKV]) -> tuple[np.ndarray, np.ndarray]:
        """Layer-major numpy copies `[num_layers, n, heads, block_size, head_dim]` of the blocks."""
        first, n = kvs[0], len(kvs)
        if first.run is not None and all(kv.run is first.run and kv.index == first.index + j
                                         for j, kv in enumerate(kvs)):
            keys = first.run.keys[:, first.index : first.index + n]
            values = first.run.values[:, first.index : first.index + n]
        else:
            for kv in kvs:
                if kv.keys.ndim != 4 or kv.values.ndim != 4:
                    raise ValueError(f"expected KV of shape {self._shape_hint}, got {list(kv.keys.shape)}")
            run = KVRun.stack(kvs)
            keys, values = run.keys, run.values
        for a in (keys, values):
            if a.dtype != self._mx_dtype:
                raise ValueError(f"disk tier holds {self.dtype} KV, got {a.dtype}")
            shape = tuple(a.shape)
            if len(shape) != 5 or shape[0] != self.num_layers or shape[3] != self.block_size:
                raise ValueError(f"expected KV of shape {self._shape_hint}, got {[shape[0], *shape[2:]]}")
        if keys.shape[:4] != values.shape[:4]:
            raise ValueError(f"keys {keys.shape} and values {values.shape} do not match")
        return self._numpy(keys), self._numpy(values)

    @property
    def _shape_hint(self) -> str:
        return f"[{self.num_layers}, heads, {self.block_size}, head_dim]"

    def _numpy(self, a: mx.array) -> np.ndarray:
        if self.dtype == "bfloat16":
            a = a.view(mx.uint16)
        return np.array(a, copy=True)

    # -- the writer thread ---------------------------------------------------

    def _writer_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(job)
            except Exception as e:  # never let the writer die
                self._count_write_error(e)
            finally:
                with self._lock:
                    for h in job.block_hashes:
                        self._pending.pop(h, None)
                    self._pending_bytes -= job.nbytes
                    self._lock.notify_all()

    def _write(self, job: _Write) -> None:
        if self.budget_bytes is not None and job.nbytes > self.budget_bytes:
            with self._lock:
                self.dropped_writes += 1
            return
        self._start_again_if_cleared()
        if not self._enough_space(job.nbytes):
            return
        data = run_file.encode(self.spec, job.block_hashes, job.keys, job.values)
        name = job.block_hashes[-1]
        self._write_atomic(self._path(name), data)
        self._add(name, len(data), job.block_hashes)
        with self._lock:
            self._stats.stores += len(job.block_hashes)
            self._stats.spills += len(job.block_hashes) if job.spill else 0
        self._enforce_budget()

    def _start_again_if_cleared(self) -> None:
        """`mlxkv cache clear` in another process removed our directory: every
        file indexed is gone, and every later write would fail (the space
        check first) for the rest of this process. Forget them and make it again."""
        if self.dir.is_dir():
            return
        with self._lock:
            for name in list(self._index):
                self._drop_entry(name)
            self._shard_mtimes.clear()
        cache_dir.make_private_dirs(self.dir)
        cache_dir.write_marker(self.root)

    def _enough_space(self, nbytes: int) -> bool:
        """Would the write leave at least `min_free_bytes` free? (0: no floor.)"""
        if self.min_free_bytes <= 0:
            return True
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError as e:
            self._count_write_error(e)
            return False
        if free - nbytes < self.min_free_bytes:
            with self._lock:
                self.low_space_skips += 1
                self._stats.write_errors += 1
                self.last_error = f"free space {free} B is under the floor of {self.min_free_bytes} B"
            return False
        return True

    def _write_atomic(self, path: Path, data: bytes) -> None:
        shard = path.parent
        if not shard.is_dir():
            cache_dir.make_private_dirs(shard)
            cache_dir.fsync_dir(shard.parent)
        tmp = cache_dir.temp_path(shard, path.name)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                cache_dir.unlink(tmp)
            except OSError:
                pass
            raise
        cache_dir.fsync_dir(shard)

    def _count_write_error(self, e: Exception) -> None:
        with self._lock:
            self._stats.write_errors += 1
            name = errno.errorcode.get(getattr(e, "errno", None) or 0, type(e).__name__)
            self.last_error = f"write failed ({name}): {e}"

    def _enforce_budget(self) -> None:
        """Delete least recently used files until the budget holds."""
        if self.budget_bytes is None or self.read_only:
            return
        while True:
            with self._lock:
                if self._stats.bytes_held <= self.budget_bytes or not self._index:
                    return
                victim = next(iter(self._index))
                self._stats.evictions += self._drop_entry(victim)
            try:
                cache_dir.unlink(self._path(victim))
            except OSError as e:
                self._count_write_error(e)

    # -- lifecycle and stats -------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending, timeout)

    def close(self) -> None:
        """Drain the queue and stop the writer. Reads keep working."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stats(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {self.tier_name: TierStats(**self._stats.as_dict()).as_dict()}

    def health(self) -> dict:
        """What `stats()` has no field for: mode, drops and the last error."""
        with self._lock:
            return {
                "directory": str(self.dir),
                "read_only": self.read_only,
                "disabled": self.disabled,
                "reason": self.reason,
                "pending_writes": len(self._pending),
                "pending_bytes": self._pending_bytes,
                "dropped_writes": self.dropped_writes,
                "low_space_skips": self.low_space_skips,
                "last_error": self.last_error,
            }
