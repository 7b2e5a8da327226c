"""Writing the SSD tier: one background thread, atomic files, a byte budget.

The engine thread turns MLX arrays into numpy copies before a write is
queued, so this thread never touches an MLX array and decode never waits
for the disk. Each write serialises a run, writes a temp file, fsyncs it
and renames it into place; a block becomes visible to lookups only once
its file's rename is done. Atomic renames plus the checksum are what make
two processes sharing one directory safe.

Then the budget: least recently used files are deleted until the tier's
bytes fit. The free-space floor (`min_free_bytes`) is kept the same way: a
write that would leave less free first deletes least recently used files,
and is skipped and counted only when none are left to delete.

Health (connectors/health.py): a write that fails or is skipped makes the
tier read-only (EROFS, EACCES) or dropping writes (a full disk, out of
inodes, over quota, the floor), with the reason, in one WARNING line; a
write that works later makes it ok again.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue

import numpy as np

from mlxkv.cache.hashing import BlockHash
from mlxkv.connectors.disk import cache_dir, run_file
from mlxkv.connectors.disk.index import DiskIndex
from mlxkv.connectors.disk.run_file import FileSpec
from mlxkv.connectors.disk.scan import DirectoryScanner
from mlxkv.connectors.health import DROPPING, READ_ONLY, TierHealth
from mlxkv.system.private_files import FILE_MODE, make_private_dirs

log = logging.getLogger(__name__)


@dataclass(slots=True)
class WriteJob:
    block_hashes: tuple[BlockHash, ...]
    keys: np.ndarray  # [num_layers, n, heads, block_size, head_dim]
    values: np.ndarray
    spill: bool
    group: int = 0  # the blocks' layer group

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def encode(self, spec: FileSpec) -> bytes:
        return run_file.encode(spec, self.block_hashes, self.keys, self.values, self.group)


class RunWriter:
    def __init__(self, root: Path, spec: FileSpec, index: DiskIndex, scanner: DirectoryScanner,
                 budget_bytes: int | None, min_free_bytes: int, health: TierHealth):
        self.root = root
        self.health = health
        self.dir = scanner.dir
        self.spec, self.index, self.scanner = spec, index, scanner
        self.budget_bytes = budget_bytes
        self.min_free_bytes = min_free_bytes
        self._queue: SimpleQueue[WriteJob | None] = SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="mlxkv-disk-writer", daemon=True)
        self._thread.start()

    def submit(self, job: WriteJob) -> None:
        self._queue.put(job)

    def stop(self) -> None:
        """Finish every queued write, then end the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(job)
            except OSError as e:  # the disk said no: counted, said once, and the tier goes on
                log.debug("SSD tier write failed", exc_info=True)
                self._count_write_error(e)
                self.health.trouble(*write_trouble(e, self.dir))
            except Exception as e:  # a bug: never let the writer die of it
                log.exception("SSD tier writer failed on a write")
                self._count_write_error(e)
            finally:
                self.index.settle(job.block_hashes, job.nbytes)

    def _write(self, job: WriteJob) -> None:
        if self.budget_bytes is not None and job.nbytes > self.budget_bytes:
            self.index.note_dropped()
            return
        self._start_again_if_cleared()
        if not self._enough_space(job.nbytes):
            return
        data = job.encode(self.spec)  # a block run, or a checkpoint (state_file.StateJob)
        name = job.block_hashes[-1]
        self.write_atomic(self.scanner.path(name), data)
        self.health.fine()
        self.index.add(name, len(data), job.block_hashes)
        self.index.count(stores=len(job.block_hashes), spills=len(job.block_hashes) if job.spill else 0)
        self.enforce_budget()

    def _start_again_if_cleared(self) -> None:
        """`mlxkv cache clear` in another process removed our directory: every
        file indexed is gone, and every later write would fail (the space
        check first) for the rest of this process. Forget them and make it again."""
        if self.dir.is_dir():
            return
        self.index.forget_all()
        self.scanner.forget_shards()
        make_private_dirs(self.dir)
        cache_dir.write_marker(self.root)

    def _enough_space(self, nbytes: int) -> bool:
        """Would the write leave at least `min_free_bytes` free, once least recently used files
        are deleted as needed? (0: no floor.)"""
        if self.min_free_bytes <= 0:
            return True
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError as e:
            self._count_write_error(e)
            return False
        short = self.min_free_bytes + nbytes - free
        if short <= 0 or self._delete_lru(short) >= short:
            return True
        why = f"{_mb(free)} free is under the floor of {_mb(self.min_free_bytes)} (--disk-tier-min-free-mb)"
        self.index.note_error(why, low_space=True)
        self.health.trouble(DROPPING, f"{why}, and the tier has no file left to delete: {self.root}")
        return False

    def _delete_lru(self, nbytes: int) -> int:
        """Delete least recently used files until about `nbytes` are freed; the bytes freed."""
        freed = 0
        while freed < nbytes and (victim := self.index.pop_lru()) is not None:
            name, blocks, size = victim
            self.index.count(evictions=blocks)
            try:
                cache_dir.unlink(self.scanner.path(name))
            except OSError as e:
                self._count_write_error(e)
                break
            freed += size
        return freed

    def write_atomic(self, path: Path, data: bytes) -> None:
        shard = path.parent
        if not shard.is_dir():
            make_private_dirs(shard)
            cache_dir.fsync_dir(shard.parent)
        tmp = cache_dir.temp_path(shard, path.name)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
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
        name = errno.errorcode.get(getattr(e, "errno", None) or 0, type(e).__name__)
        self.index.note_error(f"write failed ({name}): {e}")

    def enforce_budget(self) -> None:
        """Delete least recently used files until the budget holds."""
        if self.budget_bytes is None:
            return
        while (victim := self.index.lru_victim(self.budget_bytes)) is not None:
            name, blocks = victim
            self.index.count(evictions=blocks)
            try:
                cache_dir.unlink(self.scanner.path(name))
            except OSError as e:
                self._count_write_error(e)


def write_trouble(e: OSError, directory: Path) -> tuple[str, str]:
    """The state a failed write leaves the tier in, and why."""
    code = e.errno
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return READ_ONLY, f"{e.strerror or e}: {directory}"
    if code == errno.ENOSPC:
        there = next((p for p in (directory, *directory.parents) if p.exists()), directory)
        try:
            st = os.statvfs(there)
            inodes = st.f_files > 0 and st.f_favail == 0
        except OSError:
            inodes = False
        return DROPPING, f"{'out of inodes' if inodes else 'the disk is full'} ({e.strerror}): {directory}"
    if code == errno.EDQUOT:
        return DROPPING, f"over the disk quota ({e.strerror}): {directory}"
    return DROPPING, f"write failed ({errno.errorcode.get(code or 0, type(e).__name__)}): {e.strerror or e}: {directory}"


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
