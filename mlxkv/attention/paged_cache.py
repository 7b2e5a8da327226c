"""The per-layer cache objects the unmodified mlx-lm models talk to.

A model forward sees a list of `PagedKVCache`, one per layer, all sharing
one `PagedBatch`: the block tables, write slots and offsets of the step.
They speak mlx-lm's cache protocol (`offset`, `update_and_fetch`,
`make_mask`, `state`, `nbytes`), so no model code is forked.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlxkv.attention.mirror import KVMirror
from mlxkv.cache.kv_pool import KVPool
from mlxkv.attention.shared_prefix import SharedPrefix
from mlxkv.models.compat import BaseCache, create_attention_mask


@dataclass(frozen=True)
class PagedBatch:
    """Where one forward step reads and writes KV, for B sequences of L new tokens."""

    block_tables: mx.array  # [B, nb] block ids, padded with any valid id
    write_blocks: mx.array  # [B, L] block id of each new token's slot
    write_offsets: mx.array  # [B, L] offset of that slot inside its block
    offsets: tuple[int, ...]  # tokens already in the pool, per sequence
    num_new: int
    attention: str = "reference"
    mirror: KVMirror | None = None  # contiguous copy of a lone sequence's K/V
    prefix: SharedPrefix | None = None  # leading blocks all rows share (cascade.py)

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        offsets: list[int],
        num_new: int,
        block_size: int,
        attention: str = "reference",
        mirror: KVMirror | None = None,
        prefix: SharedPrefix | None = None,
    ):
        width = max(len(t) for t in block_tables)
        padded = [t + [t[0]] * (width - len(t)) for t in block_tables]
        positions = [range(o, o + num_new) for o in offsets]
        write_blocks = [[t[p // block_size] for p in pos] for t, pos in zip(block_tables, positions)]
        write_offsets = [[p % block_size for p in pos] for pos in positions]
        return cls(
            block_tables=mx.array(padded, dtype=mx.int32),
            write_blocks=mx.array(write_blocks, dtype=mx.int32),
            write_offsets=mx.array(write_offsets, dtype=mx.int32),
            offsets=tuple(offsets),
            num_new=num_new,
            attention=attention,
            mirror=mirror,
            prefix=prefix,
        )

    @property
    def batch_size(self) -> int:
        return len(self.offsets)

    @property
    def context_lens(self) -> list[int]:
        return [o + self.num_new for o in self.offsets]


class PagedKVCache(BaseCache):
    def __init__(self, pool: KVPool, layer: int, batch: PagedBatch):
        self.pool = pool
        self.layer = layer
        self.batch = batch

    @property
    def offset(self):
        # RoPE takes an int for one sequence and an array for a batch.
        if self.batch.batch_size == 1:
            return self.batch.offsets[0]
        return mx.array(self.batch.offsets)

    def update_and_fetch(self, keys, values):
        b = self.batch
        self.pool.write(self.layer, b.write_blocks, b.write_offsets, keys, values)
        if b.mirror is not None:
            return self._fetch_mirrored(keys, values)
        # The gathered copy is what any attention code can use; when the
        # kernel path or cascade attention serves instead, MLX never evaluates it.
        length = b.context_lens[0] if b.batch_size == 1 else None
        return self.pool.gather(self.layer, b.block_tables, length)

    def _fetch_mirrored(self, keys, values):
        mirror, offset = self.batch.mirror, self.batch.offsets[0]
        if not mirror.holds(self.layer, offset):
            # First step of a request (maybe on prefix hits): copy once from the pool.
            k, v = self.pool.gather(self.layer, self.batch.block_tables, self.batch.context_lens[0])
            return mirror.reset(self.layer, k, v)
        return mirror.append(self.layer, keys, values)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        b = self.batch
        if b.batch_size == 1:
            return create_attention_mask(N, offset=b.offsets[0], return_array=return_array, window_size=window_size)
        # Key j is visible to query i of sequence s when j <= offsets[s] + i;
        # that also hides the padding past each sequence's context.
        width = b.block_tables.shape[1] * self.pool.layout.block_size
        q_pos = mx.array(b.offsets)[:, None, None, None] + mx.arange(N)[:, None]
        return mx.arange(width) <= q_pos

    def size(self):
        return self.batch.context_lens[0] if self.batch.batch_size == 1 else 0

    def empty(self):
        return False

    def is_trimmable(self):
        return False

    @property
    def state(self):
        # The pool, not this view, holds the KV; mlx-lm's prefill loop only
        # evaluates `state`, so hand it the layer's pools.
        return self.pool.keys[self.layer], self.pool.values[self.layer]

    @property
    def nbytes(self):
        return self.pool.keys[self.layer].nbytes + self.pool.values[self.layer].nbytes
