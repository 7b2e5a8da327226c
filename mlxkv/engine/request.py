"""A request: one prompt's life in the batch, across admissions and preemptions.

A request outlives its `Sequence`. Admission makes a sequence of the
tokens known so far (prompt, then any output before a preemption);
preemption releases it, leaving its full blocks cached in the pool (or
spilled to a tier), so the next admission starts on prefix hits.

Its state moves only through `load`, `unload`, `start`, `preempt` and `finish`. The request is
the one writer of its fields: its stats (`RequestStats`) too, recorded
from what the scheduler, the postprocess and the speculation computed
(`start`, `record_first_token`, `record_finish`, `record_proposal`), and
its tokens issued to the device (`issue`).

    WAITING --start--> RUNNING --finish--> FINISHED
       ^                  |
       +----preempt-------+          (a waiting request may finish too: a cancel)

    WAITING --load--> LOADING --start--> RUNNING
       ^                 |
       +-----unload------+           (and LOADING --finish--> FINISHED: an abort)

LOADING: admitted on a prefix hit whose tier blocks a loader thread is
reading (cache/tier_loads.py); it holds its blocks but the scheduler
gives it no work until they are installed. `unload`: a tier fell short,
so it waits again and is looked up afresh (the rest is recomputed).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxkv.cache.hashing import BlockHash
from mlxkv.cache.sequence import Sequence
from mlxkv.engine.records import RequestStats
from mlxkv.vision.image_keys import image_token_counts


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued: never started, or preempted
    LOADING = "loading"  # holds blocks; its prefix hit's tier blocks are being read
    RUNNING = "running"  # holds blocks in the scheduler's running list
    FINISHED = "finished"


_MOVES = {
    (RequestState.WAITING, RequestState.RUNNING),
    (RequestState.RUNNING, RequestState.WAITING),
    (RequestState.WAITING, RequestState.FINISHED),
    (RequestState.RUNNING, RequestState.FINISHED),
    (RequestState.WAITING, RequestState.LOADING),
    (RequestState.LOADING, RequestState.RUNNING),
    (RequestState.LOADING, RequestState.WAITING),
    (RequestState.LOADING, RequestState.FINISHED),
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
    image_spans: tuple = ()  # its images' vision.image_keys.ImageSpan: its stats count their tokens
    # Tokens: the end of the system-and-tools head the server rendered (whole blocks), a
    # hybrid's branch point to checkpoint at (cache/groups/recurrent.py); 0: none.
    head: int = 0
    seq: Sequence | None = None
    state: RequestState = RequestState.WAITING
    stats: RequestStats | None = None  # from the first admission on; written here only
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    # Decode tokens queued on the device so far; more than len(output)
    # while a pipelined step is in flight (loop.py). Written by `issue` only.
    issued: int = 0
    _waiting_since: float | None = None
    _loading_since: float | None = None
    # Its generated tokens while no sequence holds them (before its first admission, after a
    # preemption). A running request's are its sequence's, so each token is stored once.
    _waiting_output: list[int] = field(default_factory=list)

    def __post_init__(self):
        self._waiting_since = self.arrival

    @property
    def output(self) -> list[int]:
        """Every token generated so far, as a new list (O(length): per-step code uses num_output)."""
        if self.seq is None:
            return list(self._waiting_output)
        return self.seq.prompt[len(self.prompt):] + self.seq.output

    @property
    def num_output(self) -> int:
        if self.seq is None:
            return len(self._waiting_output)
        return self.seq.num_tokens - len(self.prompt)

    @property
    def tokens(self) -> list[int]:
        """Every known token, prompt then output, as a new list."""
        return self.seq.tokens if self.seq is not None else self.prompt + self._waiting_output

    @property
    def last_token(self) -> int:
        if self.seq is not None:
            return self.seq.last_token
        return (self._waiting_output or self.prompt)[-1]

    def tokens_since(self, start: int) -> list[int]:
        """The known tokens from position `start` on, without copying those before it."""
        if self.seq is None:
            return (self.prompt + self._waiting_output)[start:]
        prompt, output = self.seq.prompt, self.seq.output
        return output[start - len(prompt):] if start >= len(prompt) else prompt[start:] + output

    @property
    def cancelled(self) -> bool:
        return self.should_stop is not None and self.should_stop()

    def _move(self, to: RequestState) -> None:
        if (self.state, to) not in _MOVES:
            raise RuntimeError(f"request {self.request_id}: no move from {self.state.value} to {to.value}")
        self.state = to

    def load(self, now: float, seq: Sequence) -> None:
        """Admitted on `seq`, whose prefix hit's tier blocks are still being read: it waits on."""
        self._move(RequestState.LOADING)
        self._loading_since = now
        self.seq, self._waiting_output = seq, []

    def unload(self) -> None:
        """A tier fell short while loading: back to waiting, its sequence released."""
        self._move(RequestState.WAITING)
        self._waiting_output = self.output
        self.seq = None

    def start(self, now: float, seq: Sequence) -> None:
        """Admitted on `seq` (or its load is done): the wait since arrival (or since a
        preemption) ends. The first admission's prefix hit is the reply's reuse."""
        loading = self._loading_since is not None and self.state is RequestState.LOADING
        self._move(RequestState.RUNNING)
        waited = now - self._waiting_since
        if self.stats is None:
            prompt = len(self.prompt)
            images, cached_images = image_token_counts(self.image_spans, seq.num_reused)
            self.stats = RequestStats(prompt, dict(seq.cached_tokens), prompt - seq.num_reused, queued_s=waited,
                                      image_tokens=images, cached_image_tokens=cached_images,
                                      restore=seq.restore_choice, recomputed_hit_tokens=seq.recomputed_hit)
        else:
            self.stats.preempted_s += waited
        if loading:
            self.stats.loading_s += now - self._loading_since
        self.seq, self._waiting_output = seq, []  # its sequence holds them now (its prompt's tail)

    def preempt(self, now: float) -> None:
        self._move(RequestState.WAITING)
        self.stats.preemptions += 1
        self._waiting_output = self.output
        self.seq = None
        self._waiting_since = now

    def finish(self) -> None:
        self._move(RequestState.FINISHED)

    def issue(self, n: int) -> None:
        """`n` more of its decode tokens are queued on the device."""
        self.issued += n

    # -- its stats: recorded here, from what the step computed ----------------

    def record_first_token(self, now: float) -> None:
        self.first_token_at = now
        stats = self.stats
        stats.ttft_s = now - self.arrival  # queued time included; it is in queued_s too
        busy = stats.ttft_s - stats.queued_s - stats.preempted_s
        if busy > 0:
            stats.prompt_tokens_per_s = stats.computed_tokens / busy

    def record_finish(self, now: float, peak_memory_gb: float) -> None:
        stats = self.stats
        stats.generation_tokens = self.num_output
        elapsed = now - self.first_token_at
        if stats.generation_tokens > 1 and elapsed > 0:
            stats.decode_tokens_per_s = (stats.generation_tokens - 1) / elapsed
        stats.peak_memory_gb = peak_memory_gb

    def record_proposal(self, proposed: int, accepted: int) -> None:
        """Speculative decoding: tokens proposed for this reply in a step, and accepted."""
        self.stats.proposed_tokens += proposed
        self.stats.accepted_tokens += accepted

    def record_mask(self, seconds: float, refused: int) -> None:
        """Structured output: this row's share of a step's mask time, and the tokens its mask refused."""
        self.stats.constrained = True
        self.stats.mask_s += seconds
        self.stats.masked_tokens += refused

    def append_token(self, token: int) -> None:
        """A token the request keeps: its running sequence's output, where it is stored."""
        self.seq.output.append(token)

    @property
    def remaining_prefill(self) -> int:
        """Tokens of the sequence still to prefill (all known tokens but the last)."""
        return len(self.seq.prompt) - 1 - self.seq.num_computed
