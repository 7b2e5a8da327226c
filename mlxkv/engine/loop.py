"""Continuous batching: many requests on one pool, a step at a time.

A step is schedule (scheduler.py) → run (run.py) → postprocess
(postprocess.py), pipelined (see `step`). Requests join and leave between steps;
each answers through its own sink, so any number can stream at once.
The loop is not thread-safe: one thread (the engine thread) steps it, and
`add` refuses a second thread while the first has work.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import mlx.core as mx

from mlxkv.cache.coordinator import KVCacheCoordinator
from mlxkv.cache.sequence import Sequence
from mlxkv.engine.model_runner import ModelRunner
from mlxkv.engine.postprocess import postprocess, register_prefill
from mlxkv.engine.records import RequestFailed
from mlxkv.engine.request import Request, RequestState
from mlxkv.engine.run import run_step, run_verify
from mlxkv.engine.speculation import Speculation
from mlxkv.engine.scheduler import Scheduler, StepPlan
from mlxkv.errors import MlxkvError
from mlxkv.system.wired import WiredLimit

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A queued step whose sampled tokens have not been read yet."""

    plan: StepPlan
    sampled: mx.array  # lazy: one token per decode request of the plan


class BatchLoop:
    """Owns the requests in flight: the scheduler's queues, the sequences
    running now, and how many requests it has served."""

    def __init__(self, cache: KVCacheCoordinator, runner: ModelRunner, eos, prefill_chunk: int,
                 max_running: int, wired: WiredLimit, speculation: Speculation | None = None,
                 background_loads: bool = True):
        """`wired`: the limit held while steps run (system/wired.py; a test gives it a fake device);
        `background_loads`: the scheduler's."""
        self.cache = cache
        self.speculation = speculation
        self.runner = runner
        self.wired = wired
        self.eos = eos
        self.scheduler = Scheduler(cache, prefill_chunk, max_running,
                                   on_start=self._on_start, on_release=self._on_release,
                                   background_loads=background_loads)
        self.running: dict[int, Sequence] = {}  # by request id: what a pool view reads
        self.requests_served = 0
        self._in_flight: _InFlight | None = None
        # Each decode request's token from the last queued step (lazy until read).
        self._last_sampled: dict[Request, mx.array] = {}
        self._owner: int | None = None  # the thread stepping the loop while it has work
        # This step's tokens handed out and whether it prefilled: the step's cost (speculative/step_cost.py).
        self._handed_out, self._prefilled = 0, False
        self._owner_lock = threading.Lock()
        self.step_failure: str | None = None  # why the last step failed (None: it did not)

    def add(self, request: Request) -> None:
        """Queue a request, from the thread that steps the loop.

        Two threads generating on one engine at once broke it for good: MLX
        arrays left lazy on one thread's stream cannot be evaluated on
        another's ("There is no Stream(cpu, 2) in current thread"). Taking
        turns is fine; EngineThread shares one engine between threads.
        """
        me = threading.get_ident()
        with self._owner_lock:
            if self.has_work and self._owner != me:
                raise MlxkvError("the engine is generating on another thread; to share one engine "
                                 "between threads, use EngineThread")
            self._owner = me
            self.scheduler.add(request)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    def step(self) -> list[Request]:
        """One step; returns the requests that finished in it.

        Pipelined as mlx-lm's generate loop is: step n+1 is queued on the
        device before step n's tokens are read, so the model computes while
        Python hands out records. A request that ends on a token (EOS, a
        cancel) thus gets one more row, computed and dropped. Preemption
        would take blocks from a request whose token is not read yet, so a
        step that may preempt first reads the step in flight.
        """
        finished: list[Request] = []
        self.wired.hold()  # from the first step after idle (system/wired.py)
        self._handed_out, self._prefilled = 0, False
        self.step_failure = None
        try:
            decoding = self.scheduler.decoding()
            speculate = self.speculation is not None and self.speculation.wants_step(decoding)
            if self.speculation is not None and decoding:
                self.speculation.cost.start(len(decoding), speculate)
            if self._in_flight is not None and (speculate or not self.scheduler.decode_fits()):
                finished += self._read_in_flight()
                self._last_sampled = {}
            if speculate:
                finished += self._verify_step()
            else:
                plan = self.scheduler.schedule()
                self._prefilled = bool(plan.prefill)
                flight = self._queue(plan)
                finished += register_prefill(plan, self.cache)
                finished += self._read_in_flight()
                self._in_flight = flight
        except Exception as e:  # a bug or a failed step ends the requests in it, not the loop
            log.exception("a step failed; ending the requests in it")
            self.step_failure = f"{type(e).__name__}: {e}"
            finished += self.fail_all(self.step_failure)
        self.requests_served += len(finished)
        if self.speculation is not None:
            self.speculation.cost.finish(self._handed_out, self._prefilled)
        for request in finished if self.speculation is not None else ():
            self.speculation.forget(request)
        if not self.has_work:
            self.wired.release()
        return finished

    def _queue(self, plan: StepPlan) -> _InFlight | None:
        """Start the plan's work on the device; the decode rows' tokens stay lazy."""
        inputs = None
        if plan.decode:
            last = [self._last_sampled.get(r) for r in plan.decode]
            inputs = mx.concatenate(
                [t if t is not None else mx.array([r.seq.last_token]) for t, r in zip(last, plan.decode)]
            )[:, None]
        sampled = run_step(plan, self.runner, self.cache, inputs)
        if sampled is None:
            return None
        # The pool's writes too: a lone sequence attends to its mirror, so
        # the sampled token does not depend on them, and unevaluated they
        # piled up as lazy scatters until the pool was next read (tens of ms
        # of them after a 500-token demo reply, landing on the next prompt).
        mx.async_eval(sampled, *self.runner.kv_pool.arrays)
        self._last_sampled = {r: sampled[i : i + 1] for i, r in enumerate(plan.decode)}
        for r in plan.decode:
            r.issue(1)
        return _InFlight(plan, sampled)

    def _read_in_flight(self) -> list[Request]:
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        self._handed_out += len(flight.plan.decode)
        return postprocess(flight.plan, [[t] for t in flight.sampled.tolist()], self.scheduler, self.eos)

    def _verify_step(self) -> list[Request]:
        """A speculative step, not pipelined: proposals need each row's newest token, and
        the next step the tokens this one kept (speculation.py)."""
        proposals = self.speculation.propose(self.scheduler.decoding())
        plan = self.scheduler.schedule(1 + max((len(p.tokens) for p in proposals.values()), default=0))
        self._prefilled = bool(plan.prefill)
        logprobs = run_verify(plan, self.runner, self.cache, proposals)
        finished = register_prefill(plan, self.cache)
        if logprobs is None:
            return finished
        kept = self.speculation.accept(plan.decode, logprobs, proposals)
        self._handed_out += sum(map(len, kept))
        mx.async_eval(*self.runner.kv_pool.arrays)
        for request, tokens in zip(plan.decode, kept):
            seq = request.seq
            self.cache.rollback(seq, seq.num_computed - plan.decode_len + len(tokens))
            request.issue(len(tokens))
        return finished + postprocess(plan, kept, self.scheduler, self.eos)

    def abort(self, request: Request) -> None:
        """End an unfinished request without more records (its stream was closed)."""
        if request.state != RequestState.FINISHED:
            self.scheduler.drop(request)
            self.requests_served += 1
        if not self.has_work:
            self.wired.release()

    def fail_all(self, message: str) -> list[Request]:
        self._in_flight, self._last_sampled = None, {}
        failed = self.scheduler.fail_all()
        for request in failed:
            request.sink(RequestFailed(message))
        return failed

    def _on_start(self, seq: Sequence) -> None:
        self.running[seq.request_id] = seq

    def _on_release(self, seq: Sequence) -> None:
        self.running.pop(seq.request_id, None)
        self.runner.release(seq)
