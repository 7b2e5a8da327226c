"""Tier reads off the step path: a prefix hit's tier blocks, read on a loader thread, installed a slice a step.

`begin` (engine thread) holds the hit's pool blocks, takes fresh blocks
for its tier blocks, starts the sequence as admission would, and hands
each group's keys to its load job (cache/connector.py's LoadJob) on the
loader thread, which reads them into staging memory (numpy: MLX state is
the engine thread's). A hybrid's checkpoint in a tier is read there too
(a CheckpointLoad); its recurrent state starts empty and takes the
checkpoint once everything is installed. The request waits in its loading state meanwhile
(engine/request.py) and the rest of the batch keeps stepping.

`progress` (engine thread, once a step) installs at most `budget` bytes
of what was read: one copy into the pool per slice, then the blocks are
registered, so even a long restore never holds a step for all of it.

A read that comes back short (a file gone or failing its checksum, the
server down) is a shortfall: what was installed stays cached, the
sequence is released, and the request is looked up again, so the part
that could not be read is recomputed, never served wrong.
"""

from __future__ import annotations

import enum
import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from mlxkv.cache.block_pool import Block, BlockPool
from mlxkv.cache.checkpoints import Checkpoint
from mlxkv.cache.connector import (
    CheckpointLoad, KVCacheConnector, LoadJob, SyncCheckpointLoad, begin_checkpoint_load, begin_load,
)
from mlxkv.cache.groups.base import AttentionManager
from mlxkv.cache.groups.recurrent import CheckpointNeed, RecurrentManager
from mlxkv.cache.kv_pool import KVPool
from mlxkv.cache.restore_cost import RestoreCost
from mlxkv.cache.sequence import Sequence
from mlxkv.cache.tiers import POOL, TIERS

log = logging.getLogger(__name__)

# Bytes a step installs at most (all loads together): two copies of this
# (staging -> MLX -> pool) take tens of ms, a fraction of a decode step of
# the models whose KV is big enough to need slicing.
INSTALL_BYTES_PER_STEP = 64 << 20


class LoadState(enum.Enum):
    READING = "reading"  # the loader thread has not finished
    INSTALLING = "installing"  # read; slices still to install
    DONE = "done"  # every tier block is in the pool: the request can run
    SHORT = "short"  # a tier could not supply its share: release and look up again


@dataclass
class _GroupLoad:
    manager: AttentionManager
    blocks: list[tuple[int, Block]]  # (block index, fresh pool block), in the order the keys are read
    job: LoadJob
    installed: int = 0
    short: bool = False  # the job gave something other than what was asked: nothing more is taken


@dataclass
class _StateLoad:
    """A hybrid's checkpoint: read by `job` (a tier's), or already `found` (the store's)."""

    need: CheckpointNeed
    branch: int  # tokens: where the recurrent manager takes a branch point's checkpoint
    job: CheckpointLoad | SyncCheckpointLoad | None = None
    found: tuple[Checkpoint, str] | None = None


@dataclass
class _Load:
    seq: Sequence
    groups: list[_GroupLoad]
    state: _StateLoad | None
    done: Future
    sources: list[str]  # each block's slowest tier so far


class TierLoads:
    def __init__(self, pool: BlockPool, kv_pool: KVPool | None, connector: KVCacheConnector,
                 attention: list[AttentionManager], recurrent: RecurrentManager | None, costs: RestoreCost,
                 block_size: int):
        self.pool, self.kv_pool, self.connector = pool, kv_pool, connector
        self.attention, self.recurrent, self.costs, self.block_size = attention, recurrent, costs, block_size
        self._loads: dict[int, _Load] = {}
        self._loader: ThreadPoolExecutor | None = None  # made at the first load

    def begin(self, request_id: int, tokens: list[int], root, hit, head: int = 0) -> Sequence:
        """A sequence on the hit, its tier blocks (and checkpoint) on their way (PoolExhaustedError:
        nothing taken). `head`: as the coordinator's `admit`."""
        self.pool.touch(hit.pool_blocks)  # first: the allocation must not evict the hit's own blocks
        try:
            fresh = sorted(self.pool.allocate(hit.tier_blocks), key=lambda b: b.block_id)
        except BaseException:
            self.pool.free(hit.pool_blocks)
            raise
        groups = []
        for manager, needs in zip(self.attention, hit.groups):
            mine, fresh = fresh[: len(needs.tiers)], fresh[len(needs.tiers) :]
            pairs = [(i, block) for (i, _), block in zip(needs.tiers, mine)]
            manager.start(request_id, hit.num_blocks, needs.pool + pairs)
            if pairs:
                groups.append(_GroupLoad(manager, pairs, begin_load(self.connector, [k for _, k in needs.tiers])))
        seq = Sequence(request_id, tokens, root, hit.hashes)
        seq.num_cached_blocks = hit.num_blocks
        seq.num_computed = hit.num_blocks * self.block_size
        seq.restore_choice, seq.recomputed_hit = hit.restore_choice, hit.recomputed
        state = self._begin_state(request_id, hit, seq.num_computed, head)
        self._loads[request_id] = _Load(seq, groups, state, self._submit(groups, state), [POOL] * hit.num_blocks)
        return seq

    def _begin_state(self, request_id: int, hit, num_computed: int, head: int) -> _StateLoad | None:
        """A hybrid's recurrent state: started empty (so a release finds it), its checkpoint on its way."""
        if self.recurrent is None:
            return None
        self.recurrent.start(request_id, None, num_computed)
        if hit.checkpoint is None:
            return _StateLoad(None, max(hit.branch * self.block_size, head))
        state = _StateLoad(hit.checkpoint, max(hit.branch * self.block_size, head))
        if hit.checkpoint.in_tier:
            state.job = begin_checkpoint_load(self.connector, hit.checkpoint.ref.key)
        else:
            state.found = self.recurrent.load(hit.checkpoint)  # the store's: no read
        return state

    def _submit(self, groups: list[_GroupLoad], state: _StateLoad | None) -> Future:
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxkv-tier-load")
        jobs = [g.job for g in groups] + ([state.job] if state is not None and state.job is not None else [])
        return self._loader.submit(lambda: [job.run() for job in jobs])

    def ready(self) -> bool:
        """Whether some load has been read (so waiting for one would not wait)."""
        return any(load.done.done() for load in self._loads.values())

    def wait(self, timeout: float) -> None:
        """Wait until some load's read is done, or `timeout` seconds (the batch has nothing else to do)."""
        wait([load.done for load in self._loads.values()], timeout, return_when=FIRST_COMPLETED)

    def progress(self, seq: Sequence, budget: int) -> tuple[LoadState, int]:
        """Install up to `budget` bytes of the sequence's load; its state and the bytes installed."""
        load = self._loads[seq.request_id]
        if not load.done.done():
            return LoadState.READING, 0
        if load.done.exception() is not None:
            log.error("a tier load failed; its blocks are recomputed", exc_info=load.done.exception())
            return self._end(load, LoadState.SHORT), 0
        if not self._state_ready(load.state):
            return self._end(load, LoadState.SHORT), 0
        used = 0
        for group in load.groups:
            while group.installed < len(group.blocks) and used < budget:
                found = [] if group.short else group.job.take(budget - used)
                if not found:
                    return self._end(load, LoadState.SHORT), used
                used += self._install(load, group, found)
            if group.installed < len(group.blocks):
                return LoadState.INSTALLING, used
        return self._end(load, LoadState.DONE), used

    def _state_ready(self, state: _StateLoad | None) -> bool:
        """Whether the hybrid's checkpoint is at hand (made MLX here, once): False if a tier lost it."""
        if state is not None and state.job is not None:
            state.found = self.recurrent.load(state.need, state.job)
            state.job = None
        return state is None or state.need is None or state.found is not None

    def _install(self, load: _Load, group: _GroupLoad, found) -> int:
        """Copy blocks read into their pool blocks and register them; the bytes copied."""
        targets = group.blocks[group.installed : group.installed + len(found)]
        keys = [b.block_hash for b in found]
        wanted = [group.manager.key(load.seq.block_hashes[i]) for i, _ in targets]
        good = 0
        while good < len(found) and keys[good] == wanted[good] and found[good].kv.group == group.manager.index:
            good += 1
        if good:
            blocks = [block for _, block in targets[:good]]
            self.kv_pool.write_blocks([b.block_id for b in blocks], [f.kv for f in found[:good]])
            self.pool.register(blocks, keys[:good], group.manager.index)
            for (i, _), f in zip(targets, found[:good]):
                load.sources[i] = max(load.sources[i], f.tier, key=TIERS.index)
        group.installed += good
        group.short = good < len(found)  # not what was asked for: never installed, the rest is recomputed
        return sum(f.kv.nbytes for f in found[:good])

    def _end(self, load: _Load, state: LoadState) -> LoadState:
        for group in load.groups:
            for tier, nbytes, seconds in group.job.reads:
                self.costs.record_read(tier, nbytes, seconds)
        if state is LoadState.DONE:
            state_tier = self._start_state(load)
            for source in load.sources:
                source = max(source, state_tier, key=TIERS.index)  # as slow as the checkpoint, too
                load.seq.cached_tokens[source] += self.block_size
        del self._loads[load.seq.request_id]
        return state

    def _start_state(self, load: _Load) -> str:
        """The recurrent state starts on the checkpoint now installed; the tier it came from."""
        if load.state is None:
            return POOL
        checkpoint, tier = load.state.found or (None, POOL)
        self.recurrent.start(load.seq.request_id, checkpoint, load.seq.num_computed, load.state.branch)
        return tier

    def cancel(self, seq: Sequence) -> None:
        """Forget the sequence's load (the caller releases its blocks); a read in flight is dropped when done."""
        load = self._loads.pop(seq.request_id, None)
        if load is not None:
            load.done.cancel()

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)

