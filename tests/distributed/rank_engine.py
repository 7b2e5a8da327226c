"""One rank of tests/distributed/test_lockstep.py: engines split over the set, driven by rank 0.

argv: the disk tier dir, the scenario ("first", or "restart": the first prompt
only, on the tier a first launch left), then one MODEL=KIND per engine, loaded
one after another in this one pair of processes (a start costs seconds). Rank 0
prints one JSON record per result; every other rank follows each engine until
rank 0 closes it. Each rank then prints how many steps it ran and how many
blocks it read back from its own SSD tier. --distributed-check is on: a step on which the ranks' plans, tables or
tokens differ stops both with PlanMismatch.
"""

import json
import sys

from ranks import rank_preamble

rank_preamble()

import mlxkv  # noqa: E402,F401  (before mlx: the BLAS choice)
from mlxkv.config import CacheConfig  # noqa: E402
from mlxkv.engine.engine import Engine  # noqa: E402

from lockstep_prompts import BATCH, CANCELLED, FIRST, SECOND, config_fields  # noqa: E402


def emit(**record):
    print(json.dumps(record), flush=True)


def result(job, name, r):
    emit(job=job, name=name, tokens=r.tokens, cached=sum(r.stats.cached_tokens.values()),
         tiers=r.stats.cached_tokens)


def batch(job, engine):
    """A batch of 4; one client hangs up mid-prefill, one closes its stream after two tokens."""
    core = engine.core
    records = [[] for _ in BATCH]
    stop = [False]
    for i, prompt in enumerate(BATCH):
        core.add(engine.make_request(prompt, records[i].append, (lambda: stop[0]) if i == CANCELLED else None,
                                     max_tokens=6, temperature=0.7 if i == 3 else 0.0))
    core.step()  # prefills request 0 and part of request 1
    stop[0] = True
    while core.has_work:
        core.step()
    stream = engine.stream(FIRST, max_tokens=8)
    next(stream), next(stream)
    stream.close()
    engine.idle(10**6)  # rank 0's pause: every rank shrinks its pool alike
    emit(job=job, name="batch", tokens=[[getattr(r, "token", None) for r in recs] for recs in records],
         reasons=[recs[-1].finish_reason if recs else None for recs in records])


def end(job, engine):
    emit(job=job, name="end", steps=engine.core.steps,
         disk_hydrations=engine.stats()["connector"]["disk"]["hydrations"])


disk, scenario = sys.argv[1:3]
batched = set()  # the split kinds whose first engine ran the batch
for job, spec in enumerate(sys.argv[3:]):
    model, kind = spec.rsplit("=", 1)
    engine = Engine.load(model, CacheConfig(disk_tier=disk, **config_fields()), distributed=kind,
                         distributed_check=True, backend="ring")
    core = engine.core
    if not core.channel.cluster.leader:
        core.follow()
        end(job, engine)
        continue
    result(job, "first", engine.generate(FIRST, max_tokens=8))
    if scenario == "first":
        result(job, "second", engine.generate(SECOND, max_tokens=8))
        if kind not in batched:  # the lockstep is the split's, not the family's: once per split is enough
            batched.add(kind)
            batch(job, engine)
    engine.close()
    end(job, engine)
