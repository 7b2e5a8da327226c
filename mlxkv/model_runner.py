"""Runs the unmodified mlx-lm model over the paged pool for one step."""

from __future__ import annotations

import mlx.core as mx

from mlxkv.attention import route_model_attention
from mlxkv.kv_mirror import KVMirror
from mlxkv.kv_pool import KVPool
from mlxkv.paged_cache import PagedBatch, PagedKVCache
from mlxkv.sequence import Sequence


class ModelRunner:
    def __init__(self, model, kv_pool: KVPool, attention: str = "reference"):
        self.model = model
        self.kv_pool = kv_pool
        self.attention = attention
        self.num_layers = len(model.layers)
        # Contiguous K/V copies of lone running sequences (see kv_mirror.py).
        self._mirrors: dict[int, KVMirror] = {}
        route_model_attention(model)

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

    def release(self, seq: Sequence) -> None:
        """Drop what the runner holds for a finished sequence."""
        self._mirrors.pop(seq.request_id, None)

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
        )
        caches = [PagedKVCache(self.kv_pool, i, batch) for i in range(self.num_layers)]
        logits = self.model(tokens, cache=caches)
        for s in seqs:
            s.num_computed += num_new
        return logits[:, -1, :]
