"""How slots of different K/V shapes share the pages of one block pool.

Every page layer of every block has one shape: `k_heads` unit heads of
`k_dim` for K, `v_heads` of `v_dim` for V (K and V apart), so a block
id can pass from a group of one shape to a group of another, the tiers
move pages of one shape, and a pool's bytes per block are one number.
The units are the greatest common divisor of the slots' head dims, so a
slot of shape `[heads, dim]` takes `heads * dim / unit` unit heads: a
head twice the unit's width is two unit heads side by side (Gemma 4's
512-wide global head beside 256-wide sliding ones). A page layer is as
wide as the widest slot, and slots of a smaller shape share one (two
sliding Gemma 4 layers per page layer of one global layer), so no byte
of a page is idle where the shapes divide evenly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# What a slot's `update_and_fetch` is given as values: its own V, the keys
# again (deepseek_v32's indexer: a K cache alone), or an empty V of head dim 0
# (minimax_m3_vl's indexer). The last two store no V.
OWN, KEYS, EMPTY = "own", "keys", "empty"


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one attention slot stores per token."""

    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int
    values: str = OWN

    @property
    def stores_values(self) -> bool:
        return self.values == OWN and self.v_heads * self.v_dim > 0

    def describe(self) -> str:
        v = f"v{self.v_heads}x{self.v_dim}" if self.stores_values else f"v={self.values}"
        return f"k{self.k_heads}x{self.k_dim}{v}"


@dataclass(frozen=True, slots=True)
class PageFormat:
    """Every page layer: K `[k_heads, block, k_dim]`, V `[v_heads, block, v_dim]` per block."""

    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int

    def units(self, shape: KVShape) -> tuple[int, int]:
        """Unit heads a slot of `shape` takes in a page layer: (K, V)."""
        v = shape.v_heads * shape.v_dim // self.v_dim if shape.stores_values else 0
        return shape.k_heads * shape.k_dim // self.k_dim, v

    def describe(self) -> str:
        return f"k{self.k_heads}x{self.k_dim}v{self.v_heads}x{self.v_dim}"


def pack_kinds(kinds: list[tuple[int, KVShape | None]]) -> tuple[PageFormat | None, list[tuple[int, int]]]:
    """The page format and, per kind (its slot count and shape), (slots per group, slots per page layer).

    One shape everywhere (or unknown, None): no format (the probed shape is the
    page), one slot per page layer, groups of P slots, P the smallest kind's
    count. Several shapes: unit heads as above, each kind packing as many slots
    per page layer as fit, and P the fewest page layers a kind fills.
    """
    if not kinds:
        return None, []
    shapes = {shape for _, shape in kinds}
    if None in shapes or (len(shapes) == 1 and next(iter(shapes)).values == OWN):
        p = min(n for n, _ in kinds)
        return None, [(p, 1)] * len(kinds)
    with_values = [s for s in shapes if s.stores_values]
    k_dim = math.gcd(*(s.k_dim for s in shapes))
    v_dim = math.gcd(*(s.v_dim for s in with_values)) if with_values else 1
    probe = PageFormat(1, k_dim, 1, v_dim)
    units = [probe.units(shape) for _, shape in kinds]
    page = PageFormat(max(k for k, _ in units), k_dim, max(v for _, v in units), v_dim)
    packs = [min(page.k_heads // k, page.v_heads // v if v else page.k_heads) for k, v in units]
    p = min(-(-n // pack) for (n, _), pack in zip(kinds, packs))
    return page, [(p * pack, pack) for pack in packs]
