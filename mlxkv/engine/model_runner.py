"""Runs the unmodified mlx-lm model over the paged pool for one step."""

from __future__ import annotations

import mlx.core as mx

from mlxkv.attention.dispatch import route_model_attention
from mlxkv.attention.mirror import KVMirror
from mlxkv.cache.kv_pool import KVPool
from mlxkv.attention.paged_cache import PagedBatch, PagedKVCache
from mlxkv.cache.sequence import Sequence
from mlxkv.attention.shared_prefix import SharedPrefix, shared_blocks


class ModelRunner:
    def __init__(self, model, kv_pool: KVPool, attention: str = "reference"):
        self.model = model
        self.kv_pool = kv_pool
        self.attention = attention
        self.num_layers = len(model.layers)
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
        cascade = self.attention == "reference" and self._routed
        blocks = shared_blocks(seqs, self.kv_pool.layout.block_size) if cascade else []
        if not blocks:
            self._prefix = None
            return None
        if self._prefix is None:
            self._prefix = SharedPrefix(self.num_layers)
        self._prefix.update(blocks, self.kv_pool, {s.request_id for s in seqs})
        return self._prefix

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
        batch = PagedBatch.build(
            [s.block_table for s in seqs],
            [s.num_computed for s in seqs],
            num_new,
            self.kv_pool.layout.block_size,
            self.attention,
            self._mirror_for(seqs, mirror),
            self._prefix_for(seqs, num_new),
        )
        caches = [PagedKVCache(self.kv_pool, i, batch) for i in range(self.num_layers)]
        logits = self.model(tokens, cache=caches)
        for s in seqs:
            s.num_computed += num_new
        return logits[:, -1, :]
