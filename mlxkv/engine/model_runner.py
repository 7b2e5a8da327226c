"""Runs the unmodified mlx-lm model over the paged pool for one step."""

from __future__ import annotations

import mlx.core as mx

from mlxkv.attention.dispatch import route_model_attention
from mlxkv.attention.mirror import KVMirror
from mlxkv.attention.paged_cache import GroupTables, PagedBatch, PagedKVCache
from mlxkv.attention.shared_prefix import SharedPrefix, shared_blocks
from mlxkv.cache.kv_pool import KVPool
from mlxkv.cache.layer_groups import GroupLayout
from mlxkv.cache.sequence import Sequence


class ModelRunner:
    def __init__(self, model, kv_pool: KVPool, attention: str = "reference", layout: GroupLayout | None = None):
        self.model = model
        self.kv_pool = kv_pool
        self.attention = attention
        self.layout = layout or GroupLayout.plain(len(model.layers))
        self.num_layers = self.layout.num_slots
        # (group, page layer) of each cache slot, in the model's order.
        self._places = [(g.index, j) for g, j in map(self.layout.place, range(self.num_layers))]
        # Contiguous K/V copies of lone running sequences (see kv_mirror.py).
        self._mirrors: dict[int, KVMirror] = {}
        # The shared prefix of the last batched decode step (see cascade.py).
        self._prefix: SharedPrefix | None = None
        self._routed = route_model_attention(model)

    def _mirror_for(self, seqs: list[Sequence], mirror: bool) -> KVMirror | None:
        if len(seqs) != 1 or self.attention != "reference":
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

    def _prefix_for(self, seqs: list[Sequence], num_new: int) -> SharedPrefix | None:
        """The shared prefix for cascade attention, or None.

        A batched decode step (B >= 2, one token each) updates the copy or
        drops it; other forwards (prefill chunks, a lone sequence on its
        mirror) leave it for the next batched step. `release` drops it with
        the last row that used it.
        """
        if len(seqs) < 2 or num_new != 1:
            return None
        cascade = self.attention == "reference" and self._routed and self.layout.is_plain
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
        bs = self.kv_pool.layout.block_size
        groups = tuple(self._group_tables(seqs, g.index, g.window, offsets, num_new, bs) for g in self.layout.groups)
        batch = PagedBatch.of_groups(groups, offsets, num_new, bs, self.attention,
                                     self._mirror_for(seqs, mirror), self._prefix_for(seqs, num_new))
        caches = [PagedKVCache(self.kv_pool, j, batch, g, slot) for slot, (g, j) in enumerate(self._places)]
        logits = self.model(tokens, cache=caches)
        for s in seqs:
            s.num_computed += num_new
        return logits[:, -1, :]
