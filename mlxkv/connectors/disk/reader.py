"""Reading blocks back from the SSD tier: files into MLX buffers, verified.

Each file is read into the MLX buffer its blocks will live in and checked
there, on reader threads that drop the GIL for both. The caller's thread
(the engine thread), the only one that makes MLX arrays, allocates the
buffers and makes views of them; the reader threads touch nothing of MLX's
but numpy views of those buffers, which are writable by design.

How a file is read is the OS's backend (file_io.py: O_DIRECT on Linux,
F_NOCACHE on macOS). Through the cache, or on macOS, a file is read
straight into its buffer. With O_DIRECT on Linux it lands in the thread's
huge-page ReadBuffer first (the device reads those much faster; see
read_buffer.py), so the reads start before the buffers exist and wait for
them only to copy.

Trust: a read checks every metadata field and the checksum of the tensor
bytes; a bad file is counted corrupt, deleted, and the load stops there.
A file another process removed or replaced is just a miss.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlxkv.cache.block_kv import KVRun
from mlxkv.cache.hashing import BlockHash
from mlxkv.cache.connector import LoadedBlock
from mlxkv.connectors.disk import cache_dir, run_file
from mlxkv.connectors.disk.file_io import choose_io
from mlxkv.connectors.disk.index import DiskIndex
from mlxkv.connectors.disk.read_buffer import ReadBuffer, huge_pages_available
from mlxkv.connectors.disk.run_file import CorruptBlockError, FileSpec
from mlxkv.connectors.disk.scan import DirectoryScanner
from mlxkv.connectors.staged import Staged

# Files read and verified at once during a hydrate (reads, copies and
# checksums drop the GIL): enough to keep most of a 4k-token prefix's files
# in flight (docs/tiers.md has the measurements). On Linux each keeps a
# huge-page ReadBuffer the size of a file, so up to 48 MiB while open.
READ_THREADS = 12


@dataclass(slots=True)
class FileRead:
    """Blocks wanted from one file (of `size` bytes): `block_hashes` from position `pos` on."""

    name: BlockHash
    pos: int
    size: int
    block_hashes: list[BlockHash] = field(default_factory=list)


class RunReader:
    def __init__(self, spec: FileSpec, mx_dtype: mx.Dtype, index: DiskIndex, scanner: DirectoryScanner,
                 readers: Executor, tier_name: str, io=None):
        self.spec, self.mx_dtype = spec, mx_dtype
        self.index, self.scanner, self.readers = index, scanner, readers
        self.tier_name = tier_name
        self.io = io or choose_io()  # the OS's read backend (file_io.py)
        self.direct_io: bool | None = None  # reads bypass the page cache (learnt on the first read)
        self.huge_pages = self.io.huge_pages and huge_pages_available()
        self._read_buffers = threading.local()  # each reader thread's ReadBuffer

    def load(self, block_hashes: Sequence[BlockHash]) -> list[LoadedBlock]:
        """The leading run of blocks that are on disk and pass verification."""
        plan = self.plan(block_hashes)
        if len(plan) > 1 and self.direct_io is False:
            self.readers.submit(self.io.prefetch, [self.scanner.path(job.name) for job in plan])
        buffers = [Future() for _ in plan]
        reads = [self.readers.submit(self._read, job, buffer) for job, buffer in zip(plan, buffers)]
        try:
            for buffer, allocated in zip(buffers, self.buffers(plan)):
                buffer.set_result(allocated)
        except BaseException as e:
            for buffer in buffers:
                if not buffer.done():
                    buffer.set_exception(e)  # readers waiting for it stop
            raise
        loaded = []
        for job, buffer, read in zip(plan, buffers, reads):
            # Side effects happen here, in order, up to the first bad file:
            # files read ahead past it are dropped untouched.
            data, problem = read.result()
            if data is None:
                if problem is None:  # gone or replaced (the other process, or budget): a miss
                    self.index.forget(job.name)
                else:
                    self.discard_corrupt(job.name, problem)
                break
            blocks = self._take(job, data, buffer.result()[0])
            if blocks:
                self.touch(job.name)
            loaded += blocks
            if len(blocks) < len(job.block_hashes):
                break
        self.index.count(hydrations=len(loaded))
        return loaded

    def stage(self, block_hashes: Sequence[BlockHash]) -> list[Staged]:
        """`load` for the loader thread: the leading blocks read into numpy memory and verified; no MLX.

        The engine thread makes them MLX later, a slice a step (connectors/staged.py).
        """
        plan = self.plan(block_hashes)
        if len(plan) > 1 and self.direct_io is False:
            self.readers.submit(self.io.prefetch, [self.scanner.path(job.name) for job in plan])
        reads = [self.readers.submit(self._read, job, _ready(_aligned(job.size))) for job in plan]
        staged: list[Staged] = []
        for job, read in zip(plan, reads):
            data, problem = read.result()
            if data is None:
                if problem is None:
                    self.index.forget(job.name)
                else:
                    self.discard_corrupt(job.name, problem)
                break
            pos, n = self._match(job, data)
            if n:
                self.touch(job.name)
                staged.append(Staged(data.keys, data.values, pos, list(job.block_hashes[:n]), data.group))
            if n < len(job.block_hashes):
                break
        for read in reads:
            read.cancel()  # files past a bad one are not wanted
        self.index.count(hydrations=sum(len(s.hashes) for s in staged))
        return staged

    def plan(self, block_hashes: Sequence[BlockHash]) -> list[FileRead]:
        """The file reads that cover the leading indexed blocks, one per stretch of a file."""
        plan: list[FileRead] = []
        for i, block_hash in enumerate(block_hashes):
            where = self.index.locate(block_hash)
            if where is None and self.scanner.adopt(block_hashes, i):
                where = self.index.locate(block_hash)
            if where is None:
                break
            name, pos = where
            last = plan[-1] if plan else None
            if last is None or last.name != name or last.pos + len(last.block_hashes) != pos:
                entry = self.index.entry(name)
                if entry is None:
                    break  # deleted for the budget meanwhile
                last = FileRead(name, pos, entry.size)
                plan.append(last)
            last.block_hashes.append(block_hash)
        return plan

    def buffers(self, plan: list[FileRead]) -> list[tuple[mx.array, np.ndarray]]:
        """New MLX buffers for the files, made in one eval, each with a numpy view where its file goes.

        A view starts ALIGN-aligned, as O_DIRECT wants.
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

    def _read(self, job: FileRead, buffer: Future) -> tuple[run_file.RunData | None, str | None]:
        """(the file's run, verified, None), (None, None) if it is gone or replaced, or
        (None, why it is corrupt). No side effects but learning whether O_DIRECT works here."""
        try:
            data, direct = run_file.read_into(self.scanner.path(job.name), lambda: buffer.result()[1], job.size,
                                              self._read_buffer(), self.io)
        except OSError:
            return None, None
        if data is None:
            return None, None
        self.direct_io = direct
        try:
            run = run_file.decode(self.spec, data, job.name)
            run.verify()
        except CorruptBlockError as e:
            return None, str(e)
        return run, None

    def _read_buffer(self) -> ReadBuffer | None:
        """This reader thread's buffer for O_DIRECT reads, where huge pages make it pay."""
        if not self.huge_pages:
            return None
        buffer = getattr(self._read_buffers, "buffer", None)
        if buffer is None:
            buffer = self._read_buffers.buffer = ReadBuffer()
        return buffer

    def _match(self, job: FileRead, data: run_file.RunData) -> tuple[int, int]:
        """(where in the file's run the wanted blocks start, how many of them it holds).

        The header, not the index, says where a block is: another process
        may have replaced the file with a longer or shorter run since.
        """
        hashes, first = data.block_hashes, job.block_hashes[0]
        pos = hashes.index(first) if first in hashes else 0
        n = 0
        while n < len(job.block_hashes) and pos + n < len(hashes) and hashes[pos + n] == job.block_hashes[n]:
            n += 1
        if n == 0 or pos != job.pos:
            self.index.add(job.name, job.size, hashes)  # re-index from the header
        return pos, n

    def _take(self, job: FileRead, data: run_file.RunData, buf: mx.array) -> list[LoadedBlock]:
        """The wanted blocks of a verified file, as views of its run in `buf`."""
        pos, n = self._match(job, data)
        if n == 0:
            return []
        base = np.array(buf, copy=False).ctypes.data
        run = KVRun(self._mx_view(buf, base, data.keys), self._mx_view(buf, base, data.values))
        return [LoadedBlock(h, run.block(pos + i, data.group), self.tier_name)
                for i, h in enumerate(job.block_hashes[:n])]

    def _mx_view(self, buf: mx.array, base: int, tensor: np.ndarray) -> mx.array:
        """The MLX view of `buf` that `tensor` (a numpy view of it) is; bfloat16 comes back from its bits here."""
        at = tensor.ctypes.data - base
        return buf[at : at + tensor.nbytes].view(self.mx_dtype).reshape(tensor.shape)

    def touch(self, name: BlockHash) -> None:
        self.index.touch(name)
        try:
            os.utime(self.scanner.path(name))  # so a restart keeps roughly this LRU order
        except OSError:
            pass

    def discard_corrupt(self, name: BlockHash, why: str) -> None:
        self.index.note_corrupt(name, why)
        try:
            cache_dir.unlink(self.scanner.path(name))
        except OSError:
            pass  # read-only: it stays, and fails again next time


def _aligned(size: int) -> np.ndarray:
    """Numpy memory for a file of `size` bytes, ALIGN-aligned and padded as O_DIRECT wants."""
    padded = -(-size // run_file.ALIGN) * run_file.ALIGN
    whole = np.empty(padded + run_file.ALIGN, np.uint8)
    at = -whole.ctypes.data % run_file.ALIGN
    return whole[at : at + padded]


def _ready(view: np.ndarray) -> Future:
    """A buffer future already resolved, in the (MLX buffer, numpy view) form `_read` takes."""
    done = Future()
    done.set_result((None, view))
    return done
