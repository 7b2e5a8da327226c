"""Tests for the block hash chain (mlxkv/hashing.py).

Hashes name KV on disk and across processes, so their format is pinned here:
a change to it must be deliberate (bump the expected values below and say so).
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxkv.cache.hashing import extend_block_hashes, hash_block, root_hash

FINGERPRINT = b"mlxkv-test-fingerprint"

# Known answers for the current hash format. If one of these fails, the
# format changed: every hash written to disk by an older version is now
# unreachable. Update them only on purpose.
ROOT_HEX = "f09ffa242e927a5358ad37a11c4a4e4a27c433a7230bce9df32970dc4fe7cb1e"
ROOT_ALICE_HEX = "b4b4086a69f35798de926b4b7d6be9bf8e9e9a4e2467e5354315ad782c5d117f"
BLOCK_HEX = "668e74f56a53728637e5f1aaf29303ce893b1a01ec25fe30d4ec81d1ba59f66a"


def chain(root: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """The hash chain written out by hand, one hash_block per full block."""
    hashes, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


# --- pinned format -----------------------------------------------------------


def test_known_answers():
    root = root_hash(FINGERPRINT)
    assert root.hex() == ROOT_HEX
    assert root_hash(FINGERPRINT, "alice").hex() == ROOT_ALICE_HEX
    assert hash_block(root, [1, 2, 3, 4]).hex() == BLOCK_HEX


def test_format_matches_its_documented_construction():
    # Root: SHA-256 over a tag, the fingerprint and the salt.
    root = root_hash(FINGERPRINT)
    assert root == hashlib.sha256(b"mlxkv-root\0" + FINGERPRINT).digest()
    assert root_hash(FINGERPRINT, "alice") == hashlib.sha256(
        b"mlxkv-root\0" + FINGERPRINT + b"\0salt\0alice"
    ).digest()
    # Block: SHA-256 over the parent and the tokens as little-endian int64,
    # whatever the machine's byte order.
    tokens = [1, 2, 3, 2**40, 0]
    expected = hashlib.sha256(root + struct.pack("<5q", *tokens)).digest()
    assert hash_block(root, tokens) == expected


def test_hashes_are_32_byte_digests():
    root = root_hash(FINGERPRINT)
    assert isinstance(root, bytes) and len(root) == 32
    block = hash_block(root, [7, 8])
    assert isinstance(block, bytes) and len(block) == 32


_CHILD = """
import sys
from mlxkv.cache.hashing import extend_block_hashes, root_hash
root = root_hash(b"mlxkv-test-fingerprint", "alice")
hashes = extend_block_hashes([], root, list(range(10)), 4)
sys.stdout.write(",".join(h.hex() for h in [root, *hashes]))
"""


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_stable_across_processes(hash_seed):
    # A different PYTHONHASHSEED would change anything built on hash().
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
    ).stdout
    root = root_hash(FINGERPRINT, "alice")
    here = [root, *extend_block_hashes([], root, list(range(10)), 4)]
    assert out.split(",") == [h.hex() for h in here]


# --- roots and salts ---------------------------------------------------------


def test_root_depends_on_fingerprint_and_salt():
    roots = {
        root_hash(FINGERPRINT),
        root_hash(FINGERPRINT + b"x"),
        root_hash(FINGERPRINT, "alice"),
        root_hash(FINGERPRINT, "bob"),
    }
    assert len(roots) == 4
    assert root_hash(FINGERPRINT, "alice") == root_hash(FINGERPRINT, "alice")


def test_empty_salt_is_no_salt():
    # Pinned behaviour: `cache_salt=""` means "no salt", so a client that
    # sends an empty salt shares the unsalted cache.
    assert root_hash(FINGERPRINT, "") == root_hash(FINGERPRINT, None) == root_hash(FINGERPRINT)


def test_same_tokens_under_different_salts_differ():
    tokens = [5, 6, 7, 8]
    plain = chain(root_hash(FINGERPRINT), tokens, 2)
    salted = chain(root_hash(FINGERPRINT, "alice"), tokens, 2)
    assert not set(plain) & set(salted)


# --- chaining ----------------------------------------------------------------


def test_block_hash_depends_on_parent():
    root = root_hash(FINGERPRINT)
    a = hash_block(root, [1, 2])
    b = hash_block(root, [3, 4])
    # The same block of tokens after different prefixes is different KV.
    assert hash_block(a, [9, 9]) != hash_block(b, [9, 9])


def test_block_hash_depends_on_tokens_and_their_order():
    root = root_hash(FINGERPRINT)
    hashes = {
        hash_block(root, [1, 2]),
        hash_block(root, [2, 1]),
        hash_block(root, [1, 3]),
        hash_block(root, [1, 2, 0]),
        hash_block(root, [1]),
    }
    assert len(hashes) == 5


def test_large_token_ids_are_not_truncated():
    root = root_hash(FINGERPRINT)
    assert hash_block(root, [1]) != hash_block(root, [1 + 2**32])


def test_tokens_may_be_any_int_sequence():
    root = root_hash(FINGERPRINT)
    assert hash_block(root, [4, 5, 6]) == hash_block(root, (4, 5, 6)) == hash_block(root, range(4, 7))


# --- extend_block_hashes -----------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [(0, 4, 0), (3, 4, 0), (4, 4, 1), (7, 4, 1), (8, 4, 2), (9, 4, 2), (5, 1, 5), (5, 2, 2)],
)
def test_extend_hashes_only_full_blocks(num_tokens, block_size, expected):
    root = root_hash(FINGERPRINT)
    tokens = list(range(100, 100 + num_tokens))
    hashes = extend_block_hashes([], root, tokens, block_size)
    assert len(hashes) == expected
    assert hashes == chain(root, tokens, block_size)


def test_extend_appends_in_place_and_returns_the_list():
    root = root_hash(FINGERPRINT)
    hashes: list[bytes] = []
    assert extend_block_hashes(hashes, root, [1, 2, 3, 4], 2) is hashes
    assert len(hashes) == 2


def test_extend_never_rehashes_existing_entries():
    # It trusts the hashes it was given and only appends after them.
    root = root_hash(FINGERPRINT)
    sentinel = b"\x00" * 32
    hashes = extend_block_hashes([sentinel], root, [1, 2, 3, 4], 2)
    assert hashes == [sentinel, hash_block(sentinel, [3, 4])]


def test_extend_with_fewer_tokens_than_hashed_is_a_no_op():
    root = root_hash(FINGERPRINT)
    hashes = extend_block_hashes([], root, list(range(8)), 2)
    before = list(hashes)
    assert extend_block_hashes(hashes, root, list(range(3)), 2) == before


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), max_size=24),
    block_size=st.sampled_from([1, 2, 3, 4, 16]),
    data=st.data(),
)
def test_extend_is_incremental(tokens, block_size, data):
    root = root_hash(FINGERPRINT)
    cut = data.draw(st.integers(0, len(tokens)), label="cut")
    in_two = extend_block_hashes([], root, tokens[:cut], block_size)
    extend_block_hashes(in_two, root, tokens, block_size)
    assert in_two == extend_block_hashes([], root, tokens, block_size)
    assert in_two == chain(root, tokens, block_size)
