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
rejected tokens past the offset, which the next step overwrites.
"""

from __future__ import annotations

import mlx.core as mx

STEP = 256  # grow in mlx-lm's steps, so both run the same shapes


class KVMirror:
    def __init__(self, num_layers: int):
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.lengths = [0] * num_layers

    def covers(self, layer: int, length: int) -> bool:
        """Whether the layer's copy holds the first `length` tokens (maybe more: rolled-back ones)."""
        return self.keys[layer] is not None and self.lengths[layer] >= length

    def reset(self, layer: int, keys: mx.array, values: mx.array):
        """Start the layer's copy from gathered K/V `[1, H, T, D]`; returns views of it."""
        self.keys[layer] = self.values[layer] = None
        self.lengths[layer] = 0
        return self.write(layer, 0, keys, values)

    def write(self, layer: int, start: int, keys: mx.array, values: mx.array):
        """Write `[1, H, L, D]` at token `start`; returns views of the copy up to its end."""
        end = start + keys.shape[2]
        self._reserve(layer, end, keys, values)
        self.keys[layer][..., start:end, :] = keys
        self.values[layer][..., start:end, :] = values
        self.lengths[layer] = end
        return self.keys[layer][..., :end, :], self.values[layer][..., :end, :]

    def _reserve(self, layer: int, end: int, keys: mx.array, values: mx.array) -> None:
        have = self.keys[layer]
        capacity = 0 if have is None else have.shape[2]
        if end <= capacity:
            return
        extra = -(-(end - capacity) // STEP) * STEP
        B, H, _, D = keys.shape
        new_k = mx.zeros((B, H, extra, D), keys.dtype)
        new_v = mx.zeros((B, H, extra, values.shape[3]), values.dtype)
        if have is None:
            self.keys[layer], self.values[layer] = new_k, new_v
        else:
            self.keys[layer] = mx.concatenate([have[..., :capacity, :], new_k], axis=2)
            self.values[layer] = mx.concatenate([self.values[layer], new_v], axis=2)
