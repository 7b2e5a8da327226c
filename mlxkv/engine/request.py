"""A request: one prompt's life in the batch, across admissions and preemptions.

A request outlives its `Sequence`. Admission makes a sequence of the
tokens known so far (prompt, then any output before a preemption);
preemption releases it, leaving its full blocks cached in the pool (or
spilled to a tier), so the next admission starts on prefix hits.

Its state moves only through `start`, `preempt` and `finish`:

    WAITING --start--> RUNNING --finish--> FINISHED
       ^                  |
       +----preempt-------+          (a waiting request may finish too: a cancel)
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxkv.cache.hashing import BlockHash
from mlxkv.cache.sequence import Sequence
from mlxkv.engine.records import RequestStats


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued: never started, or preempted
    RUNNING = "running"  # holds blocks in the scheduler's running list
    FINISHED = "finished"


_MOVES = {
    (RequestState.WAITING, RequestState.RUNNING),
    (RequestState.RUNNING, RequestState.WAITING),
    (RequestState.WAITING, RequestState.FINISHED),
    (RequestState.RUNNING, RequestState.FINISHED),
}

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
    speculative: bool = False  # its decode may take proposals (the engine speculates, it did not opt out)
    grammar: object | None = None  # its structured.RowMatcher: its tokens are masked to the grammar
    output: list[int] = field(default_factory=list)
    seq: Sequence | None = None
    state: RequestState = RequestState.WAITING
    stats: RequestStats | None = None  # from the first admission on
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    # Decode tokens queued on the device so far; more than len(output)
    # while a pipelined step is in flight (loop.py).
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

    def _move(self, to: RequestState) -> None:
        if (self.state, to) not in _MOVES:
            raise RuntimeError(f"request {self.request_id}: no move from {self.state.value} to {to.value}")
        self.state = to

    def start(self, now: float, seq: Sequence, stats: RequestStats) -> None:
        """Admitted on `seq`: the wait since arrival (or since a preemption) ends."""
        self._move(RequestState.RUNNING)
        waited = now - self._waiting_since
        if self.stats is None:
            self.stats = stats
            stats.queued_s = waited
        else:
            self.stats.preempted_s += waited
        self.seq = seq

    def preempt(self, now: float) -> None:
        self._move(RequestState.WAITING)
        self.stats.preemptions += 1
        self.seq = None
        self._waiting_since = now

    def finish(self) -> None:
        self._move(RequestState.FINISHED)

    def append_token(self, token: int) -> None:
        """A token the request keeps: its output and its running sequence's."""
        self.output.append(token)
        self.seq.output.append(token)

    @property
    def remaining_prefill(self) -> int:
        """Tokens of the sequence still to prefill (all known tokens but the last)."""
        return len(self.seq.prompt) - 1 - self.seq.num_computed
