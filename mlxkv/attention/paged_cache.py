"""The per-layer cache objects the unmodified mlx-lm models talk to.

A model forward sees one `PagedKVCache` per attention layer, all sharing
one `PagedBatch`: the write slots and offsets of the step, and each layer
group's block tables (cache/layer_groups.py). They speak mlx-lm's cache
protocol (`offset`, `update_and_fetch`, `make_mask`, `state`, `nbytes`),
so no model code is forked.

A sliding-window group's tables start at each row's first held block
(`starts`, in tokens), and its mask hides what is older than the window;
a chunked group's (Llama 4) hides what is before the query's chunk.
A slot of a shape other than its page layer's reads and writes its own
unit heads of it (`PageView`, cache/page_format.py). A layer that reads
another layer's K/V (gemma3n, afm7: `keys_and_values()`) reads what that
layer fetched in this step, the same blocks. Over a quantized pool a fetch
returns the K/V dequantized, lazily: what any model code can read, while
attention over the pool reads the quantized pages (`stored`) and leaves
the dequantized copy unevaluated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from mlxkv.attention import kernels
from mlxkv.attention.mirror import KVMirror
from mlxkv.attention.shared_prefix import SharedPrefix
from mlxkv.cache.kv_pool import KVPool, PageView
from mlxkv.models.compat import BaseCache, create_attention_mask


@dataclass(frozen=True)
class GroupTables:
    """One layer group's part of a step: where its rows' K/V are, and its window."""

    block_tables: mx.array  # [B, nb] block ids from each row's first held block, padded with any valid id
    write_blocks: mx.array  # [B, L] block id of each new token's slot
    starts: tuple[int, ...]  # token position of each row's first table entry
    window: int | None = None  # tokens a query sees (itself included); None: all before it
    kernel_tables: mx.array | None = None  # block_tables, wide enough for the kernels (kernels.table_width)
    chunk: int | None = None  # a query sees only its own chunk of this many tokens
    # The kernels' small index arrays of this step, built by its first layer's call and reused
    # by the others (kernels._index_array): no per-layer mx.array for what a step shares.
    kernel_memo: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, tables: list[list[int]], starts: list[int], offsets: list[int], num_new: int,
              block_size: int, window: int | None = None, chunk: int | None = None) -> GroupTables:
        width = max(len(t) for t in tables)
        block_tables = mx.array([t + [t[0]] * (width - len(t)) for t in tables], dtype=mx.int32)
        # Padded here, from the lists, rather than by an op in every layer's kernel call.
        wide = kernels.table_width(len(tables), width)
        kernel_tables = (block_tables if wide == width
                         else mx.array([t + [t[0]] * (wide - len(t)) for t in tables], dtype=mx.int32))
        write_blocks = [[t[(p - s) // block_size] for p in range(o, o + num_new)]
                        for t, s, o in zip(tables, starts, offsets)]
        return cls(block_tables, mx.array(write_blocks, dtype=mx.int32), tuple(starts), window, kernel_tables, chunk)


@dataclass(frozen=True)
class PagedBatch:
    """Where one forward step reads and writes KV, for B sequences of L new tokens."""

    groups: tuple[GroupTables, ...]
    write_offsets: mx.array  # [B, L] offset of each new token's slot inside its block
    offsets: tuple[int, ...]  # tokens already computed, per sequence
    num_new: int
    attention: str = "reference"
    mirror: KVMirror | None = None  # contiguous copy of a lone sequence's K/V
    prefix: SharedPrefix | None = None  # leading blocks all rows share (cascade.py)

    @classmethod
    def build(cls, block_tables: list[list[int]], offsets: list[int], num_new: int, block_size: int,
              attention: str = "reference", mirror: KVMirror | None = None,
              prefix: SharedPrefix | None = None) -> PagedBatch:
        """A step of one full-attention group (a plain model)."""
        group = GroupTables.build(block_tables, [0] * len(offsets), offsets, num_new, block_size)
        return cls.of_groups((group,), offsets, num_new, block_size, attention, mirror, prefix)

    @classmethod
    def of_groups(cls, groups: tuple[GroupTables, ...], offsets: list[int], num_new: int, block_size: int,
                  attention: str = "reference", mirror: KVMirror | None = None,
                  prefix: SharedPrefix | None = None) -> PagedBatch:
        write_offsets = [[p % block_size for p in range(o, o + num_new)] for o in offsets]
        return cls(tuple(groups), mx.array(write_offsets, dtype=mx.int32), tuple(offsets), num_new,
                   attention, mirror, prefix)

    @property
    def block_tables(self) -> mx.array:
        return self.groups[0].block_tables

    @property
    def batch_size(self) -> int:
        return len(self.offsets)

    @property
    def context_lens(self) -> list[int]:
        return [o + self.num_new for o in self.offsets]


class PagedKVCache(BaseCache):
    """Page layer `layer` of group `group`'s blocks, for cache slot `slot`.

    `view`: where the slot sits in its page layer when it is not all of it,
    `heads` its K heads then; `index` names it for the mirror (None: no mirror).
    """

    def __init__(self, pool: KVPool, layer: int, batch: PagedBatch, group: int = 0, slot=None,
                 view: PageView | None = None, heads: int = 0, index: int | None = -1):
        self.pool = pool
        self.layer = layer
        self.batch = batch
        self.group = group
        self.slot = layer if slot is None else slot
        self.view = view
        self.heads = heads
        self.index = (self.slot if index == -1 else index)
        self.tables = batch.groups[group]
        self._fetched = None  # this step's K/V, for a layer that shares them
        self.stored = None  # this step's K/V as the pool stores them (a quantized pool's parts)

    @property
    def offset(self):
        # RoPE takes an int for one sequence and an array for a batch.
        if self.batch.batch_size == 1:
            return self.batch.offsets[0]
        return mx.array(self.batch.offsets)

    @property
    def start_position(self) -> int:
        """Position of the first token a fetch returns (ChunkedKVCache's; one row at a time)."""
        return self.tables.starts[0]

    def maybe_trim_front(self) -> None:
        """ChunkedKVCache's: the chunked group lets go of blocks before the chunk itself."""

    @property
    def lengths(self) -> list[int]:
        """Tokens each row's gathered K/V holds: from its table's start to its context end."""
        return [n - s for n, s in zip(self.batch.context_lens, self.tables.starts)]

    def update_and_fetch(self, keys, values):
        b, t = self.batch, self.tables
        new = self.pool.write(self.layer, t.write_blocks, b.write_offsets, keys, values, self.view)
        if b.mirror is not None and t.window is None and t.chunk is None and self.index is not None:
            self.stored = self._fetch_mirrored(*new)
        else:
            self.stored = self._gather_stored()
        quantized = self.pool.kv.quantized
        self._fetched = self.pool.dequantized(self.stored) if quantized else self.stored
        return self._fetched

    def keys_and_values(self):
        """This step's K/V of the slot: what a layer that shares them attends to."""
        return self._fetched if self._fetched is not None else self._gather()

    def quantized_pages(self, keys):
        """This step's quantized K and V pages, when `keys` is what the step fetched (a model
        may pass K/V it changed: those are attended as given); None over a full-precision pool."""
        fetched = self._fetched
        if not self.pool.kv.quantized or fetched is None or keys is not fetched[0]:
            return None
        return self.stored

    def _gather(self):
        # The gathered copy is what any attention code can use; when the
        # kernel path or cascade attention serves instead, MLX never evaluates it.
        return self.pool.gather(self.layer, self.tables.block_tables, self._length, self.view, self.heads)

    @property
    def _length(self) -> int | None:
        return self.lengths[0] if self.batch.batch_size == 1 else None

    def _gather_stored(self):
        if self.pool.kv.quantized:
            return self.pool.gather_quantized(self.layer, self.tables.block_tables, self._length)
        return self._gather()

    def _fetch_mirrored(self, keys, values):
        """K/V from the lone sequence's mirror, as the pool stores them (`keys`, `values`: the new ones)."""
        mirror, offset = self.batch.mirror, self.batch.offsets[0]
        if not mirror.covers(self.index, offset):
            # First step of a request (maybe on prefix hits): copy once from the pool.
            return mirror.reset(self.index, *self._gather_stored())
        return mirror.write(self.index, offset, keys, values)

    # Models chain graph dependencies through a cache's arrays (deepseek_v32's
    # indexer, minimax_m3_vl): reading gives this step's K/V, writing is dropped,
    # since the runner evaluates the pool itself.
    @property
    def keys(self):
        return self.keys_and_values()[0]

    @keys.setter
    def keys(self, value) -> None:
        pass

    @property
    def values(self):
        return self.keys_and_values()[1]

    @values.setter
    def values(self, value) -> None:
        pass

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        b, t = self.batch, self.tables
        if t.window is None and t.chunk is None and b.batch_size == 1:
            return create_attention_mask(N, offset=b.offsets[0], return_array=return_array, window_size=window_size)
        # Key j of row s (position starts[s] + j) is visible to query i
        # (position offsets[s] + i) when it is not later, within the window
        # (or the query's chunk), and inside the row's context (the tables are padded).
        width = t.block_tables.shape[1] * self.pool.layout.block_size
        k_pos = mx.array(t.starts)[:, None, None, None] + mx.arange(width)
        q_pos = mx.array(b.offsets)[:, None, None, None] + mx.arange(N)[:, None]
        mask = k_pos <= q_pos
        if t.window is not None:
            mask = mask & (q_pos - k_pos < t.window)
        if t.chunk is not None:
            mask = mask & (q_pos // t.chunk == k_pos // t.chunk)
        if b.batch_size == 1:
            return mask[0, 0, :, : self.lengths[0]]
        return mask

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
        return self.pool.layer_nbytes(self.layer)


class UnusedSlotCache(PagedKVCache):
    """A slot the model never writes (nemotron-nas: a layer whose attention is a linear map).

    It keeps nothing; the model may still ask it for a mask or an offset, which
    it answers as a full-attention slot of the batch does.
    """

    def update_and_fetch(self, keys, values):
        raise RuntimeError(f"cache slot {self.slot} was probed as unused, and written")
