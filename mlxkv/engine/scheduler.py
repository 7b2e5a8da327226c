"""The scheduler: which requests hold blocks this step, and what each computes.

One step of the batch loop is schedule → run → postprocess (loop.py).
The scheduler only moves requests between `waiting` and `running` and
takes or releases blocks; it never touches MLX.

- Admission: first come, first served. The head of `waiting` joins while
  its prompt's blocks fit, leaving one free block per running request for
  its next decode token. Its prefix lookup is made once and kept while
  the cache's generation stands, however many steps it waits. A request whose next uncached block is being
  prefilled by a running request waits for it, so a prefix shared by a
  batch is computed once and then hit, not computed once per sequence.
- Tier hits: a request whose hit has blocks (or a hybrid's checkpoint) in
  a tier (memory, SSD, remote) is admitted into `loading` instead: it holds its blocks while a
  loader thread reads them (cache/tier_loads.py), and each step installs
  at most INSTALL_BYTES_PER_STEP of what was read, so the batch keeps
  stepping. Once installed it runs; if a tier fell short it waits again
  and is looked up afresh (the rest is recomputed).
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

from mlxkv.cache.coordinator import HYDRATE_ATTEMPTS, KVCacheCoordinator, PrefixHit
from mlxkv.cache.sequence import Sequence
from mlxkv.cache.tier_loads import INSTALL_BYTES_PER_STEP, LoadState
from mlxkv.engine.request import Request, RequestState
from mlxkv.errors import PoolExhaustedError

# With nothing else to step, how long to wait for a tier read before looking again.
IDLE_WAIT_S = 0.05


@dataclass
class StepPlan:
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # request, tokens to prefill
    decode: list[Request] = field(default_factory=list)  # each computes one token
    cancelled: list[Request] = field(default_factory=list)  # dropped while waiting or prefilling
    decode_len: int = 1  # tokens each decode request computes (more in a speculative step)

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.decode or self.cancelled)


class Scheduler:
    def __init__(
        self,
        cache: KVCacheCoordinator,
        prefill_chunk: int,
        max_running: int = 64,
        on_start: Callable[[Sequence], None] = lambda seq: None,
        on_release: Callable[[Sequence], None] = lambda seq: None,
        background_loads: bool = True,
    ):
        """`background_loads` False: tier hits are read at admission, inside the step (a rank
        of a distributed set: a loader thread's progress differs per rank, the step must not)."""
        self.cache = cache
        self.pool = cache.pool
        self.prefill_chunk = prefill_chunk
        self.max_running = max_running
        self.on_start, self.on_release = on_start, on_release
        self.background_loads = background_loads
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.loading: list[Request] = []  # admitted; their tier blocks are being read (no work yet)
        self._shortfalls: dict[Request, int] = {}  # loads a tier could not complete, per waiting request
        self._hits: dict[Request, PrefixHit] = {}  # waiting requests' lookups, while valid
        self.lookups = 0  # prefix lookups made for admissions (what the lookup cache saves)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self, decode_len: int = 1) -> StepPlan:
        """This step's work; each decoding request computes `decode_len` tokens (a
        speculative step's last token and proposals, padded to one length)."""
        plan = StepPlan(cancelled=self._drop_cancelled(), decode_len=decode_len)
        self._admit()
        self._progress_loads()
        plan.decode = self._decode_slots(decode_len)
        plan.prefill = self._prefill_chunks()
        self.cache.writes.drain()  # this step's evictions, to the tiers' writer threads
        return plan

    def decoding(self) -> list[Request]:
        """Running requests whose prompt is done: next step's decode rows, unless preempted."""
        return [r for r in self.running if r.state == RequestState.RUNNING and r.remaining_prefill <= 0]

    # -- admission ----------------------------------------------------------

    def _drop_cancelled(self) -> list[Request]:
        """Cancelled requests leave now if waiting (never started, or preempted) or prefilling.

        A decoding one ends at its next token instead, with that token's record.
        """
        dropped = [r for r in self.waiting if r.cancelled]
        for r in dropped:
            self._leave_queue(r)
            r.finish()
        for r in [r for r in self.running if r.cancelled and not r.num_output and r.remaining_prefill > 0]:
            self.finish(r)
            dropped.append(r)
        for r in [r for r in self.loading if r.cancelled]:
            self._stop_loading(r)
            r.finish()
            dropped.append(r)
        return dropped

    def _admit(self) -> None:
        while self.waiting and len(self.running) + len(self.loading) < self.max_running:
            request = self.waiting[0]
            hit = self._lookup(request)
            if not self._fits(request, hit):
                return
            self._leave_queue(request)
            if hit.from_tiers and self.background_loads:
                self._begin_load(request, hit)
            else:
                self._start(request, hit)

    def _lookup(self, request: Request) -> PrefixHit:
        """The request's prefix hit: looked up again only once the cache has changed."""
        hit = self._hits.get(request)
        if hit is None or hit.generation != self.cache.generation:
            self.lookups += 1
            # A request whose loads kept falling short settles for what the pool holds.
            tiers = self._shortfalls.get(request, 0) < HYDRATE_ATTEMPTS
            hit = self.cache.lookup(request.tokens, request.hash_root, hashes=hit.hashes if hit else None,
                                    use_tiers=tiers)
            self._hits[request] = hit
        return hit

    def _fits(self, request: Request, hit: PrefixHit) -> bool:
        if self._prefix_pending(hit):
            return False
        need = self.cache.admission_blocks(hit, len(request.prompt) + request.num_output, self.prefill_chunk)
        return need + len(self.running) + len(self.loading) <= self.pool.num_free

    def _prefix_pending(self, hit: PrefixHit) -> bool:
        """Whether the next block the hit lacks is being prefilled by a running request."""
        if hit.num_blocks >= hit.usable:
            return False
        wanted = hit.hashes[hit.num_blocks]
        return any(
            wanted in r.seq.block_hashes[r.seq.num_cached_blocks :]
            for r in self.running
            if r.remaining_prefill > 0
        )

    def _leave_queue(self, request: Request) -> None:
        self.waiting.remove(request)
        self._hits.pop(request, None)
        if request.cancelled:
            self._shortfalls.pop(request, None)

    def _start(self, request: Request, hit: PrefixHit) -> None:
        seq = self.cache.admit(request.request_id, request.tokens, request.hash_root, hit, head=request.head)
        self._prompt_slots(seq)
        self._run(request, seq)

    def _prompt_slots(self, seq: Sequence) -> None:
        rest = len(seq.prompt) - seq.num_computed
        first = min(rest, self.prefill_chunk)
        self.cache.allocate_slots(seq, first, ahead=rest - first)

    def _run(self, request: Request, seq: Sequence) -> None:
        self._shortfalls.pop(request, None)
        request.start(time.perf_counter(), seq)
        self.running.append(request)
        self.on_start(seq)

    # -- loading --------------------------------------------------------------

    def _begin_load(self, request: Request, hit: PrefixHit) -> None:
        """Admit on a hit with tier blocks: they are read off the step path while it waits."""
        seq = self.cache.loads.begin(request.request_id, request.tokens, request.hash_root, hit, head=request.head)
        self._prompt_slots(seq)
        request.load(time.perf_counter(), seq)
        self.loading.append(request)

    def _progress_loads(self) -> None:
        """Install this step's share of what the loader read; start the requests whose loads are done."""
        if not self.loading:
            return
        if not self.running and not self.cache.loads.ready():
            self.cache.loads.wait(IDLE_WAIT_S)  # nothing else to step: wait for the read, don't spin
        budget = INSTALL_BYTES_PER_STEP
        for request in list(self.loading):
            state, used = self.cache.loads.progress(request.seq, max(budget, 0))
            budget -= used
            if state is LoadState.DONE:
                self.loading.remove(request)
                self._run(request, request.seq)
            elif state is LoadState.SHORT:
                self.loading.remove(request)
                self.cache.release(request.seq)
                request.unload()
                self._shortfalls[request] = self._shortfalls.get(request, 0) + 1
                self.waiting.appendleft(request)

    def _stop_loading(self, request: Request) -> None:
        """A loading request leaves: its read is dropped and its blocks go back."""
        self.loading.remove(request)
        self._shortfalls.pop(request, None)
        self.cache.loads.cancel(request.seq)
        self.cache.release(request.seq)

    # -- decode and prefill ---------------------------------------------------

    def _decode_slots(self, num_new: int) -> list[Request]:
        """Requests ready to decode, oldest first, each with slots for its tokens."""
        decode = []
        for request in list(self.running):
            if request.state != RequestState.RUNNING or request.remaining_prefill > 0:
                continue
            if request.issued >= request.max_tokens:
                continue  # its last token is in flight
            if self._slots_or_preempt(request, num_new):
                decode.append(request)
        return decode

    def _slots_or_preempt(self, request: Request, num_new: int) -> bool:
        """Slots for the request's next tokens, preempting the newest request
        until they fit; False if the request itself was preempted."""
        while request.state == RequestState.RUNNING:
            try:
                self.cache.allocate_slots(request.seq, num_new)
                return True
            except PoolExhaustedError:
                self.preempt(self.running[-1])
        return False

    def decode_fits(self) -> bool:
        """Whether every request ready to decode can get its next slot without a preemption."""
        needed = sum(self.cache.slots_needed(r.seq, 1) for r in self.running if r.remaining_prefill <= 0)
        return needed <= self.pool.num_free

    def _prefill_chunks(self) -> list[tuple[Request, int]]:
        budget, chunks = self.prefill_chunk, []
        for request in list(self.running):
            n = min(self.prefill_chunk, request.remaining_prefill)
            if n <= 0 or request.state != RequestState.RUNNING:
                continue
            stop = self.cache.prefill_stop(request.seq)  # a hybrid model's next checkpoint
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
        request.preempt(time.perf_counter())
        self.waiting.appendleft(request)

    def drop(self, request: Request) -> None:
        """End a request at once, waiting or running (whoever wanted it went away)."""
        if request in self.waiting:
            self._leave_queue(request)
            request.finish()
        elif request.state == RequestState.LOADING:
            self._stop_loading(request)
            request.finish()
        elif request.state == RequestState.RUNNING:
            self.finish(request)

    def finish(self, request: Request) -> None:
        self._release(request)
        request.finish()

    def fail_all(self) -> list[Request]:
        """End every request, running or waiting (a step failed); returns them."""
        failed = list(self.running) + list(self.loading) + list(self.waiting)
        for request in list(self.running):
            self.finish(request)
        for request in list(self.loading):
            self.drop(request)
        for request in list(self.waiting):
            self.drop(request)
        return failed

    def _release(self, request: Request) -> None:
        seq = request.seq
        self.running.remove(request)
        self.cache.release(seq)
        self.on_release(seq)
