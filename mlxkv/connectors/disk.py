"""The SSD tier: one safetensors file per block, content-addressed by its hash.

Layout: `<directory>/<fingerprint hex>/<first 2 hex>/<block hash hex>.safetensors`.
File names come only from hex digests, so nothing a user typed ends up in a
path. Every directory this module creates is 0700 and every file 0600.

Threads. The caller (the engine thread) turns MLX arrays into numpy copies
before a write is queued; a background writer thread serialises, writes a
temp file, fsyncs it and renames it into place, so decode never waits for
the disk. No MLX array is touched off the caller's thread. A block becomes
visible to `get_computed_blocks` only once its rename is done.

Trust. A read checks every metadata field and a CRC-32 checksum of the
tensor bytes; a bad file is counted as corrupt, deleted and the load stops
there. Atomic renames plus the checksum are also what make two processes
sharing one directory safe: a file the other process removed is just a miss.

Restart. The index (hash -> file size, in LRU order) is rebuilt from names,
sizes and mtimes only; contents are verified lazily on read. Hits touch the
mtime so the next process starts from about the same LRU order.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import threading
import time
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue

import mlx.core as mx
import numpy as np
import safetensors.numpy

from mlxkv.errors import MlxkvError
from mlxkv.connectors.base import BlockKV, LoadedBlock, ReadKV, TierStats
from mlxkv.hashing import BlockHash

FORMAT = "mlxkv-kv-block"
FORMAT_VERSION = "2"  # 2: CRC-32 checksums (1 used blake2b)
CHECKSUM_ALGO = "crc32"
READ_THREADS = 4  # files read and verified at once during a hydrate
SUFFIX = ".safetensors"
MARKER = "CACHEDIR.TAG"
MARKER_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This directory is an mlxkv KV block cache (safe to delete).\n"
)
DEFAULT_MIN_FREE_BYTES = 1 << 30
DEFAULT_MAX_PENDING_BYTES = 256 << 20
STALE_TEMP_SECONDS = 3600  # a temp file this old is dead even if its pid lives

HASH_LEN = 32
_HEX64 = re.compile(r"[0-9a-f]{64}")
_BLOCK_NAME = re.compile(r"([0-9a-f]{64})\.safetensors")
_TEMP_NAME = re.compile(r"\.[0-9a-f]{64}\.([0-9]+)\.[0-9a-f]{8}\.tmp")

# Real dtype -> (mx dtype, numpy dtype it is stored as). numpy has no
# bfloat16, so bfloat16 is stored as its raw uint16 bit patterns.
_DTYPES = {
    "float32": (mx.float32, np.dtype(np.float32)),
    "float16": (mx.float16, np.dtype(np.float16)),
    "bfloat16": (mx.bfloat16, np.dtype(np.uint16)),
}


class DiskCacheWarning(RuntimeWarning):
    """The disk tier could not use its directory and runs read-only or disabled."""


class CorruptBlockError(ValueError):
    """A block file that failed verification."""


@dataclass(slots=True)
class _Write:
    block_hash: BlockHash
    keys: np.ndarray
    values: np.ndarray
    spill: bool

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def _normalize_dtype(dtype) -> str:
    name = str(dtype).removeprefix("mlx.core.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return name


_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "U16": np.uint16}


def _parse_safetensors(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """Metadata and zero-copy tensor views of a safetensors file's bytes.

    The safetensors package copies every tensor out of the buffer; on a
    hydrate that copy cost a third of the read time, and MLX copies once more
    anyway. Every offset is checked against the buffer: a bad file is corrupt.
    """
    if len(data) < 8:
        raise CorruptBlockError("truncated header")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise CorruptBlockError("truncated header")
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict):
        raise CorruptBlockError("no metadata")
    tensors = {}
    for name, info in header.items():
        dtype = _NP_DTYPES.get(info["dtype"])
        start, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        size_ok = dtype is not None and end - start == count * np.dtype(dtype).itemsize
        if not size_ok or not 0 <= start <= end <= len(data) - 8 - n:
            raise CorruptBlockError(f"tensor {name!r}: bad dtype, shape or offsets")
        tensors[name] = np.frombuffer(data, dtype, count, 8 + n + start).reshape(info["shape"])
    return meta, tensors


def _checksum(keys: np.ndarray, values: np.ndarray) -> str:
    # CRC-32 catches torn writes and flipped bits, the faults a cache file
    # meets, at about 4x the speed of blake2b: a hydrate reads at disk speed.
    crc = 0
    for a in (keys, values):
        crc = zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8), crc)
    return f"{crc:08x}"


def _make_private_dirs(path: Path) -> None:
    """mkdir -p, with every directory created here 0700 (umask notwithstanding)."""
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            continue  # another process made it first
        os.chmod(d, 0o700)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


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
        if not isinstance(fingerprint, bytes) or len(fingerprint) != HASH_LEN:
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
        self.budget_bytes = budget_bytes
        self.min_free_bytes = min_free_bytes
        self.max_pending_bytes = max_pending_bytes
        self.tier_name = tier_name
        self.dir = self.root / fingerprint.hex()

        self._lock = threading.Condition()
        self._readers = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="mlxkv-disk-read")
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
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

        self._open_directory()
        self._queue: SimpleQueue[_Write | None] = SimpleQueue()
        self._writer: threading.Thread | None = None
        if self.writable:
            self._writer = threading.Thread(target=self._writer_loop, name="mlxkv-disk-writer", daemon=True)
            self._writer.start()

    # -- start-up ------------------------------------------------------------

    def _open_directory(self) -> None:
        try:
            _make_private_dirs(self.dir)
        except OSError as e:
            if not self.dir.is_dir():
                self._degrade(disabled=True, why=f"cannot create {self.dir}: {e.strerror or e}")
                return
        try:
            self._probe_write()
        except OSError as e:
            self._degrade(disabled=False, why=f"{self.dir} is not writable: {e.strerror or e}")
        try:
            self._scan()
        except OSError as e:
            self._degrade(disabled=True, why=f"cannot read {self.dir}: {e.strerror or e}")
            return
        if not self.read_only:
            self._write_marker()
        self._enforce_budget()

    def _degrade(self, *, disabled: bool, why: str) -> None:
        self.read_only = True
        self.disabled = disabled
        self.reason = why
        mode = "disabled" if disabled else "read-only"
        warnings.warn(f"mlxkv: disk KV cache {mode}: {why}", DiskCacheWarning, stacklevel=4)

    def _probe_write(self) -> None:
        probe = self.dir / f".{'0' * 64}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)

    def _write_marker(self) -> None:
        """CACHEDIR.TAG: backup tools skip the tree, and `cache_clear` knows it."""
        marker = self.root / MARKER
        try:
            if not marker.exists():
                marker.write_text(MARKER_TEXT)
                os.chmod(marker, 0o600)
        except OSError:
            pass  # only a convenience

    def _scan(self) -> None:
        """Index the blocks already on disk (oldest mtime first); drop dead temps."""
        found = []
        for entry in os.scandir(self.dir):
            if entry.is_file(follow_symlinks=False):
                self._maybe_remove_temp(Path(entry.path), entry.name)
            elif entry.is_dir(follow_symlinks=False) and len(entry.name) == 2:
                found.extend(self._scan_shard(entry.path, entry.name))
        found.sort(key=lambda f: f[0])
        for _, block_hash, size in found:
            self._index[block_hash] = size
        self._stats.blocks_held = len(self._index)
        self._stats.bytes_held = sum(self._index.values())

    def _scan_shard(self, path: str, prefix: str) -> list[tuple[float, BlockHash, int]]:
        found = []
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:  # another process cleared it
            return found
        for entry in entries:
            m = _BLOCK_NAME.fullmatch(entry.name)
            if m is None:
                self._maybe_remove_temp(Path(entry.path), entry.name)
            elif m.group(1).startswith(prefix):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime, bytes.fromhex(m.group(1)), st.st_size))
        return found

    def _maybe_remove_temp(self, path: Path, name: str) -> None:
        """Remove a temp file left by a process that is gone (or long stuck)."""
        m = _TEMP_NAME.fullmatch(name)
        if m is None or self.read_only:
            return
        pid = int(m.group(1))
        try:
            stale = time.time() - os.path.getmtime(path) > STALE_TEMP_SECONDS
        except FileNotFoundError:
            return
        if stale or (pid != os.getpid() and not _pid_alive(pid)):
            try:
                _unlink(path)
            except OSError:
                pass

    # -- paths and metadata --------------------------------------------------

    def _path(self, block_hash: BlockHash) -> Path:
        if not isinstance(block_hash, bytes) or len(block_hash) != HASH_LEN:
            raise ValueError("a block hash must be 32 bytes")
        name = block_hash.hex()
        return self.dir / name[:2] / f"{name}{SUFFIX}"

    def _metadata(self, block_hash: BlockHash, shape: tuple[int, ...]) -> dict[str, str]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "fingerprint": self.fingerprint.hex(),
            "block_hash": block_hash.hex(),
            "block_size": str(self.block_size),
            "num_layers": str(self.num_layers),
            "dtype": self.dtype,
            "shape": "x".join(map(str, shape)),
            "checksum_algo": CHECKSUM_ALGO,
        }

    # -- the connector protocol ----------------------------------------------

    @property
    def writable(self) -> bool:
        return not self.read_only and not self._closed

    def contains(self, block_hash: BlockHash) -> bool:
        """True if the block is on disk (written and indexed), not merely queued."""
        with self._lock:
            return block_hash in self._index

    def is_pending(self, block_hash: BlockHash) -> bool:
        """True if a write of the block is queued or in progress."""
        with self._lock:
            return block_hash in self._pending

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        if self.disabled:
            return 0
        n = 0
        for block_hash in block_hashes:
            if not (self.contains(block_hash) or self._adopt(block_hash)):
                break
            n += 1
        with self._lock:
            self._stats.lookups += 1
            self._stats.hit_blocks += n
            self._stats.hit_tokens += n * self.block_size
        return n

    def _adopt(self, block_hash: BlockHash) -> bool:
        """Index a file another process wrote since our scan (one stat)."""
        try:
            size = os.stat(self._path(block_hash)).st_size
        except OSError:
            return False
        with self._lock:
            if block_hash not in self._index:
                self._index[block_hash] = size
                self._stats.blocks_held += 1
                self._stats.bytes_held += size
        return True

    def load_blocks(self, block_hashes: Sequence[BlockHash]) -> list[LoadedBlock]:
        """The leading run of blocks that are on disk and pass verification.

        Files are read and verified on a few threads (reads and CRC-32 release
        the GIL), so a hydrate is not one file latency after another; the MLX
        arrays are made here, on the caller's thread.
        """
        loaded = []
        if self.disabled or not block_hashes:
            return loaded
        for block_hash, (arrays, problem) in zip(block_hashes, self._readers.map(self._read, block_hashes)):
            # Side effects happen here, in order, up to the first bad block:
            # files read ahead past it are dropped untouched.
            path = self._path(block_hash)
            if arrays is None:
                if problem is None:  # gone (the other process, or budget): a miss
                    self._forget(block_hash)
                else:
                    self._discard_corrupt(block_hash, path, problem)
                break
            self._touch(block_hash, path)
            loaded.append(LoadedBlock(block_hash, BlockKV(*map(self._to_mx, arrays)), self.tier_name))
        with self._lock:
            self._stats.hydrations += len(loaded)
        return loaded

    def _read(self, block_hash: BlockHash):
        """(keys, values) of a verified file, or (None, why it is corrupt); no side effects."""
        try:
            data = self._path(block_hash).read_bytes()
        except OSError:
            return None, None
        try:
            return self._decode(data, block_hash), None
        except CorruptBlockError as e:
            return None, str(e)

    def _decode(self, data: bytes, block_hash: BlockHash) -> tuple[np.ndarray, np.ndarray]:
        try:
            meta, tensors = _parse_safetensors(data)
        except CorruptBlockError:
            raise
        except Exception as e:  # bad JSON, bad UTF-8, wrong types, ...
            raise CorruptBlockError(f"unreadable: {e}") from e
        if set(tensors) != {"keys", "values"}:
            raise CorruptBlockError(f"tensors {sorted(tensors)}")
        keys, values = tensors["keys"], tensors["values"]
        self._check_tensors(keys, values, meta, block_hash)
        if meta.get("checksum") != _checksum(keys, values):
            raise CorruptBlockError("checksum mismatch")
        return keys, values

    def _check_tensors(self, keys, values, meta: dict, block_hash: BlockHash) -> None:
        expected = self._metadata(block_hash, keys.shape)
        for field, want in expected.items():
            if meta.get(field) != want:
                raise CorruptBlockError(f"metadata {field}={meta.get(field)!r}, expected {want!r}")
        shape = keys.shape
        if keys.dtype != self._np_dtype or values.dtype != self._np_dtype:
            raise CorruptBlockError(f"stored dtype {keys.dtype}/{values.dtype}")
        if len(shape) != 4 or shape[0] != self.num_layers or shape[2] != self.block_size:
            raise CorruptBlockError(f"shape {shape}")
        if values.shape != shape:
            raise CorruptBlockError(f"values shape {values.shape} != keys shape {shape}")

    def _to_mx(self, a: np.ndarray) -> mx.array:
        out = mx.array(a)
        return out.view(mx.bfloat16) if self.dtype == "bfloat16" else out

    def _touch(self, block_hash: BlockHash, path: Path) -> None:
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        try:
            os.utime(path)  # so a restart keeps roughly this LRU order
        except OSError:
            pass

    def _forget(self, block_hash: BlockHash) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._stats.blocks_held -= 1
                self._stats.bytes_held -= size

    def _discard_corrupt(self, block_hash: BlockHash, path: Path, why: str) -> None:
        self._forget(block_hash)
        with self._lock:
            self._stats.corrupt += 1
            self.last_error = f"corrupt block {block_hash.hex()[:16]}: {why}"
        try:
            _unlink(path)
        except OSError:
            pass  # read-only: it stays, and fails again next time

    def cache_blocks(self, block_hashes: Sequence[BlockHash], read: ReadKV) -> None:
        """Write-through: queue every block not already on disk or queued."""
        wanted = [i for i, h in enumerate(block_hashes) if self._wants(h)]
        if not wanted:
            return
        blocks = read()
        for i in wanted:
            self.store(block_hashes[i], blocks[i])

    def evict_block(self, block_hash: BlockHash, read: ReadKV) -> None:
        """Spill: the block leaves the pool; keep a copy unless we have one."""
        if self._wants(block_hash):
            self.store(block_hash, read()[0], spill=True)

    def _wants(self, block_hash: BlockHash) -> bool:
        if not self.writable:
            return False
        with self._lock:
            if block_hash in self._index or block_hash in self._pending:
                return False
            if self._pending_bytes >= self.max_pending_bytes:
                self.dropped_writes += 1  # skip even the read
                return False
        return True

    def store(self, block_hash: BlockHash, kv: BlockKV, *, spill: bool = False) -> bool:
        """Queue a background write of one block's K/V; False if it was not queued.

        Converts to numpy here, on the caller's thread: the writer thread
        never touches an MLX array. Never blocks on the disk.
        """
        self._path(block_hash)  # validates the hash
        if not self.writable:
            if self._closed:
                with self._lock:
                    self.dropped_writes += 1
            return False
        job = _Write(block_hash, self._to_numpy(kv.keys), self._to_numpy(kv.values), spill)
        with self._lock:
            if block_hash in self._index or block_hash in self._pending:
                if block_hash in self._index:
                    self._index.move_to_end(block_hash)
                return False
            if self._pending_bytes + job.nbytes > self.max_pending_bytes:
                self.dropped_writes += 1
                return False
            self._pending[block_hash] = job.nbytes
            self._pending_bytes += job.nbytes
        self._queue.put(job)
        return True

    def _to_numpy(self, a: mx.array) -> np.ndarray:
        if a.dtype != self._mx_dtype:
            raise ValueError(f"disk tier holds {self.dtype} KV, got {a.dtype}")
        shape = tuple(a.shape)
        if len(shape) != 4 or shape[0] != self.num_layers or shape[2] != self.block_size:
            want = f"[{self.num_layers}, heads, {self.block_size}, head_dim]"
            raise ValueError(f"expected KV of shape {want}, got {list(shape)}")
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
                    self._pending.pop(job.block_hash, None)
                    self._pending_bytes -= job.nbytes
                    self._lock.notify_all()

    def _write(self, job: _Write) -> None:
        if self.budget_bytes is not None and job.nbytes > self.budget_bytes:
            with self._lock:
                self.dropped_writes += 1
            return
        if not self._enough_space(job.nbytes):
            return
        meta = self._metadata(job.block_hash, job.keys.shape)
        meta["checksum"] = _checksum(job.keys, job.values)
        data = safetensors.numpy.save({"keys": job.keys, "values": job.values}, metadata=meta)
        path = self._path(job.block_hash)
        self._write_atomic(path, data)
        with self._lock:
            old = self._index.pop(job.block_hash, None)
            self._index[job.block_hash] = len(data)
            self._stats.blocks_held += old is None
            self._stats.bytes_held += len(data) - (old or 0)
            self._stats.stores += 1
            self._stats.spills += job.spill
        self._enforce_budget()

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
            _make_private_dirs(shard)
            _fsync_dir(shard.parent)
        tmp = shard / f".{path.name[:64]}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
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
                _unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(shard)

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
                victim, size = self._index.popitem(last=False)
                self._stats.blocks_held -= 1
                self._stats.bytes_held -= size
                self._stats.evictions += 1
            try:
                _unlink(self._path(victim))
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


# -- CLI helpers (mlxkv cache info | clear) ----------------------------------


def _block_files(fp_dir: Path):
    """(path, size) of every block file under one fingerprint directory."""
    for shard in os.scandir(fp_dir):
        if not (shard.is_dir(follow_symlinks=False) and len(shard.name) == 2):
            continue
        for entry in os.scandir(shard.path):
            if _BLOCK_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                try:
                    yield Path(entry.path), entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue


def _fingerprint_dirs(root: Path) -> list[Path]:
    return sorted(
        Path(e.path) for e in os.scandir(root) if _HEX64.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
    )


def cache_info(directory: str | os.PathLike) -> dict:
    """Blocks and bytes per model fingerprint under a disk cache directory."""
    root = Path(directory).expanduser()
    info = {"directory": str(root), "exists": root.is_dir(), "fingerprints": {}, "blocks": 0, "bytes": 0}
    if not info["exists"]:
        return info
    for fp_dir in _fingerprint_dirs(root):
        files = list(_block_files(fp_dir))
        entry = {"blocks": len(files), "bytes": sum(size for _, size in files)}
        info["fingerprints"][fp_dir.name] = entry
        info["blocks"] += entry["blocks"]
        info["bytes"] += entry["bytes"]
    return info


def _looks_like_cache(root: Path) -> bool:
    marker = root / MARKER
    if marker.is_file():
        try:
            return "mlxkv" in marker.read_text(errors="replace")
        except OSError:
            return False
    entries = list(os.scandir(root))
    fingerprint_dirs = [e for e in entries if _HEX64.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    return bool(entries) and len(fingerprint_dirs) == len(entries)


def cache_clear(directory: str | os.PathLike) -> int:
    """Delete every mlxkv block file (and temp file) under `directory`; returns blocks removed.

    Refuses (ValueError) a directory that does not look like an mlxkv disk cache.
    Anything else in it is left alone.
    """
    root = Path(directory).expanduser()
    if not root.exists():
        return 0
    if not root.is_dir() or not _looks_like_cache(root):
        raise MlxkvError(f"{root} does not look like an mlxkv disk cache; not clearing it")
    removed = 0
    for fp_dir in _fingerprint_dirs(root):
        for path, _ in list(_block_files(fp_dir)):
            removed += _unlink(path)
        for path in fp_dir.glob("**/.*.tmp"):
            if _TEMP_NAME.fullmatch(path.name):
                _unlink(path)
        for shard in fp_dir.iterdir():
            if shard.is_dir() and len(shard.name) == 2:
                _rmdir_if_empty(shard)
        _rmdir_if_empty(fp_dir)
    return removed


def _rmdir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
