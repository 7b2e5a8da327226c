"""One rank of tests/distributed/test_channel.py: exchange plans, agree, fingerprint."""

import hashlib
import json

from ranks import rank_preamble

rank_preamble()

import mlxkv  # noqa: E402,F401  (before mlx: the BLAS choice)
from mlxkv.distributed.channel import PlanChannel, PlanMismatch  # noqa: E402
from mlxkv.distributed.cluster import join  # noqa: E402
from mlxkv.distributed.identity import cluster_fingerprint  # noqa: E402
from mlxkv.distributed.sharding import ShardSpec  # noqa: E402


def emit(**record):
    print(json.dumps(record), flush=True)


cluster = join("ring")
channel = PlanChannel(cluster, capacity=64)
# Plans shorter than, equal to and longer than the capacity, then after it grew.
sizes = [0, 1, 56, 57, 300, 10, 5000]
for size in sizes:
    plan = bytes((i * 7 + size) % 256 for i in range(size)) if cluster.leader else None
    got = channel.exchange(plan)
    emit(size=size, digest=hashlib.sha256(got).hexdigest(), length=len(got), capacity=channel.capacity)
emit(collectives=channel.collectives)

channel.agree("step 1", b"same plan")
try:
    channel.agree("step 2", b"plan of rank %d" % cluster.rank)
    emit(mismatch=None)
except PlanMismatch as e:
    emit(mismatch=str(e))

spec = ShardSpec("tensor", cluster.size, cluster.rank)
local = hashlib.sha256(b"shard %d" % cluster.rank).digest()
emit(fingerprint=cluster_fingerprint(local, spec, channel).hex(), tag=spec.tag)
