"""Continuous batching: many requests on one pool, a step at a time.

A step is three lines: schedule (scheduler.py) → run (batch_runner.py) →
postprocess (batch_postprocess.py). Requests join and leave between steps;
each answers through its own sink, so any number can stream at once.
The loop is not thread-safe: one thread (the engine thread) steps it.
"""

from __future__ import annotations

from mlxkv.batch_postprocess import postprocess
from mlxkv.batch_runner import run_step
from mlxkv.records import GenerationResult, RequestFailed, RequestStats
from mlxkv.request import FINISHED, Request
from mlxkv.scheduler import Scheduler


class BatchLoop:
    def __init__(self, engine, max_running: int = 64):
        self.engine = engine
        self.eos = engine.tokenizer.eos_token_ids
        self.scheduler = Scheduler(
            engine.manager, engine.prefill_chunk, max_running, on_start=self._on_start, on_release=self._on_release
        )

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[Request]:
        """One step; returns the requests that finished in it."""
        try:
            plan = self.scheduler.schedule()
            sampled = run_step(plan, self.engine.runner)
            finished = postprocess(plan, sampled, self.scheduler, self.eos)
        except Exception as e:  # a bug or a failed step ends the requests in it, not the loop
            finished = self.fail_all(f"{type(e).__name__}: {e}")
        self.engine.requests_served += len(finished)
        return finished

    def fail_all(self, message: str) -> list[Request]:
        failed = list(self.scheduler.running) + list(self.scheduler.waiting)
        for request in list(self.scheduler.running):
            self.scheduler.finish(request)
        self.scheduler.waiting.clear()
        for request in failed:
            request.state = FINISHED
            request.sink(RequestFailed(message))
        return failed

    def _on_start(self, seq) -> None:
        self.engine.running[seq.request_id] = seq

    def _on_release(self, seq) -> None:
        self.engine.running.pop(seq.request_id, None)
        self.engine.runner.release(seq)


def generate_batch(engine, prompts: list, **options) -> list[GenerationResult]:
    """Every prompt's whole reply, generated together; a bad prompt fails alone.

    A failed request's result has finish_reason "error" and its message in
    `extra["error"]`.
    """
    records: list[list] = [[] for _ in prompts]
    results: list[GenerationResult | None] = [None] * len(prompts)
    loop = engine.batch_loop()
    for i, prompt in enumerate(prompts):
        try:
            loop.add(engine.make_request(prompt, records[i].append, **options))
        except Exception as e:
            results[i] = failed_result(engine, prompt, str(e))
    while loop.has_work:
        loop.step()
    for i, prompt in enumerate(prompts):
        if results[i] is None:
            results[i] = _result(engine, prompt, records[i])
    return results


def _result(engine, prompt, records: list) -> GenerationResult:
    last = records[-1]
    if isinstance(last, RequestFailed):
        return failed_result(engine, prompt, last.message, last.finish_reason)
    tokens = [r.token for r in records]
    text = "".join(r.text for r in records)
    return GenerationResult(text, tokens, engine._prompt_tokens(prompt), last.finish_reason, last.stats)


def failed_result(engine, prompt, message: str, finish_reason: str = "error") -> GenerationResult:
    try:
        tokens = engine._prompt_tokens(prompt)
    except Exception:
        tokens = []
    stats = RequestStats(len(tokens), {"pool": 0, "memory": 0, "disk": 0}, 0)
    return GenerationResult("", [], tokens, finish_reason, stats, extra={"error": message})
