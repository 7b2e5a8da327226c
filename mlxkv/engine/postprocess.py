"""After a step: record sampled tokens, register full blocks, end finished requests.

Each request gets its records through its own sink: a `GenerationChunk`
per token (the last one with finish_reason and stats), or one
`RequestFailed` for a request dropped on a cancel while it waited (before
its first token, or after a preemption: then with its stats).

Steps are pipelined (loop.py): a step's tokens are handed out after the
next step is queued, so a request that ended on its previous token may
have one more row here, which is dropped.
"""

from __future__ import annotations

import time

import mlx.core as mx

from mlxkv.engine.records import GenerationChunk, RequestFailed
from mlxkv.engine.request import Request, RequestState
from mlxkv.engine.scheduler import Scheduler, StepPlan


def register_prefill(plan: StepPlan, cache) -> list[Request]:
    """Register the blocks the plan's prefill filled; end the requests it dropped.

    Runs as soon as the step is queued, so the next step's admissions hit
    those blocks. Returns the dropped (cancelled) requests.
    """
    for request, _ in plan.prefill:
        cache.register_computed(request.seq)
    for request in plan.cancelled:
        if request.num_output:  # preempted, then cancelled while it waited for blocks
            request.record_finish(time.perf_counter(), _peak_memory_gb())
            request.sink(RequestFailed("cancelled while waiting for blocks", "cancelled", request.stats))
        else:
            request.sink(RequestFailed("cancelled before it started", "cancelled"))
    return list(plan.cancelled)


def postprocess(plan: StepPlan, sampled: list[list[int]], scheduler: Scheduler, eos) -> list[Request]:
    """Hand out the tokens of the plan's decode rows (one each, or what a speculative step
    kept), in order, until a row finishes; returns the requests that finished."""
    finished = []
    now = time.perf_counter()
    for request, tokens in zip(plan.decode, sampled):
        for token in tokens:
            if request.state != RequestState.RUNNING:
                break  # it ended on an earlier token; the rest were computed ahead and are dropped
            if _hand_out(request, token, scheduler, eos, now):
                finished.append(request)
    return finished


def _hand_out(request: Request, token: int, scheduler: Scheduler, eos, now: float) -> bool:
    """Record one token and send its record; True if the request finished on it."""
    request.append_token(token)
    scheduler.cache.register_computed(request.seq, store_now=False)
    if request.first_token_at is None:
        request.record_first_token(now)
        _record_prefill_speed(request, scheduler)
    finish = _finish_reason(request, token, eos)
    detok = request.detokenizer
    if finish != "stop":
        detok.add_token(token)
    if finish is None:
        request.sink(GenerationChunk(detok.last_segment, token))
        return False
    detok.finalize()
    request.record_finish(now, _peak_memory_gb())
    scheduler.finish(request)  # blocks are back before the last record is seen
    request.sink(GenerationChunk(detok.last_segment, token, finish, request.stats))
    return True


def _record_prefill_speed(request: Request, scheduler: Scheduler) -> None:
    """A prompt computed whole, from the pool's hits alone, says how fast this engine prefills
    (cache/restore_cost.py weighs it against the tiers' reads)."""
    stats = request.stats
    if stats.restore not in ("", "recompute") or stats.preemptions or sum(stats.cached_tokens.values()) != stats.cached_tokens["pool"]:
        return
    scheduler.cache.costs.record_prefill(stats.computed_tokens, stats.ttft_s - stats.queued_s)


def _finish_reason(request: Request, token: int, eos) -> str | None:
    if token in eos:
        return "stop"
    if request.num_output >= request.max_tokens:
        return "length"
    return "cancelled" if request.cancelled else None


def _peak_memory_gb() -> float:
    return mx.get_peak_memory() / 1e9
