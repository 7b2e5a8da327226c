"""Layer groups: which cache slots share a cache rule, and how they share the pool.

A model's own `make_cache()` says what each cache slot (each layer that
keeps a cache) needs: mlx-lm's `KVCache` is full attention, a
`RotatingKVCache(max_size=W)` a sliding window of W tokens, a
`ChunkedKVCache(C)` chunked local attention (Llama 4: a query sees its own
chunk of C tokens). A `CacheList` is a composite slot: each part gets the
rule of its own type, and is addressed `(slot, part)`. Every slot of one
rule and one K/V shape forms a kind; each kind is cut into groups that
fill P page layers, P being the smallest kind's need. All groups draw
from one block pool whose blocks hold P page layers (a page): a block id
belongs to one group at a time. This is vLLM's hybrid layout. A plain
model is one full-attention group of all its layers, a page per block as
before; for Gemma 3 (5 sliding layers to 1 full) the sliding groups hold
only the blocks their window reaches, so a long context costs what the
full-attention layers need, plus a window.

The rule of a group says which blocks a sequence must hold:
- full attention: every block from the first;
- sliding window W: only those that hold one of the last W positions
  before the next token (the window), plus the one being written;
- chunked C: those from the start of the next token's chunk on.

Layers whose K/V differ in shape (Gemma 4's wider global head, OpenELM's
per-layer head counts, an indexer's keys beside a latent) still share
pages (page_format.py): a page layer holds `k_heads` unit heads of width
`k_dim` for K and `v_heads` of `v_dim` for V (K and V apart), and a slot
takes as many unit heads as its shape needs, several slots of a small
shape sharing one page layer. Uniform models keep one slot per page
layer, whole, as before.

Recurrent and linear-attention layers (mlx-lm's `ArraysCache`: gated
delta net, Mamba, short convolutions; and deepseek_v41's `LayerCache`)
keep a per-sequence state instead of paged K/V, so they take no pages:
they are the layout's state slots, and their prefix hits come from state
checkpoints (cache/checkpoints.py). A model of state slots alone (Mamba,
RWKV-7) has no attention groups at all. A slot the model never touches
(nemotron-nas: a layer whose attention is a linear map) keeps nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxkv.cache.page_format import KVShape, PageFormat, pack_kinds
from mlxkv.errors import MlxkvError

FULL = "full"
SLIDING = "sliding"
CHUNKED = "chunked"
RECURRENT = "recurrent"

Slot = int | tuple[int, int]  # a make_cache() entry, or (slot, part) of a CacheList


@dataclass(frozen=True, slots=True)
class KVGroup:
    """A group of cache slots with one rule, stored in the pages of one block table."""

    index: int
    window: int | None  # tokens of a sliding window; None: full attention (or chunked)
    slots: tuple[Slot, ...]  # cache slots, in page order
    chunk: int | None = None  # tokens of an attention chunk (chunked local attention)
    shape: KVShape | None = None  # each slot's K/V; None: the page format's, one slot per page layer
    pack: int = 1  # slots per page layer

    def describe(self) -> str:
        rule = FULL if self.window is None else f"{SLIDING}{self.window}"
        rule = rule if self.chunk is None else f"{CHUNKED}{self.chunk}"
        return rule if self.shape is None else f"{rule}[{self.shape.describe()}/{self.pack}]"

    def place(self, j: int, page: PageFormat | None) -> tuple[int, int, int]:
        """(page layer, first K unit head, first V unit head) of the group's j-th slot."""
        if self.shape is None or page is None:
            return j, 0, 0
        k_units, v_units = page.units(self.shape)
        return j // self.pack, j % self.pack * k_units, j % self.pack * v_units


@dataclass(frozen=True, slots=True)
class GroupLayout:
    groups: tuple[KVGroup, ...]
    num_slots: int  # cache slots of the model (its make_cache() length)
    page_layers: int  # page layers a block holds
    recurrent: tuple[Slot, ...] = ()  # slots that keep a per-sequence state, not K/V
    state_sizes: tuple[int, ...] = ()  # arrays each state slot has (ArraysCache size)
    page: PageFormat | None = None  # every page layer's shape; None: as probed (uniform)
    composites: tuple[tuple[int, int], ...] = ()  # (slot, parts) of each CacheList slot
    unused: tuple[Slot, ...] = ()  # slots the model never writes: they keep nothing
    layer_states: tuple[int | None, ...] = ()  # per state slot: a LayerCache's window, None: ArraysCache
    batched: bool = True  # whether decode rows share one forward (not where a model reads one offset)

    @classmethod
    def plain(cls, num_slots: int) -> GroupLayout:
        """Every slot full attention: one group, a page of every layer."""
        return cls((KVGroup(0, None, tuple(range(num_slots))),), num_slots, num_slots)

    @property
    def is_plain(self) -> bool:
        return (len(self.groups) == 1 and self.groups[0].window is None and self.groups[0].chunk is None
                and self.uniform and not self.recurrent and not self.composites and not self.unused)

    @property
    def uniform(self) -> bool:
        """Whether every slot is a whole page layer of the one shape (what the Metal kernels read)."""
        return all(g.shape is None for g in self.groups)

    @property
    def has_recurrent(self) -> bool:
        return bool(self.recurrent)

    @property
    def full_groups(self) -> tuple[KVGroup, ...]:
        return tuple(g for g in self.groups if g.window is None and g.chunk is None)

    @property
    def sliding_groups(self) -> tuple[KVGroup, ...]:
        return tuple(g for g in self.groups if g.window is not None)

    def place(self, slot: Slot) -> tuple[KVGroup, int]:
        """The group of an attention cache slot and its index in the group."""
        for group in self.groups:
            if slot in group.slots:
                return group, group.slots.index(slot)
        raise KeyError(slot)

    def describe(self) -> str:
        """The layout as one line, for the model fingerprint: another layout never shares blocks."""
        parts = [f"{g.describe()}:{','.join(map(_name, g.slots))}" for g in self.groups]
        states = [f"{_name(s)}x{n}" + ("" if w is None else f"w{w}")
                  for s, n, w in zip(self.recurrent, self.state_sizes, self.layer_states or [None] * len(self.recurrent))]
        if states:
            parts.append(f"{RECURRENT}:{','.join(states)}")
        if self.unused:
            parts.append(f"none:{','.join(map(_name, self.unused))}")
        head = f"pages of {self.page_layers}"
        if not self.uniform:
            head += f" of {self.page.describe()}"
        return f"{head}; " + "; ".join(parts)


def _name(slot: Slot) -> str:
    return str(slot) if isinstance(slot, int) else f"{slot[0]}.{slot[1]}"


@dataclass(frozen=True, slots=True)
class _Rule:
    window: int | None = None
    chunk: int | None = None


def group_layout(caches: list, shapes: dict | None = None, windows: dict | None = None,
                 unused: tuple = (), batched: bool = True) -> GroupLayout:
    """Group a model's cache objects (mlx-lm's, one per slot); MlxkvError naming what is missing.

    `shapes`: each attention slot's K/V shape, as a probe saw them (None: one shape);
    `windows`: by a RotatingKVCache's size, the window the model asks its mask for,
    where that is not the size (plamo3); `unused`: slots the probe saw no write to;
    `batched`: False where the model's code reads one offset for every row.
    """
    kinds: dict[tuple, list[Slot]] = {}
    states: list[tuple[Slot, int, int | None]] = []
    composites = []
    for slot, cache in enumerate(caches):
        if type(cache).__name__ != "CacheList":
            _classify(slot, cache, kinds, states, shapes or {}, windows or {}, unused)
            continue
        composites.append((slot, len(cache.caches)))
        for i, part in enumerate(cache.caches):
            _classify((slot, i), part, kinds, states, shapes or {}, windows or {}, unused)
    if not kinds and not states:
        raise MlxkvError("the model keeps no cache: mlxkv has nothing to page")
    if list(kinds) == [(_Rule(), None)] and not states and not composites and not unused:
        return GroupLayout.plain(len(caches))
    ordered = sorted(kinds, key=lambda k: (k[0].window is not None, k[0].chunk is not None,
                                           k[0].window or k[0].chunk or 0))
    page, cut = pack_kinds([(len(kinds[k]), k[1]) for k in ordered])
    groups = []
    for (rule, shape), (per_group, pack) in zip(ordered, cut):
        slots = kinds[rule, shape]
        for start in range(0, len(slots), per_group):
            groups.append(KVGroup(len(groups), rule.window, tuple(slots[start : start + per_group]), rule.chunk,
                                  None if page is None else shape, pack))
    layer_states = tuple(w for _, _, w in states)
    # A LayerCache holds a row's own lengths, and the chunked families build their
    # mask from one offset: their rows run one at a time.
    one_offset = any(w is not None for w in layer_states) or any(rule.chunk is not None for rule, _ in kinds)
    return GroupLayout(tuple(groups), len(caches), max((-(-len(g.slots) // g.pack) for g in groups), default=0),
                       tuple(s for s, _, _ in states), tuple(n for _, n, _ in states), page, tuple(composites),
                       tuple(unused), layer_states if any(w is not None for w in layer_states) else (),
                       batched and not one_offset)


def _classify(path: Slot, cache, kinds: dict, states: list, shapes: dict, windows: dict, unused: tuple) -> None:
    """File one cache object under its rule (and shape), or as a state slot."""
    name = type(cache).__name__
    if name == "ArraysCache":
        states.append((path, len(cache.cache), None))
        return
    if name == "LayerCache":
        states.append((path, 5, int(cache.window_size)))
        return
    if name == "CacheList":
        raise MlxkvError("a CacheList inside a CacheList is not paged yet")
    rule = _rule_of(cache, windows)
    if path in unused:
        return
    kinds.setdefault((rule, shapes.get(path)), []).append(path)


def _rule_of(cache, windows: dict) -> _Rule:
    """The rule of an attention cache; MlxkvError for anything mlxkv cannot page."""
    name = type(cache).__name__
    if name == "KVCache":
        return _Rule()
    if name == "RotatingKVCache":
        if getattr(cache, "keep", 0):
            raise MlxkvError(f"a RotatingKVCache that keeps its first {cache.keep} tokens is not paged yet "
                             "(mlxkv pages sliding windows without kept tokens)")
        return _Rule(window=windows.get(int(cache.max_size), int(cache.max_size)))
    if name == "ChunkedKVCache":
        return _Rule(chunk=int(cache.chunk_size))
    missing = {"QuantizedKVCache": "quantized KV (QuantizedKVCache)"}.get(name, f"{name} layers")
    raise MlxkvError(f"mlxkv does not page {missing} yet")
