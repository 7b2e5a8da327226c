"""Finding the SSD tier's files: at start, and those other processes write meanwhile.

At start the index is rebuilt from names, sizes, mtimes and headers;
contents are verified lazily, on read. A file's header (read on the reader
threads) lists the hashes of the blocks in its run; one whose header lists
none is indexed under its name alone, and counted corrupt when read.

Files another process writes while this one runs are found on a lookup
miss: by name when the lookup reaches a run's last block (`adopt`), else
by listing again the shard directories whose mtime changed (`rescan`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path

from mlxkv.cache.hashing import BlockHash
from mlxkv.connectors.disk import cache_dir, run_file, state_file
from mlxkv.connectors.disk.index import DiskIndex
from mlxkv.connectors.disk.run_file import MAX_RUN_BLOCKS, CorruptBlockError

RESCAN_INTERVAL_S = 1.0  # a lookup miss looks for other processes' new files at most this often

Found = tuple[float, BlockHash, int]  # (mtime, file name, size)


class DirectoryScanner:
    def __init__(self, directory: Path, index: DiskIndex, readers: Executor, read_only: Callable[[], bool]):
        self.dir = directory
        self.index = index
        self.readers = readers
        self.read_only = read_only
        self.rescan_interval = RESCAN_INTERVAL_S
        self.next_rescan = 0.0
        self._shard_mtimes: dict[str, int] = {}  # shard dir -> mtime_ns when last listed

    def path(self, name: BlockHash) -> Path:
        return cache_dir.block_path(self.dir, name)

    def scan(self) -> None:
        """Index the files already on disk (oldest mtime first); drop dead temps. Raises OSError."""
        found = []
        for entry in os.scandir(self.dir):
            if entry.is_file(follow_symlinks=False):
                self._maybe_remove_temp(Path(entry.path))
            elif cache_dir.is_shard(entry):
                self._shard_mtimes[entry.name] = entry.stat(follow_symlinks=False).st_mtime_ns
                found.extend(self._scan_shard(entry.path, entry.name))
        self._index_found(found)

    def forget_shards(self) -> None:
        """The directory was cleared: list every shard again when it reappears."""
        self._shard_mtimes.clear()

    def rescan(self) -> bool:
        """Index the files other processes added since we last looked; True if any.

        A run is named after its last block, so a lookup that stops inside
        another process's run cannot guess its name (`adopt`). Creating a
        file changes its shard directory's mtime: only changed shards are
        listed again, at most once per `rescan_interval`, on a miss.
        """
        now = time.monotonic()
        if now < self.next_rescan:
            return False
        self.next_rescan = now + self.rescan_interval
        try:
            entries = list(os.scandir(self.dir))
        except OSError:
            return False
        found = []
        for entry in entries:
            if cache_dir.is_shard(entry):
                found += self._changed_shard(entry)
        self._index_found(found)
        return bool(found)

    def _changed_shard(self, entry: os.DirEntry) -> list[Found]:
        try:
            mtime = entry.stat(follow_symlinks=False).st_mtime_ns
        except OSError:
            return []
        if self._shard_mtimes.get(entry.name) == mtime:
            return []
        self._shard_mtimes[entry.name] = mtime
        try:
            return self._scan_shard(entry.path, entry.name, known=self.index.has_file)
        except OSError:
            return []  # unreadable now: a miss, as before

    def adopt(self, block_hashes: Sequence[BlockHash], i: int) -> bool:
        """Index a file another process wrote since our scan that holds block i.

        Runs are consecutive blocks named after their last, so such a file is
        named after one of the next MAX_RUN_BLOCKS hashes: a stat each. A run
        that ends past the lookup's last hash is left to `rescan`.
        """
        for name in block_hashes[i : i + MAX_RUN_BLOCKS]:
            if self.index.has_file(name):
                continue
            try:
                size = os.stat(self.path(name)).st_size
            except OSError:
                continue
            self._add(name, size, self.file_entry(name))
            if self.index.contains(block_hashes[i]):
                return True
        return False

    def file_entry(self, name: BlockHash) -> tuple[tuple[BlockHash, ...] | None, state_file.CheckpointRef | None]:
        """The block hashes a file's header lists (checked when read; None if it lists none),
        and for a checkpoint's file, where the checkpoint sits."""
        try:
            meta = run_file.read_metadata(self.path(name))
            return run_file.listed_hashes(meta, name), state_file.checkpoint_ref(meta, name)
        except (OSError, CorruptBlockError):
            return None, None

    def _add(self, name: BlockHash, size: int, entry) -> None:
        hashes, ref = entry
        self.index.add(name, size, hashes or (name,))
        if ref is not None:
            self.index.learn(ref)

    def _index_found(self, found: list[Found]) -> None:
        """Index files, oldest first, from their headers (read on the reader threads)."""
        found.sort(key=lambda f: f[0])
        names = [name for _, name, _ in found]
        for (_, name, size), entry in zip(found, self.readers.map(self.file_entry, names)):
            self._add(name, size, entry)

    def _scan_shard(self, path: str, prefix: str, known=lambda name: False) -> list[Found]:
        """The block files in a shard, but those `known` (no stat for them)."""
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

    def _maybe_remove_temp(self, path: Path) -> None:
        """Remove a temp file left by a process that is gone (or long stuck)."""
        if self.read_only() or not cache_dir.is_dead_temp(path):
            return
        try:
            cache_dir.unlink(path)
        except OSError:
            pass
