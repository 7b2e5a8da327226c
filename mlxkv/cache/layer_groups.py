"""Layer groups: which cache slots share a cache rule, and how they share the pool.

A model's own `make_cache()` says what each cache slot (each layer that
keeps a cache) needs: mlx-lm's `KVCache` is full attention, a
`RotatingKVCache(max_size=W)` a sliding window of W tokens. Every slot of
one rule forms a kind; each kind is cut into groups of at most P slots,
P being the smallest kind's size. All groups draw from one block pool
whose blocks hold P layers (a page): a block id belongs to one group at a
time, and page layer j of that block holds the group's j-th slot. This is
vLLM's hybrid layout. A plain model is one full-attention group of all
its layers, a page per block as before; for Gemma 3 (5 sliding layers to
1 full) the sliding groups hold only the blocks their window reaches, so
a long context costs what the full-attention layers need, plus a window.

The rule of a group says which blocks a sequence must hold:
- full attention: every block from the first;
- sliding window W: only those that hold one of the last W positions
  before the next token (the window), plus the one being written.

Recurrent and linear-attention layers (mlx-lm's `ArraysCache`: gated
delta net, Mamba, short convolutions) keep a fixed-size state per
sequence instead of K/V, so they take no pages: they are the layout's
recurrent slots, and their prefix hits come from state checkpoints
(cache/checkpoints.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxkv.errors import MlxkvError

FULL = "full"
SLIDING = "sliding"
RECURRENT = "recurrent"


@dataclass(frozen=True, slots=True)
class KVGroup:
    """A group of cache slots with one rule, stored in the pages of one block table."""

    index: int
    window: int | None  # tokens of a sliding window; None: full attention
    slots: tuple[int, ...]  # cache slots, in page-layer order

    def describe(self) -> str:
        return FULL if self.window is None else f"{SLIDING}{self.window}"


@dataclass(frozen=True, slots=True)
class GroupLayout:
    groups: tuple[KVGroup, ...]
    num_slots: int  # cache slots of the model (its make_cache() length)
    page_layers: int  # layers a block holds: the largest group's slot count
    recurrent: tuple[int, ...] = ()  # slots that keep a recurrent state, not K/V
    state_sizes: tuple[int, ...] = ()  # arrays each recurrent slot's state has (ArraysCache size)

    @classmethod
    def plain(cls, num_slots: int) -> GroupLayout:
        """Every slot full attention: one group, a page of every layer."""
        return cls((KVGroup(0, None, tuple(range(num_slots))),), num_slots, num_slots)

    @property
    def is_plain(self) -> bool:
        return len(self.groups) == 1 and self.groups[0].window is None and not self.recurrent

    @property
    def has_recurrent(self) -> bool:
        return bool(self.recurrent)

    @property
    def full_groups(self) -> tuple[KVGroup, ...]:
        return tuple(g for g in self.groups if g.window is None)

    @property
    def sliding_groups(self) -> tuple[KVGroup, ...]:
        return tuple(g for g in self.groups if g.window is not None)

    def place(self, slot: int) -> tuple[KVGroup, int]:
        """The group of an attention cache slot and its page layer."""
        for group in self.groups:
            if slot in group.slots:
                return group, group.slots.index(slot)
        raise KeyError(slot)

    def describe(self) -> str:
        """The layout as one line, for the model fingerprint: another layout never shares blocks."""
        parts = [f"{g.describe()}:{','.join(map(str, g.slots))}" for g in self.groups]
        if self.recurrent:
            parts.append(f"{RECURRENT}:{','.join(f'{s}x{n}' for s, n in zip(self.recurrent, self.state_sizes))}")
        return f"pages of {self.page_layers}; " + "; ".join(parts)


def group_layout(caches: list) -> GroupLayout:
    """Group a model's cache objects (mlx-lm's, one per slot); MlxkvError naming what is missing."""
    kinds: dict[int | None, list[int]] = {}
    recurrent: dict[int, int] = {}
    for slot, cache in enumerate(caches):
        if type(cache).__name__ == "ArraysCache":
            recurrent[slot] = len(cache.cache)
        else:
            kinds.setdefault(_window_of(cache), []).append(slot)
    if not kinds:
        what = "keeps only recurrent state" if recurrent else "keeps no cache"
        raise MlxkvError(f"the model {what}: mlxkv needs attention layers to page")
    if list(kinds) == [None] and not recurrent:
        return GroupLayout.plain(len(caches))
    page = min(len(slots) for slots in kinds.values())
    groups = []
    for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
        slots = kinds[window]
        for start in range(0, len(slots), page):
            groups.append(KVGroup(len(groups), window, tuple(slots[start : start + page])))
    return GroupLayout(tuple(groups), len(caches), page, tuple(recurrent), tuple(recurrent.values()))


def _window_of(cache) -> int | None:
    """None for full attention, the window for a sliding one; MlxkvError for anything else."""
    name = type(cache).__name__
    if name == "KVCache":
        return None
    if name == "RotatingKVCache":
        if getattr(cache, "keep", 0):
            raise MlxkvError(f"a RotatingKVCache that keeps its first {cache.keep} tokens is not paged yet "
                             "(mlxkv pages sliding windows without kept tokens)")
        return int(cache.max_size)
    missing = {
        "ChunkedKVCache": "chunked local attention (ChunkedKVCache)",
        "CacheList": "composite caches (CacheList)",
        "QuantizedKVCache": "quantized KV (QuantizedKVCache)",
    }.get(name, f"{name} layers")
    raise MlxkvError(f"mlxkv does not page {missing} yet")
