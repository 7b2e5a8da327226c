"""One model identity for the whole set, so that every rank's blocks share their hashes.

Each rank holds only its shard of the weights, so the fingerprint it computes
alone (cache/fingerprint.py) differs from every other rank's, and a tier written
by one set would never be read by another. Every rank instead gathers all ranks'
shard fingerprints in rank order and hashes them with the split (kind, N): the
same bytes on every rank, and the same for any set of the same model and shape.
Which rank's bytes a stored block holds is the tier key's business (ShardSpec.tag).
"""

from __future__ import annotations

import hashlib

from mlxkv.distributed.channel import PlanChannel
from mlxkv.distributed.sharding import ShardSpec

DIGEST = 32


def cluster_fingerprint(local: bytes, spec: ShardSpec, channel: PlanChannel) -> bytes:
    """The set-wide fingerprint from this rank's shard fingerprint `local` (32 bytes)."""
    if len(local) != DIGEST:
        raise ValueError(f"a shard fingerprint is {DIGEST} bytes, got {len(local)}")
    h = hashlib.sha256(b"mlxkv-cluster\0")
    h.update(f"{spec.kind}:{spec.size}\0".encode())
    h.update(b"".join(channel.gather(local)))
    return h.digest()
