"""The remote tier's key names.

    <prefix><fingerprint hex>:v<format>:kv:<block key hex>      a block's K/V (a one-block run file)
    <prefix><fingerprint hex>:v<format>:state:<checkpoint key hex>  a checkpoint (a state file)
    <prefix><fingerprint hex>:v<format>:checkpoints             a stream of "<block hash hex>:<boundary>"

The prefix (default `mlxkv:`) keeps mlxkv's keys apart from a server's
other users; the model fingerprint (weights, KV dtype, block size, layer
layout) and the file format's version keep other models, layouts and KV
formats from ever hitting. A layer group's blocks are keyed by the block
hash chained with the group's index (cache/hashing.group_hash), as in
every tier, and the value names its group, checked on a hit.

The stream lists every checkpoint written, so another process's
checkpoint index learns where each sits (`checkpoint_refs`) without a
SCAN: the coordinator only ever probes boundaries it knows of.
"""

from __future__ import annotations

from mlxkv.cache.checkpoints import CheckpointRef
from mlxkv.cache.hashing import BlockHash
from mlxkv.config import DEFAULT_REMOTE_TIER_PREFIX as DEFAULT_PREFIX  # noqa: F401  (defined once, in config)
from mlxkv.connectors.disk.run_file import FORMAT_VERSION

# Checkpoints the stream remembers (approximately: Redis trims it in whole nodes).
STREAM_LENGTH = 1 << 16


class KeySpace:
    def __init__(self, prefix: str, fingerprint: bytes):
        self.prefix = prefix
        self.base = f"{prefix}{fingerprint.hex()}:v{FORMAT_VERSION}:".encode()
        self.checkpoints = self.base + b"checkpoints"

    def block(self, block_hash: BlockHash) -> bytes:
        return self.base + b"kv:" + block_hash.hex().encode()

    def state(self, key: BlockHash) -> bytes:
        return self.base + b"state:" + key.hex().encode()


def ref_entry(ref: CheckpointRef) -> bytes:
    return f"{ref.block_hash.hex()}:{ref.boundary}".encode()


def parse_ref(entry: bytes) -> CheckpointRef | None:
    """The checkpoint a stream entry names, or None if it is not one of ours."""
    try:
        block_hex, boundary = entry.decode().split(":")
        ref = CheckpointRef(bytes.fromhex(block_hex), int(boundary))
    except (ValueError, UnicodeDecodeError):
        return None
    return ref if len(ref.block_hash) == 32 and ref.boundary > 0 else None
