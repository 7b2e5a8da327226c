"""`mlxkv serve --distributed tensor|pipeline`: every rank runs the same command.

Rank 0 binds the port and serves the APIs on a lockstep engine (lockstep.py);
every other rank serves rank 0's plans and no HTTP. The model stays loaded
(an unload would end the set). A lost rank ends rank 0's open requests with
an error, and the server stops and exits non-zero; the other ranks stop
when rank 0 closes or is lost.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading

from mlxkv.distributed.channel import PlanMismatch, RankLost
from mlxkv.distributed.cluster import Cluster, join
from mlxkv.distributed.rank_engine import load_rank_engine
from mlxkv.errors import MlxkvError

log = logging.getLogger(__name__)

# After a rank is lost, how long rank 0's server may take to answer its open requests and stop.
EXIT_DEADLINE_S = 20.0


def serve_rank(args, specs: list, cache, options, models) -> int:
    """Serve as this process's rank of the set; the exit code."""
    from mlxkv.server.model_specs import NEVER

    if len(specs) != 1:
        raise MlxkvError("--distributed serves one model: give one --model, not several")
    spec = dataclasses.replace(specs[0], pin=True, keep_alive_s=NEVER)
    cluster = join(args.distributed_backend)
    if not cluster.leader:
        return _follow(args, spec, cache, cluster)
    return _lead(args, spec, cache, options, models, cluster)


def _lead(args, spec, cache, options, models, cluster: Cluster) -> int:
    from mlxkv.server.server import Server

    lost: list[str] = []
    server = None

    def on_lost(message: str) -> None:  # on the engine thread: its requests have ended with the error
        lost.append(message)
        deadline = threading.Timer(EXIT_DEADLINE_S, _exit_now, (message,))  # whatever hangs on the broken set
        deadline.daemon = True
        deadline.start()
        if server is not None:
            server.uvicorn.should_exit = True

    def load(model, config, report):
        return load_rank_engine(model, config, kind=args.distributed, cluster=cluster, check=args.distributed_check,
                                report=report, on_lost=on_lost)

    server = Server.load_models([spec], cache, options, models, load=load)
    server.serve_forever()
    if lost:
        _exit_now(lost[0])
    return 0


def _follow(args, spec, cache, cluster: Cluster) -> int:
    from mlxkv.server.server import model_cache

    engine = load_rank_engine(spec.source, model_cache(cache, spec), kind=args.distributed, cluster=cluster,
                              check=args.distributed_check)
    print(f"mlxkv serve: {cluster.describe()} ready, serving rank 0's plans", flush=True)
    try:
        engine.core.follow()
    except (RankLost, PlanMismatch) as e:
        _exit_now(str(e))
    log.info("%s: rank 0 closed the set", cluster.describe())
    return 0


def _exit_now(message: str) -> None:
    """Leave at once, non-zero: a collective on a ring that lost a peer may never return, and
    MLX's teardown at a normal exit would wait for it. The SSD tiers' files are whole or absent
    (written aside, then renamed), so the next start reads them."""
    print(f"mlxkv serve: the distributed set stopped: {message}", file=sys.stderr, flush=True)
    os._exit(1)
