"""Runs the unmodified mlx-lm model over the paged pool for one step.

Attention layers get paged caches over the pool, from the block tables
the cache coordinator keeps. Recurrent layers of a hybrid model get
mlx-lm's own `ArraysCache`, holding the rows' states stacked along the
batch (the recurrent manager's); the step's new states are returned with
the logits, and the coordinator records them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlxkv.attention.dispatch import AttentionChoice, route_model_attention
from mlxkv.attention.mirror import KVMirror
from mlxkv.attention.paged_cache import GroupTables, PagedBatch, PagedKVCache
from mlxkv.attention.shared_prefix import SharedPrefix, shared_blocks
from mlxkv.cache.coordinator import KVCacheCoordinator
from mlxkv.cache.kv_pool import KVPool
from mlxkv.cache.sequence import Sequence
from mlxkv.models.compat import ArraysCache


@dataclass
class StepOutput:
    logits: mx.array  # [B, vocab] at each row's last position (or [B, L, vocab]: every position)
    states: list | None  # per recurrent slot, per state array: the rows' new states stacked; None: no such slots

    @property
    def state_arrays(self) -> list[mx.array]:
        """The new states: what to evaluate after a prefill chunk."""
        return [a for slot in self.states or () for a in slot if a is not None]


class ModelRunner:
    def __init__(self, model, kv_pool: KVPool, cache: KVCacheCoordinator, attention: AttentionChoice | None = None):
        self.model = model
        self.kv_pool = kv_pool
        self.cache = cache
        self.attention = attention or AttentionChoice("reference")  # path_for: each step's path
        self.group_layout = cache.group_layout
        self.num_slots = self.group_layout.num_slots  # cache slots of the model (its make_cache() length)
        # (group, page layer) of each attention cache slot.
        self._places = {slot: (g.index, j) for g in self.group_layout.groups for j, slot in enumerate(g.slots)}
        # Contiguous K/V copies of lone running sequences (see mirror.py).
        self._mirrors: dict[int, KVMirror] = {}
        # The shared prefix of the last batched decode step (see cascade.py).
        self._prefix: SharedPrefix | None = None
        self._routed = route_model_attention(model)

    def _mirror_for(self, seqs: list[Sequence], mirror: bool, path: str) -> KVMirror | None:
        if len(seqs) != 1 or path != "reference":
            # A sequence decoding in a batch reads the pool; a copy would go stale.
            for s in seqs:
                self._mirrors.pop(s.request_id, None)
            return None
        if not mirror:
            return None
        key = seqs[0].request_id
        if key not in self._mirrors:
            self._mirrors[key] = KVMirror(self.num_slots)
        return self._mirrors[key]

    def _prefix_for(self, seqs: list[Sequence], tables: list, num_new: int, path: str) -> SharedPrefix | None:
        """The shared prefix for cascade attention, or None.

        A batched decode step (B >= 2, one token each) updates the copy or
        drops it; other forwards (prefill chunks, a lone sequence on its
        mirror) leave it for the next batched step. `release` drops it with
        the last row that used it.
        """
        if len(seqs) < 2 or num_new != 1:
            return None
        cascade = path == "reference" and self._routed and self.group_layout.is_plain
        limit = min(s.num_computed for s in seqs)
        blocks = shared_blocks([t[0] for t in tables], limit, self.kv_pool.layout.block_size) if cascade else []
        if not blocks:
            self._prefix = None
            return None
        if self._prefix is None:
            self._prefix = SharedPrefix(self.num_slots)
        self._prefix.update(blocks, self.kv_pool, {s.request_id for s in seqs})
        return self._prefix

    @staticmethod
    def _group_tables(tables: list[list], window: int | None, offsets: list[int], num_new: int,
                      block_size: int) -> GroupTables:
        """A group's tables from each row's first held block (a sliding window holds no earlier ones)."""
        ids, starts = [], []
        for table in tables:
            first = next(i for i, block in enumerate(table) if block is not None)
            ids.append([block.block_id for block in table[first:]])
            starts.append(first * block_size)
        return GroupTables.build(ids, starts, offsets, num_new, block_size, window)

    @property
    def prefix_nbytes(self) -> int:
        """Bytes of the shared prefix's copy, KV held beside the pool."""
        return 0 if self._prefix is None else self._prefix.nbytes

    def release(self, seq: Sequence) -> None:
        """Drop what the runner holds for a finished sequence."""
        self._mirrors.pop(seq.request_id, None)
        if self._prefix is not None and self._prefix.release(seq.request_id):
            self._prefix = None

    def forward(self, seqs: list[Sequence], tokens: mx.array, mirror: bool = True,
                every_position: bool = False) -> StepOutput:
        """The logits at the last position of `tokens [B, L]` (`every_position`: `[B, L, vocab]`,
        a speculative step's), and the recurrent slots' new states.

        `mirror=False` keeps a lone sequence off its contiguous mirror (a
        batch's prefill chunks: the values are the same, without the copy).
        The caller has allocated slots for the L new tokens of each sequence.
        """
        num_new = tokens.shape[1]
        offsets = [s.num_computed for s in seqs]
        path = self.attention.path_for(len(seqs), max(offsets) + num_new)
        bs = self.kv_pool.layout.block_size
        tables = [self.cache.tables(s) for s in seqs]
        groups = tuple(self._group_tables([t[g.index] for t in tables], g.window, offsets, num_new, bs)
                       for g in self.group_layout.groups)
        batch = PagedBatch.of_groups(groups, offsets, num_new, bs, path, self._mirror_for(seqs, mirror, path),
                                     self._prefix_for(seqs, tables, num_new, path))
        caches: list = [None] * self.num_slots
        for slot, (g, j) in self._places.items():
            caches[slot] = PagedKVCache(self.kv_pool, j, batch, g, slot)
        recurrent = self._recurrent_caches(seqs)
        for slot, cache in zip(self.group_layout.recurrent, recurrent):
            caches[slot] = cache
        logits = self.model(tokens, cache=caches)
        states = [list(c.cache) for c in recurrent] if recurrent else None
        return StepOutput(logits if every_position else logits[:, -1, :], states)

    def _recurrent_caches(self, seqs: list[Sequence]) -> list:
        """An ArraysCache per recurrent slot, its arrays the rows' states stacked."""
        if self.cache.recurrent is None:
            return []
        caches = []
        for size, arrays in zip(self.group_layout.state_sizes, self.cache.recurrent.batch_states([s.request_id for s in seqs])):
            cache = ArraysCache(size)
            cache.cache = arrays
            caches.append(cache)
        return caches
