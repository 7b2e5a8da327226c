"""Runs the unmodified mlx-lm model over the paged pool for one step."""

from __future__ import annotations

import mlx.core as mx

from mlxkv.attention import route_model_attention
from mlxkv.kv_pool import KVPool
from mlxkv.paged_cache import PagedBatch, PagedKVCache
from mlxkv.sequence import Sequence


class ModelRunner:
    def __init__(self, model, kv_pool: KVPool, attention: str = "reference"):
        self.model = model
        self.kv_pool = kv_pool
        self.attention = attention
        self.num_layers = len(model.layers)
        route_model_attention(model)

    def forward(self, seqs: list[Sequence], tokens: mx.array) -> mx.array:
        """Logits `[B, vocab]` at the last position of `tokens [B, L]`.

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
        )
        caches = [PagedKVCache(self.kv_pool, i, batch) for i in range(self.num_layers)]
        logits = self.model(tokens, cache=caches)
        for s in seqs:
            s.num_computed += num_new
        return logits[:, -1, :]
