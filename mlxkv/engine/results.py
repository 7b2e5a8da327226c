"""Whole replies from a request's records."""

from __future__ import annotations

from mlxkv.engine.records import FinishReason, GenerationResult, RequestFailed, RequestStats


def collect(records: list, prompt_tokens: list[int]) -> GenerationResult:
    """The reply that `records` (chunks, maybe ending in a RequestFailed) make up."""
    last = records[-1] if records else None
    if isinstance(last, RequestFailed):
        return failed_result(prompt_tokens, last.message, last.finish_reason)
    tokens = [r.token for r in records]
    text = "".join(r.text for r in records)
    if last is None or last.finish_reason is None:  # should_stop ended it between tokens
        return GenerationResult(text, tokens, prompt_tokens, "cancelled",
                                RequestStats.unknown(len(prompt_tokens), len(tokens)))
    return GenerationResult(text, tokens, prompt_tokens, last.finish_reason, last.stats)


def failed_result(prompt_tokens: list[int], message: str, finish_reason: FinishReason = "error") -> GenerationResult:
    """A request that produced no reply; the message goes in `extra["error"]`."""
    stats = RequestStats.unknown(len(prompt_tokens))
    return GenerationResult("", [], prompt_tokens, finish_reason, stats, extra={"error": message})
