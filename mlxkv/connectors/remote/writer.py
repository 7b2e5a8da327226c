"""The remote tier's own thread: writes, probes while down, and other processes' checkpoints.

The engine thread queues writes as numpy copies (this thread never
touches MLX) and never waits: the queue is bounded in bytes, and a write
that does not fit is dropped and counted (`submit` returns False). Here
each queued write is encoded into the SSD tier's file bytes (run_file.py,
state_file.py) and sent in one pipeline, after one pipelined EXISTS that
leaves out what the server already has (another Mac wrote it first).

Between writes the thread probes a server that is down (link.py), reads
the checkpoint stream for checkpoints other processes wrote (keys.py), and
reads the server's memory use for the stats.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mlxkv.cache.checkpoints import CheckpointRef
from mlxkv.cache.hashing import BlockHash
from mlxkv.connectors.disk import run_file
from mlxkv.connectors.disk.state_file import StateJob
from mlxkv.connectors.health import DROPPING
from mlxkv.connectors.remote.keys import STREAM_LENGTH, KeySpace, parse_ref, ref_entry
from mlxkv.connectors.remote.link import RemoteLink

log = logging.getLogger(__name__)

POLL_S = 1.0  # the checkpoint stream and the server's memory, read this often
STREAM_PAGE = 1000
STOP_TIMEOUT_S = 10.0  # close() waits this long for queued writes, then leaves them


@dataclass(slots=True)
class BlockWrite:
    """Blocks for the server: (key, block hash, keys, values, group), each K/V `[layers, heads, block, dim]`."""

    items: list[tuple[bytes, BlockHash, np.ndarray, np.ndarray, int]]
    nbytes: int = 0

    def __post_init__(self):
        self.nbytes = sum(k.nbytes + v.nbytes for _, _, k, v, _ in self.items)

    @property
    def hashes(self) -> list[BlockHash]:
        return [h for _, h, *_ in self.items]


@dataclass(slots=True)
class StateWrite:
    key: bytes
    job: StateJob

    @property
    def nbytes(self) -> int:
        return self.job.nbytes

    @property
    def hashes(self) -> list[BlockHash]:
        return list(self.job.block_hashes)


@dataclass(slots=True)
class Delete:
    key: bytes
    nbytes: int = 0
    hashes: tuple = ()


@dataclass
class Counters:
    """What the thread and the engine thread count, under one lock."""

    stores: int = 0
    bytes_written: int = 0
    dropped_writes: int = 0
    write_errors: int = 0
    already_there: int = 0  # blocks a write left out: the server had them
    server_bytes: int = 0  # the server's used_memory, as last read
    server_max_bytes: int = 0  # its maxmemory (0: none)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, **increments: int) -> None:
        with self.lock:
            for name, n in increments.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        with self.lock:
            return {k: v for k, v in vars(self).items() if k != "lock"}


_STOP = object()


class RemoteWriter:
    def __init__(self, link: RemoteLink, space: KeySpace, spec: run_file.FileSpec, counters: Counters, *,
                 ttl_s: int | None, max_pending_bytes: int, poll_checkpoints: bool,
                 on_lost: Callable[[list[BlockHash]], None] = lambda hashes: None):
        self.link, self.space, self.spec, self.counters = link, space, spec, counters
        self.on_lost = on_lost  # blocks (or checkpoint keys) a queued write did not get to the server
        self.ttl_s = ttl_s
        self.max_pending_bytes = max_pending_bytes
        self.poll_checkpoints = poll_checkpoints
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._settled = threading.Condition()
        self._pending_bytes = 0
        self._pending_jobs = 0
        self._refs: list[CheckpointRef] = []  # found in the stream, not yet taken
        self._last_id = b"-"
        self._next_poll = 0.0
        self._thread: threading.Thread | None = None

    # -- the engine thread -----------------------------------------------------

    def submit(self, job) -> bool:
        """Queue a write; False (dropped and counted) if the queue is full. Never waits."""
        with self._settled:
            if self._pending_bytes + job.nbytes > self.max_pending_bytes:
                full = True
            else:
                full = False
                self._pending_bytes += job.nbytes
                self._pending_jobs += 1
        if full:
            self.counters.count(dropped_writes=len(job.hashes))
            if self.link.up:
                self.link.health.trouble(DROPPING, f"the write queue is full ({self.max_pending_bytes >> 20} MiB): "
                                         f"the server is slower than the engine ({self.link.where})")
            return False
        self._queue.put(job)
        return True

    def take_refs(self) -> list[CheckpointRef]:
        with self._settled:
            refs, self._refs = self._refs, []
        return refs

    @property
    def pending(self) -> tuple[int, int]:
        with self._settled:
            return self._pending_jobs, self._pending_bytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (or dropped); False on timeout."""
        with self._settled:
            return self._settled.wait_for(lambda: self._pending_jobs == 0, timeout)

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="mlxkv-remote-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Finish queued writes (for up to `timeout`), then end the thread."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    # -- the tier's thread -------------------------------------------------------

    def _loop(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self._wait())
            except queue.Empty:
                job = None
            if job is _STOP:
                return
            try:
                self._between_writes()
                if job is not None:
                    self._write(job)
            except Exception:  # a bug: never let the writer die of it
                log.exception("the remote tier's writer failed")
                if job is not None:
                    self.counters.count(write_errors=1)
            finally:
                if job is not None:
                    self._settle(job)

    def _wait(self) -> float:
        if not self.link.up:
            return max(0.01, self.link.seconds_to_retry())
        return max(0.01, self._next_poll - time.monotonic())

    def _settle(self, job) -> None:
        with self._settled:
            self._pending_bytes -= job.nbytes
            self._pending_jobs -= 1
            self._settled.notify_all()

    def _between_writes(self) -> None:
        if self.link.probe_due:
            self.link.probe()
        if self.link.up and time.monotonic() >= self._next_poll:
            self._next_poll = time.monotonic() + POLL_S
            self._server_memory()
            self.poll(self.link.fetch)

    def _server_memory(self) -> None:
        try:
            info = self.link.writes.info("memory")
        except Exception:  # noqa: BLE001 - an ACL may refuse INFO; the stats then say 0, the writes tell the state
            return
        with self.counters.lock:
            self.counters.server_bytes = int(info.get("used_memory", 0))
            self.counters.server_max_bytes = int(info.get("maxmemory", 0))

    def poll(self, call) -> None:
        """Take the checkpoints other processes added to the stream since the last poll."""
        while self.poll_checkpoints:
            start = self._last_id if self._last_id == b"-" else b"(" + self._last_id
            entries = call(lambda r: r.xrange(self.space.checkpoints, min=start, max="+", count=STREAM_PAGE))
            if not entries:
                return
            refs = [ref for _, fields in entries if (ref := parse_ref(fields.get(b"ref", b""))) is not None]
            with self._settled:
                self._refs += refs
                self._last_id = entries[-1][0]
            if len(entries) < STREAM_PAGE:
                return

    def _write(self, job) -> None:
        if isinstance(job, Delete):
            self.link.write(lambda r: r.delete(job.key))
            return
        if not self.link.writable:
            self.counters.count(dropped_writes=len(job.hashes))
            self.on_lost(job.hashes)
            return
        if isinstance(job, StateWrite):
            self._write_state(job)
        else:
            self._write_blocks(job)

    def _write_blocks(self, job: BlockWrite) -> None:
        def exists(r):
            pipe = r.pipeline(transaction=False)
            for key, *_ in job.items:
                pipe.exists(key)
            return pipe.execute()

        there = self.link.write(exists)
        if there is None:
            self.counters.count(dropped_writes=len(job.items))
            self.on_lost(job.hashes)
            return
        missing = [item for item, found in zip(job.items, there) if not found]
        self.counters.count(already_there=len(job.items) - len(missing))
        if not missing:
            return
        values = [run_file.encode(self.spec, (h,), k[:, None], v[:, None], group) for _, h, k, v, group in missing]

        def send(r):
            pipe = r.pipeline(transaction=False)
            for (key, *_), value in zip(missing, values):
                pipe.set(key, value, ex=self.ttl_s)
            return pipe.execute()

        if self.link.write(send) is None:
            self.counters.count(write_errors=len(missing))
            self.on_lost([h for _, h, *_ in missing])
        else:
            self.counters.count(stores=len(missing), bytes_written=sum(map(len, values)))

    def _write_state(self, job: StateWrite) -> None:
        value = job.job.encode(self.spec)

        def send(r):
            pipe = r.pipeline(transaction=False)
            pipe.set(job.key, value, ex=self.ttl_s)
            pipe.xadd(self.space.checkpoints, {b"ref": ref_entry(job.job.ref)}, maxlen=STREAM_LENGTH,
                      approximate=True)
            if self.ttl_s:
                pipe.expire(self.space.checkpoints, self.ttl_s)
            return pipe.execute()

        if self.link.write(send) is None:
            self.counters.count(write_errors=1)
            self.on_lost(job.hashes)
        else:
            self.counters.count(stores=1, bytes_written=len(value))
