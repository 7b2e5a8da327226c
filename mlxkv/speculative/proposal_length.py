"""How many tokens a row proposes: following its recent acceptance, and none while they keep failing.

A verify step costs about one decode step on a Mac (both read the weights
once) but its proposals only pay when accepted, and a row that speculates
makes the whole step wait for its tokens (no pipelining). So a row's length
follows an average of its acceptance, and a row whose proposals keep being
rejected, or that keeps finding none, pauses for a while: plain decode,
pipelined, and no slower than without speculation.
"""

from __future__ import annotations

# Weight of the newest step in the acceptance average.
SMOOTHING = 0.3
# Below this average acceptance a row pauses...
PAUSE_BELOW = 0.2
# ...as it does after this many lookups in a row that found nothing...
EMPTY_LIMIT = 4
# ...for this many steps, then tries again with a short proposal.
PAUSE_STEPS = 16


class ProposalLength:
    def __init__(self, max_k: int):
        self.max_k = max_k
        self.rate = 1.0  # average share of proposed tokens accepted; optimistic at first
        self.empty = 0  # lookups in a row that found nothing
        self.paused = 0  # steps left to sit out

    @property
    def active(self) -> bool:
        return self.paused == 0

    def tick(self) -> None:
        """A step the row sat out."""
        self.paused = max(0, self.paused - 1)

    def next(self) -> int:
        """Tokens to propose now (0 while paused)."""
        if not self.active:
            return 0
        return max(1, min(self.max_k, round(self.rate * self.max_k)))

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            self.empty += 1
            if self.empty >= EMPTY_LIMIT:
                self._pause()
            return
        self.empty = 0
        self.rate += SMOOTHING * (accepted / proposed - self.rate)
        if self.rate < PAUSE_BELOW:
            self._pause()

    def _pause(self) -> None:
        self.paused, self.empty = PAUSE_STEPS, 0
        self.rate = 1 / self.max_k  # back with one token, growing as it is accepted
