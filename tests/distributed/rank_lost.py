"""One rank of the lost-peer test: rank 1 dies after the first plan; rank 0 must get RankLost."""

import json
import os
import time

from ranks import rank_preamble

rank_preamble()

import mlxkv  # noqa: E402,F401
from mlxkv.distributed.channel import PlanChannel, RankLost  # noqa: E402
from mlxkv.distributed.cluster import join  # noqa: E402

cluster = join("ring")
channel = PlanChannel(cluster)
channel.exchange(b"first" if cluster.leader else None)
if cluster.rank == 1:
    os._exit(3)
start = time.monotonic()
try:
    channel.exchange(b"second")
    print(json.dumps({"lost": None}), flush=True)
except RankLost as e:
    print(json.dumps({"lost": str(e), "seconds": time.monotonic() - start}), flush=True)
