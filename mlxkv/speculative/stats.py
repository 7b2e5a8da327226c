"""Counters of speculative decoding: what users see in stats(), /metrics and the chat app."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SpeculationStats:
    steps: int = 0  # verify steps (forwards that checked proposals)
    rows: int = 0  # rows of those steps that proposed
    proposed: int = 0  # tokens proposed
    accepted: int = 0  # of them, accepted
    emitted: int = 0  # tokens the proposing rows produced (accepted + one each)

    def observe(self, proposed: int, accepted: int) -> None:
        self.rows += 1
        self.proposed += proposed
        self.accepted += accepted
        self.emitted += accepted + 1

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "tokens_per_step": self.emitted / self.rows if self.rows else 0.0,
        }
