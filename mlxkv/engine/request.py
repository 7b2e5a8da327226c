"""A request: one prompt's life in the batch, across admissions and preemptions.

A request outlives its `Sequence`. Admission makes a sequence of the
tokens known so far (prompt, then any output before a preemption);
preemption releases it, leaving its full blocks cached in the pool (or
spilled to a tier), so the next admission starts on prefix hits.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxkv.cache.hashing import BlockHash
from mlxkv.engine.records import RequestStats
from mlxkv.cache.sequence import Sequence



class RequestState(enum.Enum):
    WAITING = "waiting"  # queued: never started, or preempted
    RUNNING = "running"  # holds blocks in the scheduler's running list
    FINISHED = "finished"


Sink = Callable[[object], None]  # takes GenerationChunk / RequestFailed records


@dataclass(eq=False)
class Request:
    request_id: int
    prompt: list[int]
    max_tokens: int
    sampler: Callable
    hash_root: BlockHash | None
    sink: Sink
    detokenizer: object
    should_stop: Callable[[], bool] | None = None
    output: list[int] = field(default_factory=list)
    seq: Sequence | None = None
    state: RequestState = RequestState.WAITING
    stats: RequestStats | None = None  # from the first admission on
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    # Decode tokens queued on the device so far; more than len(output)
    # while a pipelined step is in flight (batching.py).
    issued: int = 0
    _waiting_since: float | None = None

    def __post_init__(self):
        self._waiting_since = self.arrival

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def cancelled(self) -> bool:
        return self.should_stop is not None and self.should_stop()

    @property
    def preemptions(self) -> int:
        return 0 if self.stats is None else self.stats.preemptions

    def new_sequence(self) -> Sequence:
        """A sequence of every token known so far; its last one is computed in decode."""
        self.seq = Sequence(self.request_id, self.tokens, self.hash_root)
        return self.seq

    def started(self, now: float, stats: RequestStats) -> None:
        """Admitted: the wait since arrival (or since a preemption) ends."""
        waited = now - self._waiting_since
        if self.stats is None:
            self.stats = stats
            stats.queued_s = waited
        else:
            self.stats.preempted_s += waited
        self.state = RequestState.RUNNING

    def preempted(self, now: float) -> None:
        self.stats.preemptions += 1
        self.seq = None
        self.state = RequestState.WAITING
        self._waiting_since = now

    @property
    def remaining_prefill(self) -> int:
        """Tokens of the sequence still to prefill (all known tokens but the last)."""
        return len(self.seq.prompt) - 1 - self.seq.num_computed
