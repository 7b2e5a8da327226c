"""The remote tier: a Redis or Valkey server many processes (and Macs) share, behind the connector seam.

One key per block (keys.py), valued with the SSD tier's checksummed file
bytes (values.py). On the engine thread, reads only, each bounded by the
link's short timeouts: a lookup is one pipelined EXISTS of the keys it
asks about, a hydrate one MGET per few MB of values. Writes (a prompt's
blocks as they are registered, and what the memory tier spills) are
queued for the tier's own thread (writer.py), which drops rather than
makes a step wait. A fault is a miss or a dropped write, and the tier's
state (health.py) says which and why; nothing here raises into a request.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence

from mlxkv.cache.checkpoints import Checkpoint, States
from mlxkv.cache.connector import CheckpointLoad, LoadedBlock, LoadedCheckpoint, ReadKV, TierStats
from mlxkv.cache.hashing import BlockHash
from mlxkv.cache.tiers import REMOTE
from mlxkv.connectors.disk import state_file
from mlxkv.connectors.disk.kv_arrays import file_spec, to_numpy
from mlxkv.connectors.disk.run_file import CorruptBlockError
from mlxkv.connectors.health import TierHealth
from mlxkv.connectors.staged import Staged, StagedLoad
from mlxkv.connectors.remote import values as remote_values
from mlxkv.connectors.remote.keys import DEFAULT_PREFIX, KeySpace
from mlxkv.connectors.remote.link import DEFAULT_TIMEOUT_S, RemoteLink
from mlxkv.connectors.remote.writer import BlockWrite, Counters, Delete, RemoteWriter, StateWrite
from mlxkv.errors import MlxkvWarning

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_BYTES = 256 << 20
MGET_BYTES = 8 << 20  # values per MGET: the server builds a reply whole before its first byte
WRITE_BATCH_BYTES = 8 << 20  # blocks per queued write (one EXISTS and one SET pipeline)
OFFERED_LIMIT = 1 << 16


class RemoteTierWarning(MlxkvWarning):
    """The remote tier's server did not answer at start; the engine runs without it until it does."""


class _Offered:
    """Hashes queued or known to be on the server, so a block is sent once; the writer forgets lost ones."""

    def __init__(self, limit: int = OFFERED_LIMIT):
        self.limit = limit
        self._lock = threading.Lock()
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def __contains__(self, h: BlockHash) -> bool:
        with self._lock:
            return h in self._hashes

    def add(self, hashes) -> None:
        with self._lock:
            for h in hashes:
                self._hashes[h] = None
                self._hashes.move_to_end(h)
            while len(self._hashes) > self.limit:
                self._hashes.popitem(last=False)

    def discard(self, hashes) -> None:
        with self._lock:
            for h in hashes:
                self._hashes.pop(h, None)


class RemoteKVCacheConnector:
    def __init__(self, url: str, fingerprint: bytes, *, block_size: int, num_layers: int, dtype,
                 block_nbytes: int = 1 << 20, prefix: str = DEFAULT_PREFIX, ttl_s: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 checkpoints: bool = False, tier_name: str = REMOTE,
                 page: tuple[int, int, int, int] | None = None, kv_format: str | None = None):
        self.spec, self._mx_dtype = file_spec(fingerprint, block_size, num_layers, dtype, page, kv_format)
        self.block_size = block_size
        self.block_nbytes = block_nbytes
        self.tier_name = tier_name
        self.tier_health = TierHealth("remote tier")
        self.link = RemoteLink(url, self.tier_health, timeout_s)
        self.space = KeySpace(prefix, fingerprint)
        self.counters = Counters()
        self._stats = TierStats()  # the engine thread's counts: lookups, hits, hydrations, corrupt
        self._offered = _Offered()
        self._said_corrupt = False
        self.writer = RemoteWriter(self.link, self.space, self.spec, self.counters, ttl_s=ttl_s,
                                   max_pending_bytes=max_pending_bytes, poll_checkpoints=checkpoints,
                                   on_lost=self._offered.discard)
        self._open()
        self.writer.start()

    def _open(self) -> None:
        problem = self.link.open()
        if problem is not None:
            warnings.warn(RemoteTierWarning(f"mlxkv: remote tier {self.tier_health.state}: {problem}; "
                                            "the engine runs without it until it answers"), stacklevel=4)
            return
        self.writer.poll(self.link.fetch)  # checkpoints other processes left, before the first lookup

    # -- lookup and hydrate (the engine thread) -----------------------------------

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        self._stats.lookups += 1
        if not block_hashes or not self.link.up:
            return 0
        keys = [self.space.block(h) for h in block_hashes]
        found = self.link.read(lambda r: _pipelined(r, "exists", keys))
        n = 0
        while found is not None and n < len(found) and found[n]:
            n += 1
        self._stats.hit_blocks += n
        self._stats.hit_tokens += n * self.block_size
        return n

    def load_blocks(self, block_hashes: Sequence[BlockHash]) -> list[LoadedBlock]:
        """The leading blocks the server still has, verified; one MGET per MGET_BYTES of values."""
        runs = self._fetch(block_hashes)
        if not runs:
            return []
        run = remote_values.as_run(runs, self._mx_dtype)
        self._taken(block_hashes[: len(runs)])
        return [LoadedBlock(h, run.block(i, data.group), self.tier_name)
                for i, (h, data) in enumerate(zip(block_hashes, runs))]

    def begin_load(self, block_hashes: Sequence[BlockHash]) -> StagedLoad:
        """A load job (cache/connector.py's LoadJob): fetched on the loader thread, made MLX on the engine thread."""
        hashes = list(block_hashes)

        def read() -> list[Staged]:
            return [Staged(d.keys, d.values, 0, [h], d.group) for h, d in zip(hashes, self._fetch(hashes))]

        return StagedLoad(self.tier_name, self._mx_dtype, read, on_taken=self._taken)

    def _fetch(self, block_hashes: Sequence[BlockHash]) -> list:
        """The leading values the server still has, verified, as numpy runs: no MLX, any thread."""
        if not block_hashes or not self.link.up:
            return []
        per_call = max(1, MGET_BYTES // max(self.block_nbytes, 1))
        runs = []
        for start in range(0, len(block_hashes), per_call):
            part = block_hashes[start : start + per_call]
            got = self.link.read(lambda r: r.mget([self.space.block(h) for h in part]))
            complete = got is not None and self._decode(part, got, runs)
            if not complete:
                break
        return runs

    def _taken(self, block_hashes: Sequence[BlockHash]) -> None:
        self._offered.add(block_hashes)
        self._stats.hydrations += len(block_hashes)

    def _decode(self, hashes, got, runs: list) -> bool:
        """Append the verified runs of `got` to `runs`; False at the first missing or bad value."""
        for h, value in zip(hashes, got):
            if value is None:
                return False
            try:
                data = remote_values.decode(self.spec, h, value)
                if runs and not remote_values.same_shape(runs[0], data):
                    raise CorruptBlockError(f"shape {data.keys.shape} after {runs[0].keys.shape}")
            except CorruptBlockError as e:
                self._corrupt(self.space.block(h), str(e))
                return False
            runs.append(data)
        return True

    def _corrupt(self, key: bytes, why: str) -> None:
        """A value that failed verification: a miss, counted, removed (whoever computes it writes it again)."""
        self._stats.corrupt += 1
        if not self._said_corrupt:
            self._said_corrupt = True
            log.warning("remote tier: a corrupt value was a miss (%s; %s); further ones are only counted",
                        why, self.link.where)
        self.writer.submit(Delete(key))

    # -- writes (queued for the tier's thread) -------------------------------------

    def cache_blocks(self, block_hashes: Sequence[BlockHash], read: ReadKV) -> None:
        self._offer(block_hashes, read, spill=False)

    def wants_spill(self, block_hash: BlockHash) -> bool:
        return block_hash not in self._offered

    def evict_blocks(self, block_hashes: Sequence[BlockHash], read: ReadKV) -> None:
        self._offer(block_hashes, read, spill=True)

    def _offer(self, block_hashes, read: ReadKV, spill: bool) -> None:
        wanted = [i for i, h in enumerate(block_hashes) if h not in self._offered]
        if not wanted:
            return
        if not self.link.writable:
            self.counters.count(dropped_writes=len(wanted))
            return
        blocks = read()
        keys, values = to_numpy([blocks[i] for i in wanted], self.spec, self._mx_dtype)
        items, nbytes = [], 0
        for j, i in enumerate(wanted):
            items.append((self.space.block(block_hashes[i]), block_hashes[i], keys[:, j], values[:, j],
                          blocks[i].group))
            nbytes += keys[:, j].nbytes + values[:, j].nbytes
            if nbytes >= WRITE_BATCH_BYTES or j == len(wanted) - 1:
                self._submit(BlockWrite(items), [h for _, h, *_ in items], spill)
                items, nbytes = [], 0

    def _submit(self, job, hashes: list[BlockHash], spill: bool) -> None:
        if self.writer.submit(job):
            self._offered.add(hashes)
            if spill:
                self._stats.spills += len(hashes)

    # -- checkpoints ---------------------------------------------------------------

    def has_checkpoint(self, key: BlockHash) -> bool:
        return bool(self.link.read(lambda r: r.exists(self.space.state(key))))

    def load_checkpoint(self, key: BlockHash) -> LoadedCheckpoint | None:
        job = self.begin_checkpoint_load(key)
        job.run()
        return job.take()

    def begin_checkpoint_load(self, key: BlockHash) -> CheckpointLoad:
        """A checkpoint load (cache/connector.py): fetched on the loader thread, made MLX on the engine thread."""

        def finish(staged) -> States:
            self._taken([key])
            return state_file.mlx_states(staged)

        return CheckpointLoad(key, self.tier_name, lambda: self._fetch_checkpoint(key), finish)

    def _fetch_checkpoint(self, key: BlockHash) -> state_file.StagedStates | None:
        """The checkpoint's value, verified, as numpy: no MLX, any thread (as `_fetch`)."""
        value = self.link.read(lambda r: r.get(self.space.state(key)))
        if value is None:
            return None
        try:
            return state_file.decode_state(self.spec, np.frombuffer(value, np.uint8), key)
        except CorruptBlockError as e:
            self._corrupt(self.space.state(key), str(e))
            return None

    def cache_checkpoint(self, checkpoint: Checkpoint) -> None:
        self._offer_checkpoint(checkpoint, spill=False)

    def evict_checkpoint(self, checkpoint: Checkpoint) -> None:
        self._offer_checkpoint(checkpoint, spill=True)

    def _offer_checkpoint(self, checkpoint: Checkpoint, spill: bool) -> None:
        if checkpoint.key in self._offered:
            return
        if not self.link.writable:
            self.counters.count(dropped_writes=1)
            return
        job = state_file.state_job(checkpoint, spill)
        self._submit(StateWrite(self.space.state(checkpoint.key), job), [checkpoint.key], spill)

    def checkpoint_refs(self):
        """Checkpoints the stream named since the last call (this process's own among them)."""
        return self.writer.take_refs()

    # -- state ---------------------------------------------------------------------

    def stats(self) -> dict[str, dict]:
        counted = self.counters.as_dict()
        stats = self._stats.as_dict()
        stats.update(stores=counted.pop("stores"), write_errors=counted.pop("write_errors"))
        return {self.tier_name: {**stats, **counted, "timeouts": self.link.timeouts,
                                 **self.tier_health.as_dict()}}

    def health(self) -> dict:
        """What stats() has no field for: where, the queue, round trips (as the SSD tier's health())."""
        jobs, nbytes = self.writer.pending
        return {"url": self.link.where, **self.tier_health.as_dict(), "pending_writes": jobs,
                "pending_bytes": nbytes, "round_trips": self.link.round_trips}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued writes (done or dropped); False on timeout."""
        return self.writer.flush(timeout)

    def close(self) -> None:
        self.writer.stop()
        self.link.close()


def _pipelined(client, command: str, keys: list[bytes]) -> list:
    """One command per key, sent as one pipeline: one round trip."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        getattr(pipe, command)(key)
    return pipe.execute()
