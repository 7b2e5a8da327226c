"""Copies of blocks' K/V outside the pool: what moves between the pool and its tiers.

A `BlockKV` is one block's K and V for every layer. A `KVRun` is a stretch
of consecutive blocks stored layer-major, so each layer's share is one slab
that becomes one slice copy into the pool; blocks of a run are views of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx


@dataclass
class BlockKV:
    """One block's K and V for every layer: `[num_layers, n_kv_heads, block_size, head_dim]`.

    `run` and `index` say where the block sits when it is a view of a
    `KVRun`: the pool then copies a stretch of consecutive blocks of one run
    with one slice per layer instead of one copy per block. `group` is the
    layer group (cache/layer_groups.py) whose page layers these are: the
    SSD tier writes it into the block's file and checks it on a hit.
    """

    keys: mx.array
    values: mx.array
    run: KVRun | None = None
    index: int = 0
    group: int = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@dataclass(eq=False)
class KVRun:
    """Consecutive blocks' K and V, layer-major: `[num_layers, n, n_kv_heads, block_size, head_dim]`.

    Layer-major so each layer's share of the run is one contiguous slab, the
    shape of a slice of that layer's pool. Never written after it is made:
    tiers share runs by reference.
    """

    keys: mx.array
    values: mx.array

    @classmethod
    def stack(cls, blocks: Sequence[BlockKV]) -> KVRun:
        """A new run holding copies of these blocks, in order (lazy)."""
        return cls(mx.stack([b.keys for b in blocks], axis=1), mx.stack([b.values for b in blocks], axis=1))

    def __len__(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def block(self, i: int, group: int = 0) -> BlockKV:
        return RunBlock(self, i, group)

    def blocks(self, groups: Sequence[int] | None = None) -> list[BlockKV]:
        """Views of every block; `groups`: each one's layer group (all 0 when None)."""
        return [self.block(i, groups[i] if groups else 0) for i in range(len(self))]


class RunBlock(BlockKV):
    """Block `index` of a KVRun. Its K/V slices are made when first asked for:
    a hydrate copies whole stretches of the run and never asks (two MLX ops
    per block were a tenth of an SSD hydrate's time)."""

    def __init__(self, run: KVRun, index: int, group: int = 0):
        self.run, self.index, self.group = run, index, group

    @cached_property
    def keys(self) -> mx.array:
        return self.run.keys[:, self.index]

    @cached_property
    def values(self) -> mx.array:
        return self.run.values[:, self.index]

    @property
    def nbytes(self) -> int:
        return self.run.nbytes // len(self.run)
