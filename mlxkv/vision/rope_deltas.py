"""Each prompt's M-RoPE delta, kept by the prompt's content through its last image.

After a prompt's last image, a token's M-RoPE position is its index plus
the prompt's `rope_delta` (Qwen-VL: what the images' 2-D positions saved).
A request whose prefix hit covers every image needs only that delta: its
uncomputed tokens are all text. mlx-vlm computes it over the whole prompt
(a Python loop, every request); the next turn of a conversation has the
same tokens through its last image, so the delta is kept here by a
SHA-256 of those tokens and the images' grids and is not computed again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

MAX_ENTRIES = 4096  # a few dozen bytes each


def prefix_key(tokens: list[int], end: int, grid) -> bytes:
    """The key of a prompt's tokens up to `end` (its last image's end) and its images' grids."""
    h = hashlib.sha256(np.asarray(tokens[:end], dtype=np.int64).tobytes())
    if grid is not None:
        h.update(np.ascontiguousarray(np.asarray(grid, dtype=np.int64)).tobytes())
    return h.digest()


class RopeDeltas:
    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._deltas: OrderedDict[bytes, int] = OrderedDict()

    def get(self, key: bytes) -> int | None:
        delta = self._deltas.get(key)
        if delta is not None:
            self._deltas.move_to_end(key)
        return delta

    def put(self, key: bytes, delta: int) -> None:
        self._deltas[key] = delta
        self._deltas.move_to_end(key)
        while len(self._deltas) > self.max_entries:
            self._deltas.popitem(last=False)

    def __len__(self) -> int:
        return len(self._deltas)
