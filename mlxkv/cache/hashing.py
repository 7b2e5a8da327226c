"""Content hashes of KV blocks.

A block's hash is SHA-256 over (parent hash, the block's token ids), so
equal hashes mean equal prefixes, not just equal blocks. The chain starts
at a root derived from the model fingerprint and an optional per-request
cache salt. Nothing here depends on the process (no `hash()`), so hashes
written to disk by one process are found by the next.

A prompt with images roots its chain at a `KeyedRoot`: the same bytes as
the text root, plus an extra key for each block an image's placeholder
tokens overlap (vision/image_keys.py). Only those blocks hash differently,
so the text before an image is shared between requests with different
images, and every later block differs through its parent. The root flows
through requests, sequences and lookups unchanged; the tiers key on the
chained hashes and need nothing new.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes


class KeyedRoot(bytes):
    """A chain root that carries extra keys for some blocks: block index -> bytes."""

    extras: dict[int, bytes]

    def __new__(cls, root: bytes, extras: dict[int, bytes]):
        keyed = super().__new__(cls, root)
        keyed.extras = dict(extras)
        return keyed


def root_hash(fingerprint: bytes, cache_salt: str | None = None, namespace: str | None = None) -> BlockHash:
    """`namespace`: a secret every chain of an engine starts from (the remote
    tier's salt), so only holders of it share blocks; `cache_salt` a request's own."""
    h = hashlib.sha256(b"mlxkv-root\0")
    h.update(fingerprint)
    if cache_salt:
        h.update(b"\0salt\0" + cache_salt.encode())
    if namespace:
        h.update(b"\0namespace\0" + namespace.encode())
    return h.digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    # Fixed little-endian int64 so hashes agree across machines.
    packed = array("q", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.sha256(bytes(parent))
    h.update(_token_bytes(token_ids))
    if extra:  # length-prefixed after the tokens, whose length the block size fixes
        h.update(b"\0extra\0" + len(extra).to_bytes(4, "little") + extra)
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    root: BlockHash,
    token_ids: Sequence[int],
    block_size: int,
) -> list[BlockHash]:
    """Append the hashes of the full blocks of `token_ids` not yet in `hashes`."""
    extras = getattr(root, "extras", None) or {}
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else root
        extra = extras.get(start // block_size, b"")
        hashes.append(hash_block(parent, token_ids[start : start + block_size], extra))
    return hashes


def group_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The key of a block's K/V for one layer group: the block hash itself
    for group 0, chained with the group's index for the others. Each group
    holds its own copy of a block, in the pool and in every tier."""
    if group == 0:
        return block_hash
    return hashlib.sha256(block_hash + b"\0group\0" + group.to_bytes(4, "little")).digest()
