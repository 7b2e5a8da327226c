"""Each rank's own numbers, for rank 0's /metrics and /v1/cache/stats.

Rank 0 asks for them in a plan at most once per REPORT_INTERVAL_S (its clock
decides, and the plan tells every rank); each rank then attaches its report to
the next plan exchange (channel.py), so they cost no collective of their own:
about a kilobyte per rank, four times a second while the set steps, and at
each idle tick (once a second) while it idles.
"""

from __future__ import annotations

import json

from mlxkv.distributed.channel import REPORT_BYTES

REPORT_INTERVAL_S = 0.25  # as often as the engine thread publishes stats (host/engine_thread.py)
POOL_KEYS = ("size_blocks", "budget_blocks", "in_use", "cached_free", "free", "evictions")
TIER_KEYS = ("state", "bytes_held", "hit_blocks", "hydrations", "stores", "write_errors")


def rank_report(rank: int, core, counters: dict) -> bytes:
    """This rank's report: its `counters` (steps, seconds), its pool and its tiers."""
    pool = core.block_pool.usage()
    tiers = core.connector.stats()
    report = {"rank": rank, **counters, "pool_bytes": core.kv_pool.nbytes,
              "pool": {k: pool[k] for k in POOL_KEYS if k in pool},
              "tiers": {name: {k: t[k] for k in TIER_KEYS if k in t} for name, t in sorted(tiers.items())}}
    data = json.dumps(report, separators=(",", ":")).encode()
    if len(data) > REPORT_BYTES:  # many tiers: their bytes alone still fit
        report["tiers"] = {name: {"bytes_held": t.get("bytes_held", 0)} for name, t in tiers.items()}
        data = json.dumps(report, separators=(",", ":")).encode()
    return data if len(data) <= REPORT_BYTES else json.dumps({"rank": rank, "truncated": True}).encode()


def read_reports(reports: list[bytes]) -> list[dict]:
    """The ranks' last reports, in rank order ([] before the first arrived)."""
    return [json.loads(r) for r in reports]
