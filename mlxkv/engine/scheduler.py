"""The scheduler: which requests hold blocks this step, and what each computes.

One step of the batch loop is schedule → run → postprocess (batching.py).
The scheduler only moves requests between `waiting` and `running` and
takes or releases blocks; it never touches MLX.

- Admission: first come, first served. The head of `waiting` joins while
  its prompt's blocks fit, leaving one free block per running request for
  its next decode token. A request whose next uncached block is being
  prefilled by a running request waits for it, so a prefix shared by a
  batch is computed once and then hit, not computed once per sequence.
- Chunked prefill: at most `prefill_chunk` tokens per step, each request in
  whole chunks of min(prefill_chunk, rest), the shapes a solo run computes.
- Decode: every running request whose prefill is done computes one token,
  unless the tokens it may still produce are all in flight already.
- Preemption: when a decode slot cannot be had, the newest running request
  gives its blocks back. Its full blocks stay cached (or spill through the
  connector when evicted), so its resumption is a prefix hit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxkv.cache.manager import KVCacheManager
from mlxkv.errors import PoolExhaustedError
from mlxkv.engine.records import RequestStats
from mlxkv.engine.request import Request, RequestState
from mlxkv.cache.sequence import Sequence


@dataclass
class StepPlan:
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # request, tokens to prefill
    decode: list[Request] = field(default_factory=list)  # each computes one token
    cancelled: list[Request] = field(default_factory=list)  # dropped while waiting or prefilling

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.decode or self.cancelled)


class Scheduler:
    def __init__(
        self,
        manager: KVCacheManager,
        prefill_chunk: int,
        max_running: int = 64,
        on_start: Callable[[Sequence], None] = lambda seq: None,
        on_release: Callable[[Sequence], None] = lambda seq: None,
    ):
        self.manager = manager
        self.pool = manager.pool
        self.prefill_chunk = prefill_chunk
        self.max_running = max_running
        self.on_start, self.on_release = on_start, on_release
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan(cancelled=self._drop_cancelled())
        self._admit()
        plan.decode = self._decode_slots()
        plan.prefill = self._prefill_chunks()
        return plan

    # -- admission ----------------------------------------------------------

    def _drop_cancelled(self) -> list[Request]:
        """Cancelled requests leave now if waiting (never started, or preempted) or prefilling.

        A decoding one ends at its next token instead, with that token's record.
        """
        dropped = [r for r in self.waiting if r.cancelled]
        for r in dropped:
            self.waiting.remove(r)
            r.state = RequestState.FINISHED
        for r in [r for r in self.running if r.cancelled and not r.output and r.remaining_prefill > 0]:
            self.finish(r)
            dropped.append(r)
        return dropped

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running and self._fits(self.waiting[0]):
            self._start(self.waiting.popleft())

    def _fits(self, request: Request) -> bool:
        seq = request.seq or request.new_sequence()
        if self._prefix_pending(seq, self.manager.pool_hit(seq).num_blocks):
            return False
        need = self.manager.admission_blocks(seq, self.prefill_chunk)
        return need + len(self.running) <= self.pool.num_free

    def _prefix_pending(self, seq: Sequence, num_hits: int) -> bool:
        usable = (len(seq.prompt) - 1) // self.manager.block_size
        if seq.hash_root is None or num_hits >= usable:
            return False
        wanted = seq.block_hashes[num_hits]
        return any(
            wanted in r.seq.block_hashes[r.seq.num_cached_blocks :]
            for r in self.running
            if r.remaining_prefill > 0
        )

    def _start(self, request: Request) -> None:
        seq = request.seq
        self.manager.admit(seq)
        rest = len(seq.prompt) - seq.num_computed
        first = min(rest, self.prefill_chunk)
        self.manager.allocate_slots(seq, first, ahead=rest - first)
        prompt = len(request.prompt)
        stats = RequestStats(prompt, dict(seq.cached_tokens), prompt - seq.num_reused)
        request.started(time.perf_counter(), stats)
        self.running.append(request)
        self.on_start(seq)

    # -- decode and prefill ---------------------------------------------------

    def _decode_slots(self) -> list[Request]:
        """Requests ready to decode, oldest first, each with a slot for its token."""
        decode = []
        for request in list(self.running):
            if request.state != RequestState.RUNNING or request.remaining_prefill > 0:
                continue
            if request.issued >= request.max_tokens:
                continue  # its last token is in flight
            if self._slots_or_preempt(request, 1):
                decode.append(request)
        return decode

    def _slots_or_preempt(self, request: Request, num_new: int) -> bool:
        """Slots for the request's next tokens, preempting the newest request
        until they fit; False if the request itself was preempted."""
        while request.state == RequestState.RUNNING:
            try:
                self.manager.allocate_slots(request.seq, num_new)
                return True
            except PoolExhaustedError:
                self.preempt(self.running[-1])
        return False

    def decode_fits(self) -> bool:
        """Whether every request ready to decode can get its next slot without a preemption."""
        needed = sum(self.manager.slots_needed(r.seq, 1) for r in self.running if r.remaining_prefill <= 0)
        return needed <= self.pool.num_free

    def _prefill_chunks(self) -> list[tuple[Request, int]]:
        budget, chunks = self.prefill_chunk, []
        for request in list(self.running):
            n = min(self.prefill_chunk, request.remaining_prefill)
            if n <= 0 or request.state != RequestState.RUNNING:
                continue
            stop = self.manager.prefill_stop(request.seq)  # a hybrid model's next checkpoint
            if stop is not None and stop < request.seq.num_computed + n:
                n = stop - request.seq.num_computed
            if chunks and n > budget:
                break
            # Full-attention groups took the prompt's slots at admission;
            # sliding-window groups take each chunk's here.
            if not self._slots_or_preempt(request, n):
                continue
            chunks.append((request, n))
            budget -= n
            if budget <= 0:
                break
        return chunks

    # -- leaving --------------------------------------------------------------

    def preempt(self, request: Request) -> None:
        """Give the request's blocks back (full ones stay cached) and queue it first."""
        self._release(request)
        request.preempted(time.perf_counter())
        self.waiting.appendleft(request)

    def drop(self, request: Request) -> None:
        """End a request at once, waiting or running (whoever wanted it went away)."""
        if request in self.waiting:
            self.waiting.remove(request)
            request.state = RequestState.FINISHED
        elif request.state == RequestState.RUNNING:
            self.finish(request)

    def finish(self, request: Request) -> None:
        self._release(request)
        request.state = RequestState.FINISHED

    def _release(self, request: Request) -> None:
        seq = request.seq
        self.running.remove(request)
        self.manager.cache_blocks(seq)
        self.manager.free(seq)
        self.on_release(seq)
