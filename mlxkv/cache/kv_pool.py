"""Paged KV storage: one K pool and one V pool per layer.

Each pool is `[num_blocks, n_kv_heads, block_size, head_dim]` in the model's
activation dtype, so one (block, head) tile is contiguous: the gather path,
the Metal kernels and the spill tiers all read whole tiles. A quantized
pool (cache/kv_format.py) holds one `uint32` record per token vector in
place of its values (packed words, then scales, then biases), written a
token vector at a time, so a row's words, scales and biases are one span.

Writes use MLX indexed assignment on the only live reference to the pool
array, so MLX donates the buffer and scatters in place. A second reference
(even a lazy slice kept around) would make every write copy the whole pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import mlx.core as mx

from mlxkv.cache.block_kv import BlockKV, KVRun
from mlxkv.cache.kv_format import FULL, KVFormat
from mlxkv.cache.layer_groups import GroupLayout
from mlxkv.cache.page_format import EMPTY, KEYS, OWN
from mlxkv.errors import MlxkvError

log = logging.getLogger(__name__)
QUANTIZABLE = (mx.float16, mx.bfloat16, mx.float32)  # scales in the model's dtype, as the kernels read


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a block holds: `num_layers` page layers (every layer of a plain
    model; a group's share of a hybrid one), each of K `[n_kv_heads, block,
    head_dim]` and V `[v_heads, block, v_head_dim]` (cache/page_format.py)."""

    num_layers: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    block_size: int
    dtype: mx.Dtype
    groups: GroupLayout | None = None  # None: one full-attention group of all layers
    v_heads: int | None = None  # None: n_kv_heads
    kv: KVFormat = FULL  # how pages store K/V: full precision, or quantized

    @property
    def group_layout(self) -> GroupLayout:
        return self.groups or GroupLayout.plain(self.num_layers)

    @property
    def num_v_heads(self) -> int:
        return self.n_kv_heads if self.v_heads is None else self.v_heads

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes one token takes across all page layers."""
        per_layer = (self.n_kv_heads * self.kv.vector_bytes(self.head_dim, self.dtype)
                     + self.num_v_heads * self.kv.vector_bytes(self.v_head_dim, self.dtype))
        return self.num_layers * per_layer

    @property
    def kv_format(self) -> str:
        """The format's name: the dtype ("float16") or "q8g64"."""
        return self.kv.name(self.dtype)

    @property
    def stored_page(self) -> tuple[int, int, int, int]:
        """A page layer outside the pool (the tiers): K heads, K's last axis, V heads, V's."""
        kv, dtype = self.kv, self.dtype
        return (self.n_kv_heads, kv.stored_dim(self.head_dim, dtype), self.num_v_heads,
                kv.stored_dim(self.v_head_dim, dtype))

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def with_kv_format(layout: KVLayout, kv: KVFormat) -> KVLayout:
    """The layout with its pages stored in `kv`; MlxkvError where a quantized pool cannot hold them.

    Only pages of one K/V shape quantize: a page shared by slots of other
    shapes (cache/page_format.py) holds unit heads that the quantized
    reference path and the kernels do not read. A hybrid's recurrent state
    is not KV: it stays in the model's dtype.
    """
    if not kv.quantized:
        return layout
    if not layout.num_layers:
        log.warning("this model keeps no K/V (its layers are recurrent state alone): --kv-bits changes nothing")
        return layout
    groups = layout.group_layout
    if not groups.uniform:
        raise MlxkvError(f"a quantized KV pool holds layers of one K/V shape, and this model's differ (its pages "
                         f"hold unit heads of several shapes, {groups.page.describe()}); run it without --kv-bits")
    if layout.dtype not in QUANTIZABLE:
        raise MlxkvError(f"a quantized KV pool needs K/V in float16, bfloat16 or float32, not {layout.dtype}")
    for dim in (layout.head_dim, layout.v_head_dim):
        kv.check(dim)
    return replace(layout, kv=kv)


@dataclass(frozen=True, slots=True)
class PageView:
    """Where one slot's K/V sit in its page layer, when that is not the whole of it.

    K takes unit heads `k_head` on, `k_split` per real head (a head of twice the
    unit's width is two unit heads); V likewise, unless the slot stores no V
    (`values` KEYS: a fetch returns the keys again; EMPTY: a V of head dim 0).
    """

    k_head: int = 0
    k_split: int = 1
    v_head: int = 0
    v_split: int = 1
    values: str = OWN
    v_heads: int = 0  # real V heads (EMPTY: the empty V's); 0: as many as K's


class KVPool:
    """Every page layer's K and V: an array each (a quantized pool's: of records)."""

    def __init__(self, layout: KVLayout, num_blocks: int, pages: tuple[list, list] | None = None):
        """Zeros, allocated now; or `pages`, every layer's K and V made elsewhere (the speed
        gate's random ones), left lazy: a gate whose timer runs no step never computes them."""
        self.layout = layout
        self.kv = layout.kv
        self.num_blocks = num_blocks
        self.keys, self.values = pages or (
            [self.kv.zeros(self._k_shape(num_blocks), layout.dtype) for _ in range(layout.num_layers)],
            [self.kv.zeros(self._v_shape(num_blocks), layout.dtype) for _ in range(layout.num_layers)])
        if pages is None:
            mx.eval(self.arrays)
        self._heads = mx.arange(layout.n_kv_heads)

    def _k_shape(self, num_blocks: int) -> tuple[int, ...]:
        return num_blocks, self.layout.n_kv_heads, self.layout.block_size, self.layout.head_dim

    def _v_shape(self, num_blocks: int) -> tuple[int, ...]:
        return num_blocks, self.layout.num_v_heads, self.layout.block_size, self.layout.v_head_dim

    def grow(self, num_blocks: int) -> None:
        """Hold `num_blocks` blocks, the new ones zeros; a layer at a time, so a growth
        costs one layer's old arrays on top (block_pool.py decides when)."""
        extra = num_blocks - self.num_blocks
        if extra <= 0:
            return
        for layer in range(self.layout.num_layers):
            for pools, shape in ((self.keys, self._k_shape(extra)), (self.values, self._v_shape(extra))):
                pools[layer] = mx.concatenate([pools[layer], self.kv.zeros(shape, self.layout.dtype)])
                mx.eval(pools[layer])
        self.num_blocks = num_blocks

    def shrink(self, moves: list[tuple[int, int]], num_blocks: int) -> None:
        """Copy each kept block from its old id to its new one, then hold only `num_blocks`
        blocks (block_pool.py's shrink decides which). A layer at a time, as grow."""
        src = mx.array([old for old, _ in moves], dtype=mx.int32) if moves else None
        dst = mx.array([new for _, new in moves], dtype=mx.int32) if moves else None
        for layer in range(self.layout.num_layers):
            for pools in (self.keys, self.values):
                if moves:
                    pools[layer][dst] = pools[layer][src]
                pools[layer] = mx.array(pools[layer][:num_blocks])  # a copy: the old buffer can go
                mx.eval(pools[layer])
        self.num_blocks = num_blocks
        mx.clear_cache()  # give the freed buffers back to the system, not MLX's cache

    @property
    def arrays(self) -> list[mx.array]:
        """Every layer's K and V pool arrays: what to evaluate so queued writes land."""
        return [*self.keys, *self.values]

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    def layer_nbytes(self, layer: int) -> int:
        return self.keys[layer].nbytes + self.values[layer].nbytes

    def write(self, layer: int, block_ids: mx.array, offsets: mx.array, keys: mx.array, values: mx.array,
              view: PageView | None = None):
        """Scatter new K/V `[B, H, L, D]` to slots given as `[B, L]` block ids and in-block offsets.

        Returns the new K and V as stored: as given, or mx.quantize's (packed,
        scales, biases) of each token's vector, which the pool keeps as records.
        """
        blk = block_ids[..., None]
        off = offsets[..., None]
        # Index arrays broadcast to [B, L, H]; the values must be laid out the same.
        if self.kv.quantized:  # uniform pages only: with_kv_format refuses page views
            # Scales in the pool's dtype: the record's width depends on it.
            dtype = self.layout.dtype
            stored = self.kv.quantize(keys.astype(dtype)), self.kv.quantize(values.astype(dtype))
            self.keys[layer][blk, self._heads, off] = self.kv.record(stored[0]).transpose(0, 2, 1, 3)
            self.values[layer][blk, self._heads, off] = self.kv.record(stored[1]).transpose(0, 2, 1, 3)
            return stored
        if view is None:
            self.keys[layer][blk, self._heads, off] = keys.transpose(0, 2, 1, 3)
            self.values[layer][blk, self._heads, off] = values.transpose(0, 2, 1, 3)
            return keys, values
        self.keys[layer][blk, _heads(view.k_head, keys, view.k_split), off] = _to_units(keys, view.k_split)
        if view.values == OWN:
            self.values[layer][blk, _heads(view.v_head, values, view.v_split), off] = _to_units(values, view.v_split)
        return keys, values

    def gather(self, layer: int, block_tables: mx.array, length: int | None = None, view: PageView | None = None,
               heads: int = 0):
        """Contiguous K/V `[B, H, T, D]` for block tables `[B, nb]`.

        T is nb * block_size, or `length` when given (a single sequence
        gathers exactly its context, which keeps results bit-identical to a
        contiguous cache). Contiguity matters: SDPA on a strided view was
        measured 3-10x slower on CPU. `view`: the slot's place in the page,
        `heads` its real K heads. A quantized pool's come dequantized: what
        any attention code can read (attention over the pool reads
        `gather_quantized` instead, and this is never evaluated).
        """
        if self.kv.quantized:
            return self.dequantized(self.gather_quantized(layer, block_tables, length))
        if view is None:
            return (
                self._gather_one(self.keys[layer], block_tables, length),
                self._gather_one(self.values[layer], block_tables, length),
            )
        keys = _gather_units(self.keys[layer], block_tables, length, view.k_head, heads, view.k_split)
        if view.values == KEYS:
            return keys, keys
        if view.values == EMPTY:
            return keys, mx.zeros((*keys.shape[:1], view.v_heads, keys.shape[2], 0), keys.dtype)
        v_heads = heads if view.v_heads == 0 else view.v_heads
        return keys, _gather_units(self.values[layer], block_tables, length, view.v_head, v_heads, view.v_split)

    def gather_quantized(self, layer: int, block_tables: mx.array, length: int | None = None):
        """A quantized pool's K and V as mx.quantize's parts `[B, H, T, ...]` for block tables
        `[B, nb]`, as `gather`: each part gathered from its view of the records (the copy a
        gather makes anyway), so no step copies the records whole first."""
        dims, dtype = (self.layout.head_dim, self.layout.v_head_dim), self.layout.dtype
        return tuple(tuple(self._gather_one(p, block_tables, length) for p in self.kv.parts(page, dim, dtype))
                     for page, dim in zip((self.keys[layer], self.values[layer]), dims))

    def dequantized(self, stored):
        """Quantized K and V parts as arrays in the model's dtype."""
        return tuple(self.kv.dequantize(parts, self.layout.dtype) for parts in stored)

    @staticmethod
    def _gather_one(pool: mx.array, block_tables: mx.array, length: int | None) -> mx.array:
        B, nb = block_tables.shape
        _, H, bs, D = pool.shape
        tiles = pool[block_tables]  # [B, nb, H, bs, D]
        x = tiles.transpose(0, 2, 1, 3, 4).reshape(B, H, nb * bs, D)
        if length is not None and length < nb * bs:
            x = mx.contiguous(x[:, :, :length, :])
        return x

    def read_blocks(self, block_ids: list[int], groups: list[int] | None = None) -> list[BlockKV]:
        """Copies of the given blocks' K/V for every layer, evaluated now.

        The copies form one layer-major `KVRun` and each block is a view of
        it, so a tier can keep or write the run whole. Evaluated at once so no
        lazy slice of a pool outlives this call (it would turn the next
        in-place write into a full copy). `groups`: each block's layer group.
        A quantized pool's pages come as their bytes (kv_format.py).
        """
        idx = mx.array(block_ids)
        run = KVRun(mx.stack([self._page_copy(k, idx) for k in self.keys]),
                    mx.stack([self._page_copy(v, idx) for v in self.values]))
        mx.eval(run.keys, run.values)
        return run.blocks(groups)

    def _page_copy(self, page, idx: mx.array) -> mx.array:
        return self.kv.to_bytes(page[idx]) if self.kv.quantized else page[idx]

    def write_blocks(self, block_ids: list[int], blocks: list[BlockKV]) -> None:
        """Fill whole blocks (hydrate) with K/V read back from a tier.

        One slice update per layer for each stretch where the block ids and
        the blocks' places in one `KVRun` both advance by one: a slice update
        of a contiguous slab runs near copy speed, while MLX's CPU scatter
        moves about 0.7 GB/s and every extra op costs a dispatch. Blocks that
        are no run's views are first stacked into one.
        """
        for dst, run, src, n in _segments(block_ids, blocks):
            for layer in range(self.layout.num_layers):
                # One indexing op per side: a slice of a slice was measured to
                # make MLX's CPU slice update copy at half the speed.
                self.keys[layer][dst : dst + n] = self._stored(run.keys[layer, src : src + n])
                self.values[layer][dst : dst + n] = self._stored(run.values[layer, src : src + n])
        mx.eval(self.arrays)

    def _stored(self, page: mx.array) -> mx.array:
        """A tier's page as the pool holds it: a quantized one's bytes are its records."""
        return self.kv.from_bytes(page) if self.kv.quantized else page.astype(self.layout.dtype)


def _heads(first: int, x: mx.array, split: int) -> mx.array:
    """The unit heads a slot's `[B, H, L, D]` takes, from `first` on."""
    return mx.arange(first, first + x.shape[1] * split)


def _to_units(x: mx.array, split: int) -> mx.array:
    """`[B, H, L, D]` as `[B, L, H * split, D / split]`: each head cut into `split` unit heads."""
    B, H, L, D = x.shape
    x = x.transpose(0, 2, 1, 3)
    return x if split == 1 else x.reshape(B, L, H * split, D // split)


def _gather_units(pool: mx.array, block_tables: mx.array, length: int | None, first: int, heads: int,
                  split: int) -> mx.array:
    """A slot's `[B, heads, T, D]` from its unit heads `first..` of a page layer `[blocks, C, bs, U]`."""
    B, nb = block_tables.shape
    _, _, bs, U = pool.shape
    tiles = pool[block_tables[..., None], mx.arange(first, first + heads * split)]  # [B, nb, heads*split, bs, U]
    x = tiles.reshape(B, nb, heads, split, bs, U).transpose(0, 2, 1, 4, 3, 5).reshape(B, heads, nb * bs, split * U)
    if length is not None and length < nb * bs:
        x = mx.contiguous(x[:, :, :length, :])
    return x


def _segments(block_ids: list[int], blocks: list[BlockKV]) -> list[tuple[int, KVRun, int, int]]:
    """(first block id, run, first index in the run, length) of each stretch to copy."""
    loose = [i for i, b in enumerate(blocks) if b.run is None]
    if loose:
        stacked = KVRun.stack([blocks[i] for i in loose])
        blocks = list(blocks)
        for j, i in enumerate(loose):
            blocks[i] = BlockKV(blocks[i].keys, blocks[i].values, stacked, j, blocks[i].group)
    segments: list[list] = []
    for dst, block in zip(block_ids, blocks):
        last = segments[-1] if segments else None
        if last and last[1] is block.run and last[0] + last[3] == dst and last[2] + last[3] == block.index:
            last[3] += 1
        else:
            segments.append([dst, block.run, block.index, 1])
    return [tuple(s) for s in segments]
