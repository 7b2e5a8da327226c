"""The SSD tier: safetensors files of block runs, content-addressed by hash.

One file per run of consecutive blocks, named after its last block's hash,
under a directory per model fingerprint (cache_dir.py has the layout,
run_file.py the format). Every directory this tier creates is 0700 and
every file 0600. This module is the connector protocol over four parts,
each with its own thread rule:

- index.py: what is on disk and in flight, and the tier's one lock;
- scan.py: the index rebuilt at start, and other processes' new files;
- reader.py: hydrates, on reader threads, into MLX buffers made here,
  or (`begin_load`) into numpy memory for the engine's loader thread;
- writer.py: atomic writes and the byte budget, on one writer thread.
"""

from __future__ import annotations

import errno
import os
import shutil
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from mlxkv.cache.block_kv import BlockKV
from mlxkv.cache.hashing import BlockHash
from mlxkv.cache.tiers import DISK
from mlxkv.cache.connector import CheckpointLoad, LoadedBlock, LoadedCheckpoint, ReadKV
from mlxkv.connectors.disk import cache_dir, run_file, state_file
from mlxkv.connectors.disk.index import DiskIndex
from mlxkv.connectors.disk.kv_arrays import file_spec, to_numpy
from mlxkv.connectors.disk.reader import READ_THREADS, RunReader
from mlxkv.connectors.disk.scan import DirectoryScanner
from mlxkv.connectors.disk.writer import RunWriter, WriteJob, write_trouble
from mlxkv.connectors.staged import StagedLoad
from mlxkv.connectors.health import DOWN, DROPPING, READ_ONLY, TierHealth
from mlxkv.errors import MlxkvWarning
from mlxkv.system.private_files import make_private_dirs

# The free-space floor, when none is given: this share of the disk, at
# most MAX_MIN_FREE_BYTES (so a 20 MB disk keeps 1 MB free, not 1 GiB).
MIN_FREE_SHARE = 0.05
MAX_MIN_FREE_BYTES = 1 << 30
DEFAULT_MAX_PENDING_BYTES = 256 << 20
BUDGET_SHARE = 4  # a file is at most a quarter of the byte budget

class DiskCacheWarning(MlxkvWarning):
    """The disk tier could not use its directory: it drops writes (a full disk), runs read-only, or is off."""


def _consecutive(indices: list[int], limit: int, groups: list[int]) -> list[list[int]]:
    """Split indices into stretches of consecutive values of one group (by index), at most `limit` long."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][-1] + 1 == i and len(out[-1]) < limit and groups[i] == groups[out[-1][-1]]:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class DiskKVCacheConnector:
    """A KV cache connector that keeps blocks as files on local SSD.

    Writes are queued (`store`, `cache_blocks`, `evict_blocks`) and done by a
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
        min_free_bytes: int | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        tier_name: str = DISK,
        read_io=None,
        page: tuple[int, int, int, int] | None = None,
        kv_format: str | None = None,
    ):
        if not isinstance(fingerprint, bytes) or len(fingerprint) != cache_dir.HASH_LEN:
            raise ValueError("the model fingerprint must be 32 bytes")
        if block_size < 1 or num_layers < 0:  # no layers: a model of state slots alone (checkpoints)
            raise ValueError("block_size must be positive and num_layers not negative")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0 (or None for no budget)")
        self.root = Path(directory).expanduser()
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.num_layers = num_layers
        self.spec, self._mx_dtype = file_spec(fingerprint, block_size, num_layers, dtype, page, kv_format)
        self.dtype = self.spec.dtype
        self.budget_bytes = budget_bytes
        self.max_pending_bytes = max_pending_bytes
        self.tier_name = tier_name
        self.dir = self.root / fingerprint.hex()
        self.read_only = False
        self.disabled = False
        self.reason: str | None = None
        self._closed = False
        self.tier_health = TierHealth("SSD tier")
        # Bytes/s a load job's read is slowed to (a slow disk's speed): the bench's and tests' knob only.
        self.read_throttle: float | None = None

        self.index = DiskIndex()
        self._readers = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="mlxkv-disk-read")
        self.scanner = DirectoryScanner(self.dir, self.index, self._readers, lambda: self.read_only)
        self.reader = RunReader(self.spec, self._mx_dtype, self.index, self.scanner, self._readers, tier_name,
                                read_io)
        self.writer = RunWriter(self.root, self.spec, self.index, self.scanner, budget_bytes,
                                self._floor(min_free_bytes), self.tier_health)
        self._open_directory()
        if self.writable:
            self.writer.start()

    # -- start-up ------------------------------------------------------------

    def _open_directory(self) -> None:
        try:
            make_private_dirs(self.dir)
        except OSError as e:
            if not self.dir.is_dir():
                if e.errno in (errno.ENOSPC, errno.EDQUOT):  # full: the writer makes it once there is room
                    self._probe_failed(e)
                else:
                    self._degrade(e, disabled=True)
                return
        try:
            self._probe_write()
        except OSError as e:
            self._probe_failed(e)
        try:
            self.scanner.scan()
        except OSError as e:
            self._degrade(e, disabled=True)
            return
        if not self.read_only:
            cache_dir.write_marker(self.root)
            self.writer.enforce_budget()

    def _floor(self, min_free_bytes: int | None) -> int:
        """The free-space floor: as given, else scaled to the disk."""
        if min_free_bytes is not None:
            return min_free_bytes
        there = next((p for p in (self.dir, *self.dir.parents) if p.exists()), self.dir)
        try:
            total = shutil.disk_usage(there).total
        except OSError:
            return MAX_MIN_FREE_BYTES
        return min(MAX_MIN_FREE_BYTES, int(total * MIN_FREE_SHARE))

    def _probe_failed(self, error: OSError) -> None:
        """A directory we cannot write to: read-only if the disk says no for good, else
        (full, out of inodes, over quota) writable, dropping writes until there is room."""
        state, reason = write_trouble(error, self.root)
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            self._degrade(error, disabled=False)
            return
        self.tier_health.start(state, reason)
        warnings.warn(f"mlxkv: SSD tier dropping writes: {reason}", DiskCacheWarning, stacklevel=5)

    def _degrade(self, error: OSError, *, disabled: bool) -> None:
        self.read_only = True
        self.disabled = disabled
        # The OS's reason first, then the directory the user gave, not the
        # fingerprint one under it: 64 hex digits would push the reason off
        # the chat app's notification.
        self.reason = f"{error.strerror or error}: {self.root}"
        mode = "disabled" if disabled else "read-only"
        self.tier_health.start(DOWN if disabled else READ_ONLY, self.reason)
        warnings.warn(f"mlxkv: SSD tier {mode}: {self.reason}", DiskCacheWarning, stacklevel=4)

    def _probe_write(self) -> None:
        probe = cache_dir.temp_path(self.dir, '0' * 64)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)

    # -- the connector protocol ----------------------------------------------

    @property
    def writable(self) -> bool:
        return not self.read_only and not self._closed

    def contains(self, block_hash: BlockHash) -> bool:
        """True if the block is on disk (written and indexed), not merely queued."""
        return self.index.contains(block_hash)

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        if self.disabled:
            return 0
        n = 0
        for i, block_hash in enumerate(block_hashes):
            found = self.index.contains(block_hash) or self.scanner.adopt(block_hashes, i)
            if not found and self.scanner.rescan():
                found = self.index.contains(block_hash)
            if not found:
                break
            n += 1
        self.index.count(lookups=1, hit_blocks=n, hit_tokens=n * self.block_size)
        return n

    def load_blocks(self, block_hashes: Sequence[BlockHash]) -> list[LoadedBlock]:
        """The leading run of blocks that are on disk and pass verification (reader.py)."""
        if self.disabled or not block_hashes:
            return []
        return self.reader.load(block_hashes)

    def begin_load(self, block_hashes: Sequence[BlockHash]) -> StagedLoad:
        """A load job (cache/connector.py's LoadJob): read on the loader thread, made MLX on the engine thread."""
        hashes = [] if self.disabled else list(block_hashes)
        return StagedLoad(self.tier_name, self._mx_dtype, lambda: self.reader.stage(hashes) if hashes else [],
                          self.read_throttle)

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
        for run in _consecutive(wanted, per_file, [kv.group for kv in blocks]):
            self.store_run([block_hashes[i] for i in run], [blocks[i] for i in run])

    def wants_spill(self, block_hash: BlockHash) -> bool:
        return self._wants(block_hash)

    def evict_blocks(self, block_hashes: Sequence[BlockHash], read: ReadKV) -> None:
        """Spill: the blocks leave the pool; keep a copy of those we have none of."""
        wanted = [i for i, h in enumerate(block_hashes) if self._wants(h)]
        if not wanted:
            return
        blocks = read()
        for i in wanted:
            self.store(block_hashes[i], blocks[i], spill=True)

    # -- recurrent-state checkpoints: a file each (state_file.py) ------------

    def has_checkpoint(self, key: BlockHash) -> bool:
        if self.disabled:
            return False
        return self.index.contains(key) or self.scanner.adopt([key], 0)

    def load_checkpoint(self, key: BlockHash) -> LoadedCheckpoint | None:
        """The checkpoint's states, or None (gone, or corrupt: then removed and counted)."""
        job = self.begin_checkpoint_load(key)
        job.run()
        return job.take()

    def begin_checkpoint_load(self, key: BlockHash) -> CheckpointLoad:
        """A checkpoint load (cache/connector.py): read and verified on the loader thread,
        made MLX on the engine thread."""
        return CheckpointLoad(key, self.tier_name, lambda: self._stage_checkpoint(key), self._take_checkpoint)

    def _stage_checkpoint(self, key: BlockHash) -> state_file.StagedStates | None:
        """Any thread, as the block reader's `stage`: the file read and verified into numpy."""
        where = None if self.disabled else self.index.locate(key)
        if where is None:
            return None
        name, _ = where
        try:
            states = state_file.decode_state(self.spec, np.fromfile(self.scanner.path(name), np.uint8), name)
        except FileNotFoundError:
            self.index.forget(name)
            return None
        except (OSError, run_file.CorruptBlockError) as e:
            self.reader.discard_corrupt(name, str(e))
            return None
        self.reader.touch(name)
        return states

    def _take_checkpoint(self, states: state_file.StagedStates):
        """The engine thread took a staged checkpoint: only then is it a hydration (a load staged for a
        request that was cancelled meanwhile is not), as the block loads count at take."""
        self.index.count(hydrations=1)
        return state_file.mlx_states(states)

    def cache_checkpoint(self, checkpoint) -> None:
        self._store_checkpoint(checkpoint, spill=False)

    def evict_checkpoint(self, checkpoint) -> None:
        self._store_checkpoint(checkpoint, spill=True)

    def checkpoint_refs(self):
        """Checkpoints whose files were found (at start, or another process's) since the last call."""
        return [] if self.disabled else self.index.take_refs()

    def _store_checkpoint(self, checkpoint, spill: bool) -> None:
        if not self._wants(checkpoint.key) or not self.index.fresh([checkpoint.key]):
            return
        job = state_file.state_job(checkpoint, spill)
        if self.index.reserve(job.block_hashes, job.nbytes, self.max_pending_bytes):
            self.writer.submit(job)
        else:
            self._if_queue_full()

    def _wants(self, block_hash: BlockHash) -> bool:
        if not self.writable:
            return False
        if self.index.wants(block_hash, self.max_pending_bytes):
            return True
        self._if_queue_full()
        return False

    def _if_queue_full(self) -> None:
        if self.index.pending_bytes >= self.max_pending_bytes:
            self.tier_health.trouble(DROPPING, f"the write queue is full ({self.max_pending_bytes >> 20} MiB): "
                                               f"the disk is slower than the engine: {self.root}")

    def store(self, block_hash: BlockHash, kv: BlockKV, *, spill: bool = False) -> bool:
        """Queue a background write of one block's K/V; False if it was not queued."""
        return self.store_run([block_hash], [kv], spill=spill)

    def store_run(self, block_hashes: Sequence[BlockHash], kvs: Sequence[BlockKV], *, spill: bool = False) -> bool:
        """Queue a background write of consecutive blocks as one file; False if it was not queued.

        Blocks already on disk or queued are left out. Takes numpy views of
        the MLX arrays here, on the caller's thread (kv_arrays.to_numpy: no
        copy); the writer thread copies them into the file and never calls
        MLX. Never blocks on the disk.
        """
        for block_hash in block_hashes:
            cache_dir.block_path(self.dir, block_hash)  # validates the hash
        if not self.writable:
            if self._closed:
                self.index.note_dropped()
            return False
        if len({kv.group for kv in kvs}) > 1:
            raise ValueError("a run's blocks must belong to one layer group")
        fresh = self.index.fresh(block_hashes)
        if not fresh:
            return False
        keys, values = to_numpy([kvs[i] for i in fresh], self.spec, self._mx_dtype)
        job = WriteJob(tuple(block_hashes[i] for i in fresh), keys, values, spill, kvs[0].group)
        if not self.index.reserve(job.block_hashes, job.nbytes, self.max_pending_bytes):
            self._if_queue_full()
            return False
        self.writer.submit(job)
        return True

    # -- lifecycle and stats -------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False on timeout."""
        return self.index.wait_settled(timeout)

    def close(self) -> None:
        """Drain the queue and stop the writer. Reads keep working."""
        if self._closed:
            return
        self._closed = True
        self.writer.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def min_free_bytes(self) -> int:
        return self.writer.min_free_bytes

    def stats(self) -> dict[str, dict]:
        health = self.index.health()
        return {self.tier_name: {**self.index.stats_dict(), **self.tier_health.as_dict(),
                                 "dropped_writes": health["dropped_writes"],
                                 "low_space_skips": health["low_space_skips"]}}

    def health(self) -> dict:
        """What `stats()` has no field for: mode, drops and the last error."""
        return {
            "directory": str(self.dir),
            "read_backend": self.reader.io.name,
            "read_only": self.read_only,
            "disabled": self.disabled,
            "reason": self.reason,
            "state": self.tier_health.state,
            "min_free_bytes": self.writer.min_free_bytes,
            **self.index.health(),
        }
