"""One rank of tests/distributed/test_channel.py: exchange plans, reports and timings, agree,
fingerprint; then rank 1 dies and rank 0's next exchange must raise RankLost, not hang."""

import hashlib
import json
import os
import time

from ranks import rank_preamble

rank_preamble()

import mlxkv  # noqa: E402,F401  (before mlx: the BLAS choice)
from mlxkv.distributed.channel import PlanChannel, PlanMismatch, RankLost  # noqa: E402
from mlxkv.distributed.cluster import join  # noqa: E402
from mlxkv.distributed.identity import cluster_fingerprint  # noqa: E402
from mlxkv.distributed.sharding import ShardSpec  # noqa: E402


def emit(**record):
    print(json.dumps(record), flush=True)


cluster = join("ring")
channel = PlanChannel(cluster, capacity=64)
# Plans shorter than, equal to and longer than the capacity, then one that fits again.
sizes = [0, 1, 64, 65, 300, 10, 5000]
for size in sizes:
    plan = bytes((i * 7 + size) % 256 for i in range(size)) if cluster.leader else None
    got = channel.exchange(plan)
    emit(size=size, digest=hashlib.sha256(got).hexdigest(), length=len(got), capacity=channel.capacity)
emit(collectives=channel.collectives)

# Each rank's report rides on one exchange; rank 1 comes 0.5 s late to the next one, which rank 0
# learns (as waiting, not as the collective's cost) from the timings sent with the one after.
channel.attach(b"report of rank %d" % cluster.rank)
channel.exchange(b"" if cluster.leader else None)
reports = [r.decode() for r in channel.reports]
waited = channel.wait_seconds
if cluster.rank == 1:
    time.sleep(0.5)
channel.exchange(b"" if cluster.leader else None)
channel.exchange(b"" if cluster.leader else None)
emit(reports=reports, waited=channel.wait_seconds - waited, seconds=channel.seconds)

channel.agree("step 1", b"same plan")
try:
    channel.agree("step 2", b"plan of rank %d" % cluster.rank)
    emit(mismatch=None)
except PlanMismatch as e:
    emit(mismatch=str(e))

spec = ShardSpec("tensor", cluster.size, cluster.rank)
local = hashlib.sha256(b"shard %d" % cluster.rank).digest()
emit(fingerprint=cluster_fingerprint(local, spec, channel).hex(), tag=spec.tag)

if cluster.rank == 1:
    os._exit(3)
start = time.monotonic()
try:
    channel.exchange(b"after rank 1 died")
    emit(lost=None)
except RankLost as e:
    emit(lost=str(e), lost_after=time.monotonic() - start)
