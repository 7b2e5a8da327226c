"""The leading blocks every row of a decode batch shares, kept as one contiguous copy.

Rows that hit the same cached prefix hold the same block ids at the same
positions of their block tables. Cascade attention (cascade.py) reads that
shared prefix once for the whole batch from this copy, instead of gathering
it from the pool once per row, per layer, per step.

The copy is keyed by the blocks' content hashes (a block id can hold other
content after an eviction) and is float32, the precision cascade attention
computes in; over a quantized pool it is the pool's own quantized parts. It is gathered from the pool once and changes only when the
key does: the part common to the old and new key is kept, the rest gathered.
It stays equal to the pool's blocks: shared blocks are full and immutable
while referenced, and the copy is dropped when no row that used it is left.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.cache.block_pool import Block
from mlxkv.cache.kv_format import page_map, parts_of
from mlxkv.cache.kv_pool import KVPool


def shared_blocks(tables: list[list[Block]], computed: int, block_size: int) -> list[Block]:
    """The longest run of leading blocks common to all rows' tables, before `computed` tokens
    (the least any row has computed: every row's write position is past it).

    Empty when some block of that run has no hash (prefix caching off).
    """
    first = tables[0][: computed // block_size]
    n = 0
    while n < len(first) and all(len(t) > n and t[n] is first[n] for t in tables):
        n += 1
    run = first[:n]
    return run if all(b.block_hash is not None for b in run) else []


class SharedPrefix:
    """Per-layer float32 K/V `[1, H, P, D]` of a shared prefix (a quantized pool's parts), and the rows using it."""

    def __init__(self, num_layers: int):
        self.key: tuple[bytes, ...] = ()
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.num_tokens = 0
        self.rows: set[int] = set()
        self.gathers = 0  # key changes that read the pool (a shrink reads nothing)

    @property
    def num_blocks(self) -> int:
        return len(self.key)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for page in self.keys + self.values if page is not None for x in parts_of(page))

    def update(self, blocks: list[Block], pool: KVPool, rows: set[int]) -> None:
        """Make the copy hold `blocks`, gathering from the pool only what it lacks."""
        self.rows = rows
        key = tuple(b.block_hash for b in blocks)
        if key == self.key:
            return
        common = _common_length(self.key, key)
        bs = pool.layout.block_size
        ids = mx.array([[b.block_id for b in blocks[common:]]], dtype=mx.int32)
        for layer in range(len(self.keys)):
            self.keys[layer], self.values[layer] = self._grown(layer, common * bs, ids, pool)
        # Evaluated now: no lazy read of a pool array may outlive the step
        # (kv_pool.py). It waits for a step in flight, only when the key changes.
        mx.eval([parts_of(page) for page in self.keys + self.values])
        self.key, self.num_tokens = key, len(key) * bs
        self.gathers += int(common < len(key))

    def _grown(self, layer: int, keep: int, ids: mx.array, pool: KVPool):
        """The layer's first `keep` tokens, then the blocks `ids [1, n]` gathered from the pool."""
        parts = ([(page_map(lambda x: x[:, :, :keep], self.keys[layer]),
                   page_map(lambda x: x[:, :, :keep], self.values[layer]))] if keep else [])
        if ids.size:
            if pool.kv.quantized:
                parts.append(pool.gather_quantized(layer, ids))
            else:
                parts.append(tuple(x.astype(mx.float32) for x in pool.gather(layer, ids)))
        if len(parts) == 1:
            return tuple(page_map(mx.contiguous, x) for x in parts[0])  # a shrink's slice is strided
        return tuple(_joined(a, b) for a, b in zip(*parts))

    def release(self, row: int) -> bool:
        """Forget a finished row; True when no row uses the copy any more."""
        self.rows.discard(row)
        return not self.rows


def _joined(a, b):
    """Two pages' tokens one after the other (arrays, or quantized parts each)."""
    if isinstance(a, tuple):
        return tuple(mx.concatenate([x, y], axis=2) for x, y in zip(a, b))
    return mx.concatenate([a, b], axis=2)


def _common_length(a: tuple, b: tuple) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
