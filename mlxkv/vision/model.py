"""A vision-language model as mlxkv's engine runs it: mlx-vlm's language model over the pool.

mlxkv's runner calls a model as `model(tokens, cache=[...])` and reads
logits. `VisionModel` gives it that over mlx-vlm's language model, with
what an image row needs beside its ids: the prompt's embeddings (the
vision tower's output merged in, computed once per request) and its
M-RoPE positions (computed for the whole prompt, sliced per chunk; after
the prompt, `position + rope_delta`). Text rows of the same batch embed
their tokens and take plain positions. Rows are found by request id in
`rows`, attached for the life of their request.

The vision tower stays a part of this module, so its weights are in the
model fingerprint (cache/fingerprint.py) with the language model's.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlxkv.vision import compat
from mlxkv.vision.encoder_cache import EncoderCache
from mlxkv.vision.rope_deltas import RopeDeltas

log = logging.getLogger(__name__)


@dataclass
class RowInputs:
    """What the language model takes for a prompt with images, beyond its ids."""

    embeds: mx.array  # [L, D]: the prompt's embeddings, images merged in (none: from_position on is text)
    positions: mx.array  # [3, L]: M-RoPE (t, h, w) positions of the prompt
    delta: int  # rope_delta: a position after the prompt is its index plus this
    from_position: int = 0  # the first position these inputs serve (past every image: the rest is text)
    deepstack: mx.array | None = None  # [k, L, D]: Qwen3-VL's features for its first k layers, zeros at text


class VisionRows:
    """Request id -> RowInputs of the image rows in flight (a plain object: no parameters).

    A row's inputs are made at its first forward, when its prefix hit is
    known: a hit past every image needs no image features (vision/prompt.py)."""

    def __init__(self):
        self._rows: dict[int, tuple[Callable[[int, bool], RowInputs], RowInputs | None]] = {}

    def attach(self, request, make: Callable[[int, bool], RowInputs]) -> None:
        """`make(num_computed, first)` gives the inputs; they are kept while `request` lives (a
        preempted request resumes with them, or with new ones if its hit is now shorter than
        they serve: its blocks past the last image were evicted meanwhile)."""
        self._rows[request.request_id] = (make, None)
        weakref.finalize(request, self._rows.pop, request.request_id, None)

    def get(self, request_id: int, num_computed: int = 0) -> RowInputs | None:
        entry = self._rows.get(request_id)
        if entry is None:
            return None
        make, row = entry
        if row is None or num_computed < row.from_position:
            row = make(num_computed, row is None)
            self._rows[request_id] = (make, row)
        return row

    def __len__(self) -> int:
        return len(self._rows)


class VisionModel(nn.Module):
    def __init__(self, vlm, processor):
        super().__init__()
        self.vlm = vlm
        self._extras = _Extras(processor, VisionRows(), EncoderCache(), RopeDeltas())

    @property
    def processor(self):
        return self._extras.processor

    @property
    def rows(self) -> VisionRows:
        return self._extras.rows

    @property
    def encoder_cache(self) -> EncoderCache:
        return self._extras.encoder_cache

    @property
    def rope_deltas(self) -> RopeDeltas:
        return self._extras.rope_deltas

    @property
    def layers(self):
        return compat.language_model(self.vlm).layers

    def make_cache(self) -> list:
        """The language model's cache objects, as mlx-lm's make_prompt_cache asks (loader's probe)."""
        from mlx_lm.models.cache import KVCache

        return compat.make_cache(self.vlm) or [KVCache() for _ in self.layers]

    @property
    def attention_module(self) -> str:
        """Where models/compat.route_attention finds the attention function the layers call."""
        return compat.attention_module(self.vlm)

    @property
    def image_token_id(self) -> int | None:
        return compat.vision_token_id(self.vlm, self.processor)

    def __call__(self, tokens: mx.array, cache=None, inputs_embeds=None, position_ids=None, **deepstack):
        if inputs_embeds is None:  # a text forward (the loader's probe): plain positions from the cache's offset
            offset = getattr(cache[0], "offset", 0) if cache else 0
            inputs_embeds = compat.embed_tokens(self.vlm, tokens)
            position_ids = _text_positions([int(offset)] * tokens.shape[0], tokens.shape[1])
        out = compat.language_model(self.vlm)(tokens, inputs_embeds=inputs_embeds, cache=cache,
                                              position_ids=compat.language_positions(self.vlm, position_ids),
                                              **deepstack)
        return compat.logits(out)

    def step_inputs(self, seqs, tokens: mx.array) -> dict:
        """inputs_embeds [B, L, D] and position_ids [3, B, L] of a forward of `tokens` for `seqs`."""
        n = tokens.shape[1]
        embeds = compat.embed_tokens(self.vlm, tokens)
        rows_embeds, rows_positions, rows_deepstack = [], [], []
        for i, seq in enumerate(seqs):
            start, row = seq.num_computed, self.rows.get(seq.request_id, seq.num_computed)
            if row is None:
                rows_embeds.append(embeds[i])
                rows_positions.append(_text_positions([start], n)[:, 0])
                rows_deepstack.append(None)
                continue
            known = max(0, min(n, row.embeds.shape[0] - start))  # of the prompt: precomputed
            after = mx.arange(start + known, start + n) + row.delta
            rows_embeds.append(mx.concatenate([row.embeds[start : start + known], embeds[i, known:]]))
            rows_positions.append(mx.concatenate(
                [row.positions[:, start : start + known], mx.broadcast_to(after[None], (3, n - known))], axis=1))
            deepstack = None if row.deepstack is None or known == 0 else row.deepstack[:, start : start + known]
            rows_deepstack.append(None if deepstack is None else mx.pad(deepstack, [(0, 0), (0, n - known), (0, 0)]))
        inputs = {"inputs_embeds": mx.stack(rows_embeds), "position_ids": mx.stack(rows_positions, axis=1)}
        return {**inputs, **_deepstack(self.vlm, rows_deepstack, n, embeds.shape[-1])}


class _Extras:
    """The processor, the rows, the encoder cache and the rope deltas: outside nn.Module's parameter tree."""

    def __init__(self, processor, rows: VisionRows, encoder_cache: EncoderCache, rope_deltas: RopeDeltas):
        self.processor = processor
        self.rows = rows
        self.encoder_cache = encoder_cache
        self.rope_deltas = rope_deltas


def _deepstack(vlm, rows: list, n: int, width: int) -> dict:
    """The deepstack arguments of a step: none when no row has image tokens in it (text rows, decode)."""
    present = [r for r in rows if r is not None]
    if not present:
        return {}
    zeros = mx.zeros((present[0].shape[0], n, width), present[0].dtype)
    return compat.deepstack_inputs(vlm, mx.stack([zeros if r is None else r for r in rows], axis=1))


def _text_positions(offsets: list[int], n: int) -> mx.array:
    """[3, B, n]: a text row's positions, the same on the three M-RoPE axes."""
    rows = mx.stack([mx.arange(o, o + n) for o in offsets])
    return mx.broadcast_to(rows[None], (3, len(offsets), n))
