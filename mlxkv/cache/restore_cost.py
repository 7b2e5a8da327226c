"""Restore or recompute: which is cheaper for a prefix hit's tier blocks, by measured speeds.

Two running estimates: each tier's read bandwidth (bytes/s, from the
loads tier_loads.py makes) and the engine's own prefill speed (tokens/s,
from requests that computed their prompt). Both costs grow with the
tokens, so per tier the answer is one comparison: restore when reading a
token's KV takes less time than computing it. Until both speeds are known
the answer is restore (what the engine did before it measured anything).

`policy` pins the answer ("restore", "recompute"): the bench's baselines.
Tests inject speeds with `known(...)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

AUTO, RESTORE, RECOMPUTE = "auto", "restore", "recompute"
POLICIES = (AUTO, RESTORE, RECOMPUTE)
# Weight of the newest sample in a running estimate: a few loads move it,
# one odd one (a cold page cache, a busy disk) does not flip every choice.
WEIGHT = 0.3
# Samples smaller than this say more about per-call overhead than speed.
MIN_PREFILL_TOKENS = 64
MIN_READ_BYTES = 1 << 20


@dataclass
class Estimate:
    """A running rate: amount per second, weighted toward recent samples."""

    rate: float | None = None

    def add(self, amount: float, seconds: float) -> None:
        if seconds <= 0 or amount <= 0:
            return
        sample = amount / seconds
        self.rate = sample if self.rate is None else (1 - WEIGHT) * self.rate + WEIGHT * sample


@dataclass
class RestoreCost:
    bytes_per_token: int
    policy: str = AUTO
    prefill: Estimate = field(default_factory=Estimate)  # tokens/s
    reads: dict[str, Estimate] = field(default_factory=dict)  # tier -> bytes/s

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"restore policy must be one of {POLICIES}, got {self.policy!r}")

    def known(self, prefill_tokens_per_s: float, read_bytes_per_s: dict[str, float]) -> RestoreCost:
        """Set both estimates outright (tests, or a caller that measured them)."""
        self.prefill.rate = prefill_tokens_per_s
        for tier, rate in read_bytes_per_s.items():
            self.reads.setdefault(tier, Estimate()).rate = rate
        return self

    def record_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS:
            self.prefill.add(tokens, seconds)

    def record_read(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes >= MIN_READ_BYTES:
            self.reads.setdefault(tier, Estimate()).add(nbytes, seconds)

    def restores(self, tier: str) -> bool:
        """Whether a hit's blocks in `tier` are cheaper read than recomputed."""
        if self.policy != AUTO:
            return self.policy == RESTORE
        read, prefill = self.reads.get(tier, Estimate()).rate, self.prefill.rate
        if read is None or prefill is None:
            return True
        return self.bytes_per_token / read < 1 / prefill

    def as_dict(self) -> dict:
        return {"policy": self.policy, "prefill_tokens_per_s": self.prefill.rate,
                "read_bytes_per_s": {tier: e.rate for tier, e in self.reads.items()}}
