"""Recurrent and linear-attention layers: each running sequence's state, and checkpoints of it.

A hybrid model's recurrent slots (mlx-lm's `ArraysCache`) take no pages:
each running sequence has one state per slot, batch of one, which the
runner stacks for a step (`batch_states`) and this manager takes back
(`record`). A forward that ends on a block boundary leaves a snapshot, and
snapshots become checkpoints (cache/checkpoints.py) where a later request
resumes:

- every `interval` tokens of a long prefill (the scheduler ends chunks
  there, `prefill_stop`), and at the prompt's last full block;
- at a *branch point*: the end of the prefix the attention groups hit when
  no checkpoint is there (another chain shares it, then went its own way:
  two chats on one system-and-tools head), or the end of the head the
  request names (`Request.head`: the system-and-tools head the server
  rendered, so the first chat on it leaves a checkpoint there);
- at the last full block a sequence has computed when it leaves (a
  reply's end, or a preemption).

A hit at b needs a checkpoint at exactly b: the largest boundary the
checkpoint index knows of for this chain, found in the store or a tier.

The SSD tier. A real model's state is megabytes, a chat turn's KV often
less, so a leaving checkpoint is written through only once the KV computed
since its chain's *anchor* (the newest checkpoint of the chain on disk)
outweighs `write_ratio` times its own bytes: SSD checkpoint bytes stay
under 1/write_ratio of the KV bytes. The newest leaving checkpoint of each
chain that was not written is kept aside and written on a clean close or
when the engine goes idle (`write_pending`), so a restarted short chat
resumes at its last turn; a crash loses at most what the ratio allows.
So are the branch points' checkpoints the store still holds (one it let
go of went down the tiers as a spill), so a new chat on a shared head
after a restart resumes at the head's end.
A model of state slots alone (Mamba, RWKV-7) has no KV to weigh a
checkpoint against: one is written through once `write_ratio` checkpoint
intervals of tokens have passed since the anchor, so a crash recomputes
at most that many.

The states are mlx-lm's `ArraysCache` arrays, or deepseek_v41's
`LayerCache` fields: their lengths grow with the context, so such rows
are never stacked (the layout runs them one at a time).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import mlx.core as mx

from mlxkv.cache.checkpoints import Checkpoint, CheckpointIndex, CheckpointRef, CheckpointStore, States
from mlxkv.cache.hashing import BlockHash
from mlxkv.cache.sequence import Sequence
from mlxkv.cache.tiers import DISK, POOL

log = logging.getLogger(__name__)

# Snapshots a sequence keeps: the boundary a finished reply may leave its
# checkpoint at, and the one before it (a pipelined step may pass the last
# boundary with a token the request then drops).
SNAPSHOTS_KEPT = 2
# Branch points awaiting an idle spell or the close, at most; the oldest are
# forgotten first (a busy server that never idles: a miss after a restart, never a wrong hit).
BRANCHES_KEPT = 1024


@dataclass
class CheckpointNeed:
    """The checkpoint a hit resumes from, and whether a tier (not the store) has it."""

    ref: CheckpointRef
    in_tier: bool


@dataclass
class _Running:
    states: States | None = None  # None: not started (a fresh state is zeros)
    snapshots: dict[int, States] = field(default_factory=dict)  # boundary (tokens) -> states
    checkpointed: int = 0  # boundary of the newest checkpoint it registered (or resumed from)
    anchor: int = 0  # boundary of its chain's newest checkpoint on disk
    resumed_from: BlockHash | None = None  # key of the checkpoint it started on
    last: Checkpoint | None = None  # the newest checkpoint it registered
    branch: int = 0  # boundary of its prefill's branch point (0: none)


class RecurrentManager:
    def __init__(self, state_sizes: tuple[int, ...], budget_bytes: int, connector, block_size: int,
                 interval: int, write_ratio: float, kv_bytes_per_token: int):
        self.state_sizes = state_sizes  # arrays per recurrent slot
        self.connector = connector
        self.block_size = block_size
        self.interval = max(1, interval // block_size) * block_size  # whole blocks, at least one
        self.write_ratio = write_ratio
        self.kv_bytes_per_token = kv_bytes_per_token
        self.store = CheckpointStore(budget_bytes, on_evict=self._spill)
        self.index = CheckpointIndex()
        self._running: dict[int, _Running] = {}
        self._unwritten: dict[BlockHash, Checkpoint] = {}  # newest leaving checkpoint per chain, not on disk
        self._branches: dict[BlockHash, None] = {}  # keys of branch-point checkpoints not on disk, oldest first

    @property
    def generation(self) -> tuple[int, int]:
        return self.store.generation, self.index.generation

    def _spill(self, checkpoint: Checkpoint) -> None:
        try:
            self.connector.evict_checkpoint(checkpoint)
        except Exception:  # a lost copy, never a request
            log.exception("the connector could not spill a checkpoint")

    # -- lookup ----------------------------------------------------------------

    def longest_hit(self, hashes: list[BlockHash], limit: int, presence) -> int:
        """The largest boundary (in blocks) up to `limit` with a checkpoint of this chain, or 0."""
        for ref in self.connector.checkpoint_refs() if presence.use_tiers else ():
            self.index.add(ref)
        for ref in self.index.candidates(hashes, limit, self.block_size):
            key = ref.key
            if key in self.store or (presence.use_tiers and _tier_has(self.connector, key, presence)):
                return ref.boundary // self.block_size
            if presence.use_tiers:
                self.index.discard(ref)  # nobody has it any more
        return 0

    def needs(self, hashes: list[BlockHash], b: int) -> CheckpointNeed | None:
        if b == 0:
            return None
        ref = CheckpointRef(hashes[b - 1], b * self.block_size)
        return CheckpointNeed(ref, ref.key not in self.store)

    def load(self, need: CheckpointNeed, job=None) -> tuple[Checkpoint, str] | None:
        """The hit's checkpoint, into the store if a tier had it, and where it came from; None if gone.
        `job`: the tier's read, already run off the engine thread (tier_loads.py); else it is read now."""
        ref = need.ref
        if not need.in_tier:
            checkpoint = self.store.get(ref.key)
            return None if checkpoint is None else (checkpoint, POOL)
        loaded = job.take() if job is not None else self.connector.load_checkpoint(ref.key)
        if loaded is None:
            self.index.discard(ref)
            return None
        checkpoint = Checkpoint(ref, loaded.states)
        self.store.put(checkpoint)
        if loaded.tier == DISK:  # resuming from disk anchors the chain there
            self.store.set_anchor(checkpoint.key, ref.boundary)
        return checkpoint, loaded.tier

    # -- running ---------------------------------------------------------------

    def start(self, request_id: int, checkpoint: Checkpoint | None, num_tokens: int, branch: int = 0) -> None:
        """A sequence admitted at `num_tokens` tokens, on this checkpoint (None: from scratch);
        `branch`: where the attention groups' hit ended (tokens), a checkpoint to take if past it."""
        branch = branch if branch > num_tokens else 0
        if checkpoint is None:
            self._running[request_id] = _Running(checkpointed=num_tokens, branch=branch)
            return
        self._running[request_id] = _Running(checkpoint.states, checkpointed=num_tokens,
                                             anchor=self.store.anchor(checkpoint.key),
                                             resumed_from=checkpoint.key, branch=branch)

    def batch_states(self, request_ids: list[int]) -> list[list[mx.array | None]]:
        """Per slot, per state array: the rows' states stacked along the batch."""
        rows = [self._running[r].states for r in request_ids]
        return [[_stacked([_array(row, j, e) for row in rows]) for e in range(size)]
                for j, size in enumerate(self.state_sizes)]

    def stackable(self, request_ids: list[int]) -> bool:
        """Whether the rows' states stack along the batch: every array of a slot the same shape
        in every row, or None in all. A state that grows (an n-gram context) or has not started
        beside one that has would be misread if padded or zero-filled, so such rows run apart."""
        rows = [self._running[r].states for r in request_ids]
        for j, size in enumerate(self.state_sizes):
            for e in range(size):
                shapes = {None if a is None else a.shape for a in (_array(row, j, e) for row in rows)}
                if len(shapes) > 1:
                    return False
        return True

    def record(self, seqs: list[Sequence], new_states: list[States]) -> None:
        """Take back each row's new states (batch of one each) after a step, keeping a snapshot at a block boundary."""
        for seq, states in zip(seqs, new_states):
            run = self._running[seq.request_id]
            run.states = states
            if seq.num_computed % self.block_size == 0:
                run.snapshots[seq.num_computed] = run.states
                while len(run.snapshots) > SNAPSHOTS_KEPT:
                    del run.snapshots[min(run.snapshots)]

    def prefill_stop(self, seq: Sequence) -> int:
        """Where the prefill chunk now starting must end so a checkpoint can be taken there."""
        at = seq.num_computed
        last_full = len(seq.prompt) // self.block_size * self.block_size
        run = self._running.get(seq.request_id)
        branch = run.branch if run is not None else 0
        stops = [(at // self.interval + 1) * self.interval] + [b for b in (last_full, branch) if b > at]
        return min(stops)

    def register(self, seq: Sequence, upto: int, every: bool) -> None:
        """Keep the snapshots at boundaries up to `upto` as checkpoints: in a prefill (`every`)
        those the policy names, else only the newest. The sequence's hashes reach `upto`."""
        run = self._running[seq.request_id]
        ready = sorted(b for b in run.snapshots if run.checkpointed < b <= upto)
        if every:  # a chunk may end elsewhere: only where the policy says
            last_full = len(seq.prompt) // self.block_size * self.block_size
            ready = [b for b in ready if b % self.interval == 0 or b in (last_full, run.branch)]
        for boundary in ready if every else ready[-1:]:
            ref = CheckpointRef(seq.block_hashes[boundary // self.block_size - 1], boundary)
            checkpoint = Checkpoint(ref, run.snapshots[boundary])
            if self.store.put(checkpoint):
                self.index.add(ref)
                self.store.set_anchor(checkpoint.key, run.anchor)
                run.last = checkpoint
                if boundary == run.branch:
                    self._remember_branch(checkpoint.key)
            run.checkpointed = boundary
        for boundary in [b for b in run.snapshots if b <= run.checkpointed]:
            del run.snapshots[boundary]

    def _remember_branch(self, key: BlockHash) -> None:
        self._branches[key] = None
        while len(self._branches) > BRANCHES_KEPT:
            del self._branches[next(iter(self._branches))]

    def leave(self, seq: Sequence) -> None:
        """The sequence leaves: its newest checkpoint goes through the SSD write policy."""
        run = self._running.pop(seq.request_id)
        if run.last is None:
            return
        checkpoint = run.last
        self._unwritten.pop(run.resumed_from, None)  # this chain's newer one supersedes it
        if self._worth_writing(checkpoint, run.anchor) and self._write(checkpoint):
            return
        self._unwritten[checkpoint.key] = checkpoint
        self.store.set_anchor(checkpoint.key, run.anchor)

    def _worth_writing(self, checkpoint: Checkpoint, anchor: int) -> bool:
        since = checkpoint.boundary - anchor
        if self.write_ratio <= 0:
            return True
        if not self.kv_bytes_per_token:  # state alone (Mamba): one write per `write_ratio` intervals
            return since >= self.write_ratio * self.interval
        return since * self.kv_bytes_per_token >= self.write_ratio * checkpoint.nbytes

    def _write(self, checkpoint: Checkpoint) -> bool:
        try:
            self.connector.cache_checkpoint(checkpoint)
        except Exception:  # a lost copy, as with blocks
            log.exception("the connector could not store a checkpoint")
            return False
        self.store.set_anchor(checkpoint.key, checkpoint.boundary)
        return True

    def write_pending(self) -> int:
        """Write the newest unwritten checkpoint of each chain and each branch point's
        (a clean close, or idle); how many."""
        pending, self._unwritten = list(self._unwritten.values()), {}
        branches, self._branches = self.store.held(self._branches), {}
        return sum(self._write(checkpoint) for checkpoint in pending + branches)

    @property
    def pending(self) -> int:
        return len(self._unwritten) + len(self._branches)


def _tier_has(connector, key: BlockHash, presence) -> bool:
    """Whether a tier holds checkpoint `key`, asked once per lookup (`presence` remembers)."""
    known = presence.checkpoints.get(key)
    if known is None:
        known = presence.checkpoints[key] = bool(connector.has_checkpoint(key))
    return known


def _array(row: States | None, slot: int, i: int) -> mx.array | None:
    """Array i of a row's state slot; a state read back from a file drops trailing None arrays."""
    if row is None or i >= len(row[slot]):
        return None
    return row[slot][i]


def _stacked(arrays: list) -> mx.array | None:
    """Rows stacked along the batch (they are `stackable`: all arrays of one shape, or all None)."""
    if len(arrays) == 1 or arrays[0] is None:
        return arrays[0]
    return mx.concatenate(arrays)
