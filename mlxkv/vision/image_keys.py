"""An image's identity in the block keys.

An image's hash is SHA-256 over what the model sees of it: the
preprocessed `pixel_values` (shape, dtype, bytes), its grid, and the
processor settings that change them. Never its path or URL (mlx-vlm
#1933 answered about the wrong image that way), never Python's `hash()`
(it differs per process), never cut short (LMCache's 16-bit hashes
collided).

As in vLLM's `kv_cache_utils.py`, only the blocks an image's placeholder
tokens overlap carry `(image hash, offset of the image's first token from
the block's start)` as an extra key (hashing.KeyedRoot); the text before
the image keys as text alone, and everything after differs through the
chain.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from mlxkv.cache.hashing import BlockHash, KeyedRoot


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder tokens in a prompt: [start, start + length)."""

    start: int
    length: int
    digest: bytes  # image_hash(...)

    @property
    def end(self) -> int:
        return self.start + self.length


def image_hash(pixel_values, grid=None, settings: dict | None = None) -> bytes:
    """SHA-256 of one image's preprocessed pixels, its grid and the processor settings."""
    h = hashlib.sha256(b"mlxkv-image\0")
    for part in (pixel_values, grid):
        if part is None:
            h.update(b"\0none\0")
            continue
        array = np.ascontiguousarray(np.asarray(part))
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        h.update(f"\0{array.dtype.str}{array.shape}\0".encode())
        h.update(array.tobytes())
    h.update(json.dumps(settings or {}, sort_keys=True, default=str).encode())
    return h.digest()


def image_token_counts(spans, cached: int) -> tuple[int, int]:
    """(image tokens, of them within the first `cached` tokens: a prefix hit's)."""
    return (sum(s.length for s in spans), sum(max(0, min(s.end, cached) - s.start) for s in spans))


def block_extras(spans: list[ImageSpan], block_size: int) -> dict[int, bytes]:
    """The extra key of each block an image overlaps: its images' (hash, offset), in prompt order."""
    extras: dict[int, bytes] = {}
    for span in sorted(spans, key=lambda s: s.start):
        if span.length <= 0:
            continue
        for block in range(span.start // block_size, (span.end - 1) // block_size + 1):
            offset = span.start - block * block_size  # negative: the image began in an earlier block
            extras[block] = extras.get(block, b"") + span.digest + offset.to_bytes(8, "little", signed=True)
    return extras


def keyed_root(root: BlockHash | None, spans: list[ImageSpan], block_size: int) -> BlockHash | None:
    """The chain root of a prompt with images (None: prefix caching is off)."""
    if root is None or not spans:
        return root
    return KeyedRoot(root, block_extras(spans, block_size))
