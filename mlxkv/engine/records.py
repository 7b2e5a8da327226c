"""Typed records the engine yields; the CLI and the TUI only render these."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from mlxkv.cache.tiers import no_reuse

# Why a reply ended: an end-of-sequence token, max_tokens or the context,
# a cancel, or a failure. mlx-lm's "stop" and "length", plus ours.
FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass
class RequestStats:
    prompt_tokens: int
    cached_tokens: dict[str, int]
    computed_tokens: int
    generation_tokens: int = 0
    ttft_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    peak_memory_gb: float = 0.0
    # Batched runs: time spent waiting for admission, and waiting after a
    # preemption until the request was running again.
    queued_s: float = 0.0
    preempted_s: float = 0.0
    preemptions: int = 0
    # A prefix hit in a tier (cache/restore_cost.py): "restore", "recompute", "partial" or "" (none);
    # the hit's tokens recomputed because reading them was slower; the time its tier blocks took to
    # read and install (inside queued_s or preempted_s).
    restore: str = ""
    recomputed_hit_tokens: int = 0
    loading_s: float = 0.0
    # Speculative decoding: tokens proposed for this reply, and accepted.
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    # Structured output (structured/masks.py writes them): whether a grammar held the reply, the
    # reply's share of the steps' mask time, and the tokens its masks refused (counted at DEBUG).
    constrained: bool = False
    mask_s: float = 0.0
    masked_tokens: int = 0
    # A prompt with images: its images' tokens, and how many of them its prefix hit covered.
    image_tokens: int = 0
    cached_image_tokens: int = 0

    @classmethod
    def unknown(cls, prompt_tokens: int, generation_tokens: int = 0) -> RequestStats:
        """Stats of a request that ended without its own (failed, or stopped between tokens)."""
        return cls(prompt_tokens, no_reuse(), 0, generation_tokens)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationChunk:
    """One step of a streamed reply: new text and the token that made it."""

    text: str
    token: int
    finish_reason: FinishReason | None = None  # set on the last chunk
    stats: RequestStats | None = None  # set on the last chunk


@dataclass
class RequestFailed:
    """The last record of a request the engine refused, could not finish, or dropped on a cancel."""

    message: str
    # "error", or "cancelled": before its first token, or while it waited
    # for blocks after a preemption (then with stats of the tokens it had).
    finish_reason: FinishReason = "error"
    stats: RequestStats | None = None


def is_last(record) -> bool:
    return isinstance(record, RequestFailed) or record.finish_reason is not None


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: list[int]
    finish_reason: FinishReason
    stats: RequestStats
    extra: dict = field(default_factory=dict)

    def as_message(self) -> dict:
        """The reply as the next turn's chat message, with the ids it was generated as (reply_tokens.py)."""
        return {"role": "assistant", "content": self.text, "tokens": self.tokens}

    def as_json(self) -> dict:
        s = self.stats
        return {
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "cached_tokens": dict(s.cached_tokens),
            "computed_tokens": s.computed_tokens,
            "ttft_s": s.ttft_s,
            "prompt_tokens_per_s": s.prompt_tokens_per_s,
            "decode_tokens_per_s": s.decode_tokens_per_s,
            "peak_memory_gb": s.peak_memory_gb,
            **self.extra,
        }
