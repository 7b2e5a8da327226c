"""Numbers the cache panel shows, from RequestStats dicts. No Textual here."""

from __future__ import annotations

from mlxkv.cache.tiers import DISK, MEMORY, POOL, REMOTE, TIERS
from mlxkv.engine.records import RequestStats

# Where a prompt token can come from, in the order the engine looks.
SOURCES = TIERS
SOURCE_LABELS = {POOL: "pool", MEMORY: "memory tier", DISK: "SSD tier", REMOTE: "remote tier"}


def as_dict(stats) -> dict:
    return stats.as_dict() if isinstance(stats, RequestStats) else dict(stats)


def reused_tokens(stats: dict) -> int:
    return sum(stats["cached_tokens"].get(s, 0) for s in SOURCES)


def reuse_ratio(stats: dict) -> float:
    prompt = stats["prompt_tokens"]
    return reused_tokens(stats) / prompt if prompt else 0.0


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


class HitRates:
    """Per source: tokens it served / tokens asked of it, over this session.

    The pool is asked for every prompt token; each tier for what the ones
    before it did not have.
    """

    def __init__(self) -> None:
        self.asked = dict.fromkeys(SOURCES, 0)
        self.served = dict.fromkeys(SOURCES, 0)

    def add(self, stats: dict) -> None:
        remaining = stats["prompt_tokens"]
        for source in SOURCES:
            got = stats["cached_tokens"].get(source, 0)
            self.asked[source] += remaining
            self.served[source] += got
            remaining -= got

    def rate(self, source: str) -> float | None:
        asked = self.asked[source]
        return self.served[source] / asked if asked else None
