"""Whether verify steps pay on this machine: tokens per second with speculation against without.

On a Mac's GPU, checking 4-8 tokens costs about one decode step: both
read the weights once. Elsewhere it may not: on a CPU a quantized matmul
of five query tokens costs about six single-token ones (the demo model
here), so speculation that is always accepted can still decode slower, and
a batch of eight rows far slower. Acceptance alone (proposal_length.py)
cannot see that; the clock can.

Per batch size (in powers of two), both kinds of step keep an average of
the tokens they hand out and of the seconds they take. Speculation runs
first; then plain steps, for as long; then the faster kind runs, and now
and then the other one runs PROBE_STEPS times to stay current: every
PROBE_EVERY steps, or more seldom when it is far slower, so that probing
costs at most PROBE_COST of the time (on this CPU a verify step of the
demo model takes 2.5x a plain one for half its speed: probing it every
128 steps cost a free chat 5%). Steps that also prefill are not counted:
their time is not decode's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# Weight of the newest step in the averages.
SMOOTHING = 0.2
# Steps of a kind before its rate is trusted (a plain run's first step reads no tokens: pipelining).
PROBE_STEPS = 6
# Steps of the faster kind between probes of the other, at least, and at most.
PROBE_EVERY = 128
PROBE_EVERY_MAX = 4096
# The share of decode time that probes of a slower kind may lose.
PROBE_COST = 0.02


@dataclass
class _Rate:
    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        if self.samples == 0:
            self.tokens, self.seconds = float(tokens), seconds
        else:
            self.tokens += SMOOTHING * (tokens - self.tokens)
            self.seconds += SMOOTHING * (seconds - self.seconds)
        self.samples += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class _Bucket:
    def __init__(self):
        self.rates = {True: _Rate(), False: _Rate()}  # by "speculated"
        self.run_kind: bool | None = None  # the kind of the current run of steps
        self.run_steps = 0  # steps in the current run

    def choose(self) -> bool:
        for kind in (True, False):  # learn each kind first, speculation first
            if self.rates[kind].samples < PROBE_STEPS:
                return kind
        faster = self.rates[True].per_second >= self.rates[False].per_second
        if self.run_kind == faster and self.run_steps >= probe_every(self.rates[faster], self.rates[not faster]):
            return not faster  # probe the other kind
        if self.run_kind == (not faster) and self.run_steps < PROBE_STEPS:
            return not faster  # a probe runs its course
        return faster


def probe_every(fast: _Rate, slow: _Rate) -> int:
    """Steps of the `fast` kind between probes of the `slow` one, so that a probe's loss (its
    steps' time less what the fast kind takes for their tokens) is PROBE_COST of the run's time."""
    if fast.seconds <= 0 or fast.per_second <= 0:
        return PROBE_EVERY
    loss = PROBE_STEPS * slow.seconds * (1 - slow.per_second / fast.per_second)
    return int(min(max(PROBE_EVERY, loss / (PROBE_COST * fast.seconds)), PROBE_EVERY_MAX))


class StepCost:
    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self._buckets: dict[int, _Bucket] = {}
        self._started: tuple[int, bool, float] | None = None  # bucket, speculated, start time
        # Another process's choices per bucket, followed instead of this clock's (a rank of a
        # distributed set follows rank 0's: each rank's own clock would split the set).
        self._followed: dict[int, bool] | None = None

    @staticmethod
    def _bucket_of(rows: int) -> int:
        return 1 << max(rows - 1, 0).bit_length()  # 1, 2, 4, 8, ...

    def speculate(self, rows: int) -> bool:
        """Whether a step of `rows` decoding rows should verify proposals."""
        key = self._bucket_of(rows)
        if self._followed is not None:
            return self._followed.get(key, _Bucket().choose())
        return self._buckets.setdefault(key, _Bucket()).choose()

    def choices(self) -> dict[int, bool]:
        """What `speculate` answers now for each batch size measured (a new one: its first
        choice); between two steps nothing changes them, so they can be sent ahead of the step."""
        return {key: bucket.choose() for key, bucket in self._buckets.items()}

    def follow(self, choices: dict[int, bool] | None) -> None:
        """Answer the next steps' `speculate` from `choices` (None: from this clock again)."""
        self._followed = choices

    def start(self, rows: int, speculated: bool) -> None:
        """A step of `rows` decoding rows begins."""
        self._started = (self._bucket_of(rows), speculated, self.clock())

    def finish(self, tokens: int, prefilled: bool) -> None:
        """The step begun last handed out `tokens`; `prefilled`: it also prefilled (not counted)."""
        if self._started is None:
            return
        key, speculated, began = self._started
        self._started = None
        bucket = self._buckets.setdefault(key, _Bucket())
        if bucket.run_kind != speculated:
            bucket.run_kind, bucket.run_steps = speculated, 0
        bucket.run_steps += 1
        if not prefilled and tokens > 0:  # a plain run's first step only queues: pipelining
            bucket.rates[speculated].add(tokens, self.clock() - began)

    def describe(self) -> dict:
        """Per batch size: tokens per second of each kind, as measured (for stats)."""
        return {str(key): {"speculated_tok_s": round(b.rates[True].per_second, 2),
                           "plain_tok_s": round(b.rates[False].per_second, 2)}
                for key, b in sorted(self._buckets.items())}


class AlwaysSpeculate(StepCost):
    """Every step verifies proposals, whatever the clock says: for measuring speculation itself
    (a benchmark's row, a test of what it does) apart from whether this machine gains from it."""

    def speculate(self, rows: int) -> bool:
        return True
