"""Runs the unmodified mlx-lm model over the paged pool for one step.

Attention layers get paged caches over the pool. Recurrent layers of a
hybrid model get mlx-lm's own `ArraysCache`, holding the rows' states
stacked along the batch; the step's new states go back to each sequence,
and a step that ends on a block boundary keeps them as a snapshot, the
checkpoint the sequence may leave there (cache/checkpoints.py).
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.attention.dispatch import AttentionChoice, route_model_attention
from mlxkv.attention.mirror import KVMirror
from mlxkv.attention.paged_cache import GroupTables, PagedBatch, PagedKVCache
from mlxkv.attention.shared_prefix import SharedPrefix, shared_blocks
from mlxkv.cache.kv_pool import KVPool
from mlxkv.cache.layer_groups import GroupLayout
from mlxkv.cache.sequence import Sequence
from mlxkv.models.compat import ArraysCache

# Snapshots a sequence keeps: the boundary a finished reply may leave its
# checkpoint at, and the one before it (a pipelined step may pass the last
# boundary with a token the request then drops).
SNAPSHOTS_KEPT = 2


class ModelRunner:
    def __init__(self, model, kv_pool: KVPool, attention: AttentionChoice | None = None,
                 layout: GroupLayout | None = None):
        self.model = model
        self.kv_pool = kv_pool
        self.attention = attention or AttentionChoice("reference")  # path_for: each step's path
        self.layout = layout or GroupLayout.plain(len(model.layers))
        self.num_layers = self.layout.num_slots
        # (group, page layer) of each attention cache slot.
        self._places = {slot: (g.index, j) for g in self.layout.groups for j, slot in enumerate(g.slots)}
        # Contiguous K/V copies of lone running sequences (see kv_mirror.py).
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
            self._mirrors[key] = KVMirror(self.num_layers)
        return self._mirrors[key]

    def _prefix_for(self, seqs: list[Sequence], num_new: int, path: str) -> SharedPrefix | None:
        """The shared prefix for cascade attention, or None.

        A batched decode step (B >= 2, one token each) updates the copy or
        drops it; other forwards (prefill chunks, a lone sequence on its
        mirror) leave it for the next batched step. `release` drops it with
        the last row that used it.
        """
        if len(seqs) < 2 or num_new != 1:
            return None
        cascade = path == "reference" and self._routed and self.layout.is_plain
        blocks = shared_blocks(seqs, self.kv_pool.layout.block_size) if cascade else []
        if not blocks:
            self._prefix = None
            return None
        if self._prefix is None:
            self._prefix = SharedPrefix(self.num_layers)
        self._prefix.update(blocks, self.kv_pool, {s.request_id for s in seqs})
        return self._prefix

    @staticmethod
    def _group_tables(seqs: list[Sequence], g: int, window: int | None, offsets: list[int], num_new: int,
                      block_size: int) -> GroupTables:
        """A group's tables from each row's first held block (a sliding window holds no earlier ones)."""
        tables, starts = [], []
        for seq in seqs:
            table = seq.tables[g]
            first = next(i for i, block in enumerate(table) if block is not None)
            tables.append([block.block_id for block in table[first:]])
            starts.append(first * block_size)
        return GroupTables.build(tables, starts, offsets, num_new, block_size, window)

    @property
    def prefix_nbytes(self) -> int:
        """Bytes of the shared prefix's copy, KV held beside the pool."""
        return 0 if self._prefix is None else self._prefix.nbytes

    def release(self, seq: Sequence) -> None:
        """Drop what the runner holds for a finished sequence."""
        self._mirrors.pop(seq.request_id, None)
        if self._prefix is not None and self._prefix.release(seq.request_id):
            self._prefix = None

    def forward(self, seqs: list[Sequence], tokens: mx.array, mirror: bool = True) -> mx.array:
        """Logits `[B, vocab]` at the last position of `tokens [B, L]`.

        `mirror=False` keeps a lone sequence off its contiguous mirror (a
        batch's prefill chunks: the values are the same, without the copy).

        The caller has allocated slots for the L new tokens of each
        sequence; this advances each sequence's `num_computed` by L.
        """
        num_new = tokens.shape[1]
        offsets = [s.num_computed for s in seqs]
        path = self.attention.path_for(len(seqs), max(offsets) + num_new)
        bs = self.kv_pool.layout.block_size
        groups = tuple(self._group_tables(seqs, g.index, g.window, offsets, num_new, bs) for g in self.layout.groups)
        batch = PagedBatch.of_groups(groups, offsets, num_new, bs, path,
                                     self._mirror_for(seqs, mirror, path), self._prefix_for(seqs, num_new, path))
        caches: list = [None] * self.num_layers
        for slot, (g, j) in self._places.items():
            caches[slot] = PagedKVCache(self.kv_pool, j, batch, g, slot)
        recurrent = self._recurrent_caches(seqs)
        for slot, cache in zip(self.layout.recurrent, recurrent):
            caches[slot] = cache
        logits = self.model(tokens, cache=caches)
        for s in seqs:
            s.num_computed += num_new
        if recurrent:
            self._keep_states(seqs, recurrent)
        return logits[:, -1, :]

    def _recurrent_caches(self, seqs: list[Sequence]) -> list:
        """An ArraysCache per recurrent slot, its arrays the rows' states stacked."""
        caches = []
        for j, size in enumerate(self.layout.state_sizes):
            cache = ArraysCache(size)
            rows = [s.states[j] if s.states is not None else (None,) * size for s in seqs]
            cache.cache = [_stacked([row[e] for row in rows]) for e in range(size)]
            caches.append(cache)
        return caches

    def _keep_states(self, seqs: list[Sequence], caches: list) -> None:
        bs = self.kv_pool.layout.block_size
        for i, seq in enumerate(seqs):
            one = len(seqs) == 1
            seq.states = tuple(tuple(a if one or a is None else a[i : i + 1] for a in c.cache) for c in caches)
            if seq.num_computed % bs == 0:
                seq.snapshots[seq.num_computed] = seq.states
                while len(seq.snapshots) > SNAPSHOTS_KEPT:
                    del seq.snapshots[min(seq.snapshots)]

    @staticmethod
    def state_arrays(seqs: list[Sequence]) -> list[mx.array]:
        """The recurrent state arrays of these sequences: what to evaluate after a prefill chunk."""
        return [a for s in seqs if s.states for slot in s.states for a in slot if a is not None]


def _stacked(arrays: list) -> mx.array | None:
    """Rows stacked along the batch; a row not started yet is zeros, as a fresh state is."""
    if len(arrays) == 1:
        return arrays[0]
    first = next((a for a in arrays if a is not None), None)
    if first is None:
        return None
    return mx.concatenate([a if a is not None else mx.zeros_like(first) for a in arrays])
