"""Block hashes of one made-up prompt, as the engine would chain them: tier tests' keys."""

from __future__ import annotations

from mlxkv.cache.hashing import hash_block, root_hash


def block_chain(fingerprint: bytes, block_size: int, n: int, salt: str = "") -> list[bytes]:
    """n chained block hashes of tokens 0, 1, 2, ... under `fingerprint` (and `salt`, the namespace secret)."""
    hashes, parent = [], root_hash(fingerprint, salt or None)
    for i in range(n):
        parent = hash_block(parent, list(range(i * block_size, (i + 1) * block_size)))
        hashes.append(parent)
    return hashes
