"""Runs the unmodified mlx-lm model over the paged pool for one step.

Attention slots get paged caches over the pool, from the block tables
the cache coordinator keeps. State slots (a hybrid's recurrent layers,
a Mamba's every layer, deepseek_v41's `LayerCache`s) get mlx-lm's own
cache objects holding the rows' states, stacked along the batch (the
recurrent manager's); each row's new states are returned with the
logits, and the coordinator records them. A `CacheList` slot is rebuilt
from its parts, each under its own rule; a slot the model never writes
gets a cache that answers for masks alone. Models whose code reads one
offset for every row (the layout is not `batched`), and rows whose states
do not stack (one not started beside others, a state that grows), run one
at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlxkv.attention.dispatch import AttentionChoice, route_model_attention
from mlxkv.attention.mirror import KVMirror
from mlxkv.attention.paged_cache import GroupTables, PagedBatch, PagedKVCache, UnusedSlotCache
from mlxkv.attention.shared_prefix import SharedPrefix, shared_blocks
from mlxkv.cache.coordinator import KVCacheCoordinator
from mlxkv.cache.kv_pool import KVPool, PageView
from mlxkv.cache.layer_groups import GroupLayout, KVGroup
from mlxkv.cache.page_format import OWN
from mlxkv.cache.sequence import Sequence
from mlxkv.models import compat


@dataclass
class StepOutput:
    logits: mx.array  # [B, vocab] at each row's last position (or [B, L, vocab]: every position)
    states: list | None  # per row: its state slots' new arrays (batch of one); None: no such slots

    @property
    def state_arrays(self) -> list[mx.array]:
        """The new states: what to evaluate after a prefill chunk."""
        return [a for row in self.states or () for slot in row for a in slot if a is not None]


@dataclass(frozen=True)
class _Place:
    """Where an attention slot reads and writes: its group, page layer and view of it."""

    group: int
    layer: int
    view: PageView | None
    heads: int
    index: int | None  # its mirror's index; None: no mirror (a view whose V is not its own)


class ModelRunner:
    def __init__(self, model, kv_pool: KVPool, cache: KVCacheCoordinator, attention: AttentionChoice | None = None):
        self.model = model
        # Split into pipeline stages across ranks (mlx-lm's PipelineMixin); run.py evaluates more then.
        self.pipelined = any(getattr(m, "pipeline_size", 1) > 1 for _, m in model.named_modules())
        self.kv_pool = kv_pool
        self.cache = cache
        self.attention = attention or AttentionChoice("reference")  # path_for: each step's path
        self.group_layout = cache.group_layout
        self.num_slots = self.group_layout.num_slots  # cache slots of the model (its make_cache() length)
        self._places = _places(self.group_layout)
        # Contiguous K/V copies of lone running sequences (see mirror.py).
        self._mirrors: dict[int, KVMirror] = {}
        # The shared prefix of the last batched decode step (see cascade.py).
        self._prefix: SharedPrefix | None = None
        self._routed = route_model_attention(model)

    def _mirror_for(self, seqs: list[Sequence], mirror: bool, path: str) -> KVMirror | None:
        if len(seqs) != 1 or path != "reference":
            # A sequence decoding in a batch reads the pool; a copy would go stale.
            for s in seqs:
                self._mirrors.pop(s.request_id, None)
            return None
        if not mirror:
            return None
        key = seqs[0].request_id
        if key not in self._mirrors:
            self._mirrors[key] = KVMirror(len(self._places))
        return self._mirrors[key]

    def _prefix_for(self, seqs: list[Sequence], tables: list, num_new: int, path: str) -> SharedPrefix | None:
        """The shared prefix for cascade attention, or None (always over a quantized pool).

        A batched decode step (B >= 2, one token each) updates the copy or
        drops it; other forwards (prefill chunks, a lone sequence on its
        mirror) leave it for the next batched step. `release` drops it with
        the last row that used it.
        """
        if len(seqs) < 2 or num_new != 1:
            return None
        # Not over a quantized pool: cascade's split softmax rounds a row otherwise than the one
        # softmax of its solo step, and 8 bits turn such last bits into a grid step of the next
        # layer's K/V (on the demo model, from the first batched step: issue 48 item 8).
        cascade = (path == "reference" and self._routed and self.group_layout.is_plain
                   and not self.kv_pool.kv.quantized)
        limit = min(s.num_computed for s in seqs)
        blocks = shared_blocks([t[0] for t in tables], limit, self.kv_pool.layout.block_size) if cascade else []
        if not blocks:
            self._prefix = None
            return None
        if self._prefix is None:
            self._prefix = SharedPrefix(self.num_slots)
        self._prefix.update(blocks, self.kv_pool, {s.request_id for s in seqs})
        return self._prefix

    @staticmethod
    def _group_tables(tables: list[list], group: KVGroup, offsets: list[int], num_new: int,
                      block_size: int) -> GroupTables:
        """A group's tables from each row's first held block (a sliding window holds no earlier ones)."""
        ids, starts = [], []
        for table in tables:
            first = next(i for i, block in enumerate(table) if block is not None)
            ids.append([block.block_id for block in table[first:]])
            starts.append(first * block_size)
        return GroupTables.build(ids, starts, offsets, num_new, block_size, group.window, group.chunk)

    @property
    def prefix_nbytes(self) -> int:
        """Bytes of the shared prefix's copy, KV held beside the pool."""
        return 0 if self._prefix is None else self._prefix.nbytes

    def release(self, seq: Sequence) -> None:
        """Drop what the runner holds for a finished sequence."""
        self._mirrors.pop(seq.request_id, None)
        if self._prefix is not None and self._prefix.release(seq.request_id):
            self._prefix = None

    def forward(self, seqs: list[Sequence], tokens: mx.array, mirror: bool = True,
                every_position: bool = False) -> StepOutput:
        """The logits at the last position of `tokens [B, L]` (`every_position`: `[B, L, vocab]`,
        a speculative step's), and each row's new states.

        `mirror=False` keeps a lone sequence off its contiguous mirror (a
        batch's prefill chunks: the values are the same, without the copy).
        The caller has allocated slots for the L new tokens of each sequence.
        """
        if len(seqs) == 1 or (self.group_layout.batched and self._stackable(seqs)):
            return self._forward(seqs, tokens, mirror, every_position)
        rows = [self._forward([seq], tokens[i : i + 1], False, every_position) for i, seq in enumerate(seqs)]
        states = None if rows[0].states is None else [row.states[0] for row in rows]
        return StepOutput(mx.concatenate([row.logits for row in rows]), states)

    def _forward(self, seqs: list[Sequence], tokens: mx.array, mirror: bool, every_position: bool) -> StepOutput:
        num_new = tokens.shape[1]
        offsets = [s.num_computed for s in seqs]
        path = self.attention.path_for(len(seqs), max(offsets) + num_new, num_new)
        if not self.group_layout.uniform:
            path = "reference"  # the kernels read whole page layers of one shape
        bs = self.kv_pool.layout.block_size
        tables = [self.cache.tables(s) for s in seqs]
        groups = tuple(self._group_tables([t[g.index] for t in tables], g, offsets, num_new, bs)
                       for g in self.group_layout.groups)
        batch = PagedBatch.of_groups(groups, offsets, num_new, bs, path, self._mirror_for(seqs, mirror, path),
                                     self._prefix_for(seqs, tables, num_new, path))
        placed = {slot: PagedKVCache(self.kv_pool, p.layer, batch, p.group, slot, p.view, p.heads, p.index)
                  for slot, p in self._places.items()}
        for slot in self.group_layout.unused:
            placed[slot] = UnusedSlotCache(self.kv_pool, 0, batch, _mask_group(self.group_layout), slot, index=None)
        states = self._state_caches(seqs)
        placed.update(zip(self.group_layout.recurrent, states))
        # A vision model takes each row's embeddings and M-RoPE positions (vision/model.py).
        inputs = self.model.step_inputs(seqs, tokens) if hasattr(self.model, "step_inputs") else {}
        logits = self.model(tokens, cache=_cache_list(self.group_layout, placed), **inputs)
        return StepOutput(logits if every_position else logits[:, -1, :],
                          _row_states(states, len(seqs)) if states else None)

    def _stackable(self, seqs: list[Sequence]) -> bool:
        """Whether the rows' states stack (groups/recurrent.py); else the rows run apart this step."""
        recurrent = self.cache.recurrent
        return recurrent is None or recurrent.stackable([s.request_id for s in seqs])

    def _state_caches(self, seqs: list[Sequence]) -> list:
        """mlx-lm's cache object per state slot, its arrays the rows' states stacked."""
        if self.cache.recurrent is None:
            return []
        layout = self.group_layout
        windows = layout.layer_states or (None,) * len(layout.recurrent)
        stacked = self.cache.recurrent.batch_states([s.request_id for s in seqs])
        caches = []
        for size, window, arrays in zip(layout.state_sizes, windows, stacked):
            if window is None:
                cache = compat.ArraysCache(size)
                cache.cache = arrays
            else:  # one row at a time (the layout is not batched)
                cache = compat.layer_cache(window)
                for name, array in zip(compat.LAYER_CACHE_FIELDS, arrays):
                    setattr(cache, name, array)
                cache.offset = seqs[0].num_computed
            caches.append(cache)
        return caches


def _places(layout: GroupLayout) -> dict:
    """Each attention slot's `_Place`."""
    places = {}
    for group in layout.groups:
        for j, slot in enumerate(group.slots):
            layer, k_head, v_head = group.place(j, layout.page)
            shape, index = group.shape, len(places)
            if shape is None:
                places[slot] = _Place(group.index, layer, None, 0, index)
                continue
            page = layout.page
            v_split = shape.v_dim // page.v_dim if shape.stores_values else 1
            view = PageView(k_head, shape.k_dim // page.k_dim, v_head, v_split, shape.values, shape.v_heads)
            mirrored = shape.values == OWN and shape.k_heads == shape.v_heads
            places[slot] = _Place(group.index, layer, view, shape.k_heads, index if mirrored else None)
    return places


def _mask_group(layout: GroupLayout) -> int:
    """The group whose tables an unused slot's masks follow: full attention, as mlx-lm's KVCache there is."""
    return layout.full_groups[0].index if layout.full_groups else 0


def _cache_list(layout: GroupLayout, placed: dict) -> list:
    """The model's cache list: a cache per slot, a CacheList of its parts for a composite one."""
    caches = [placed.get(slot) for slot in range(layout.num_slots)]
    for slot, parts in layout.composites:
        caches[slot] = compat.CacheList(*(placed.get((slot, i)) for i in range(parts)))
    return caches


def _state_arrays(cache) -> tuple:
    if type(cache).__name__ == "ArraysCache":
        return tuple(cache.cache)
    return tuple(getattr(cache, name) for name in compat.LAYER_CACHE_FIELDS)


def _row_states(caches: list, rows: int) -> list:
    """Each row's new states: per slot its arrays, batch of one."""
    slots = [_state_arrays(c) for c in caches]
    if rows == 1:
        return [tuple(slots)]
    return [tuple(tuple(a if a is None else a[i : i + 1] for a in slot) for slot in slots) for i in range(rows)]
