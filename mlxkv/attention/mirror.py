"""A contiguous copy of one running sequence's K/V, for the reference attention path.

Gathering a sequence's blocks on every decode step copies its whole context
per layer; at 2k tokens that cost 12% of decode speed against mlx-lm. The
mirror is filled from the pool once (at the first step of a request, which
may start on prefix hits) and then appended in place, as mlx-lm's KVCache
is, so a step copies only its new tokens. The pool is still written on every
step: it stays the source of truth for prefix caching and the tiers, and
the mirror is dropped when the request ends. The Metal kernels read the pool
directly and need no mirror. A step writes at the sequence's offset, not
after the mirror's end: after a speculative step's rollback the mirror holds
rejected tokens past the offset, which the next step overwrites. Over a
quantized pool the copy holds the pool's own (packed, scales, biases) of
each token, so it costs what the pool's blocks cost, not a float copy.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.cache.kv_format import page_map, parts_of

STEP = 256  # grow in mlx-lm's steps, so both run the same shapes


class KVMirror:
    """Per layer K and V `[1, H, T, D]`: arrays, or a quantized pool's tuples of three."""

    def __init__(self, num_layers: int):
        self.keys: list = [None] * num_layers
        self.values: list = [None] * num_layers
        self.lengths = [0] * num_layers

    def covers(self, layer: int, length: int) -> bool:
        """Whether the layer's copy holds the first `length` tokens (maybe more: rolled-back ones)."""
        return self.keys[layer] is not None and self.lengths[layer] >= length

    def reset(self, layer: int, keys, values):
        """Start the layer's copy from gathered K/V `[1, H, T, D]`; returns views of it."""
        self.keys[layer] = self.values[layer] = None
        self.lengths[layer] = 0
        return self.write(layer, 0, keys, values)

    def write(self, layer: int, start: int, keys, values):
        """Write `[1, H, L, D]` at token `start`; returns views of the copy up to its end."""
        end = start + parts_of(keys)[0].shape[2]
        self._reserve(layer, end, keys, values)
        for have, new in zip(parts_of(self.keys[layer]) + parts_of(self.values[layer]),
                             parts_of(keys) + parts_of(values)):
            have[..., start:end, :] = new
        self.lengths[layer] = end
        return (page_map(lambda x: x[..., :end, :], self.keys[layer]),
                page_map(lambda x: x[..., :end, :], self.values[layer]))

    def _reserve(self, layer: int, end: int, keys, values) -> None:
        have = self.keys[layer]
        capacity = 0 if have is None else parts_of(have)[0].shape[2]
        if end <= capacity:
            return
        extra = -(-(end - capacity) // STEP) * STEP
        self.keys[layer] = _grown(have, keys, capacity, extra)
        self.values[layer] = _grown(self.values[layer], values, capacity, extra)


def _grown(have, like, capacity: int, extra: int):
    """`have`'s first `capacity` tokens then `extra` of zeros, in the form and dtypes of `like`."""
    olds = [None] * len(parts_of(like)) if have is None else parts_of(have)
    grown = []
    for old, new in zip(olds, parts_of(like)):
        B, H, _, D = new.shape
        zeros = mx.zeros((B, H, extra, D), new.dtype)
        grown.append(zeros if old is None else mx.concatenate([old[..., :capacity, :], zeros], axis=2))
    return tuple(grown) if isinstance(like, tuple) else grown[0]
