"""What a request may ask for: its prompt's ids, and room for its reply in the
context and the pool. Checked before a request is queued, so a bad one is a
one-line MlxkvError and never reaches the model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlxkv.cache.groups.base import blocks_for
from mlxkv.engine.sampling import whole
from mlxkv.errors import MlxkvError


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int | None
    max_context: int | None
    num_blocks: int
    block_size: int
    # Blocks one sequence of n tokens holds at its peak, all layer groups
    # together (KVCacheCoordinator.peak_blocks); None: one block per block of tokens.
    peak_blocks: Callable[[int], int] | None = None

    def blocks_needed(self, num_tokens: int) -> int:
        if self.peak_blocks is None:
            return blocks_for(num_tokens, self.block_size)
        return self.peak_blocks(num_tokens)

    @property
    def pool_tokens(self) -> int:
        """The longest sequence the pool holds alone."""
        lo, hi = 0, self.num_blocks * self.block_size
        if self.peak_blocks is None:
            return hi
        while lo < hi:  # the largest n whose peak fits: peak_blocks grows with n
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.blocks_needed(mid) <= self.num_blocks else (lo, mid - 1)
        return lo

    def token_ids(self, prompt) -> list[int]:
        """Token ids as ints, each a row of the embedding table. MLX does not
        bounds-check the embedding lookup: id 5000 in a 1024-token vocabulary
        was a segmentation fault, not an error."""
        if hasattr(prompt, "tolist"):  # an mx.array or numpy array of ids
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise MlxkvError("a prompt is text or a list of token ids (whole numbers)")
        vocab = self.vocab_size
        for t in prompt:
            if not whole(t):  # 2.0 and True are not token ids either
                raise MlxkvError(f"token ids must be whole numbers, got {t!r}")
            if t < 0 or (vocab is not None and t >= vocab):
                size = f" of {vocab} tokens" if vocab is not None else ""
                raise MlxkvError(f"token id {t} is outside the model's vocabulary{size}")
        return [int(t) for t in prompt]

    def reply_room(self, prompt_len: int, max_tokens: int) -> int:
        """The most tokens a reply to a prompt of `prompt_len` tokens gets:
        `max_tokens`, cut where the model's context ends. A reply's last token
        is sampled but never read back, so a prompt that fills the context
        still gets one; past the context a model's positions are untrained."""
        context = self.max_context
        return max_tokens if context is None else min(max_tokens, context + 1 - prompt_len)

    def prompt_limit(self, max_tokens: int) -> int:
        """The longest prompt a chat is fitted to, leaving its reply room for
        `max_tokens`, in the pool and in the context. A reply asked for more
        than half the context gets the half the prompt does not keep."""
        pool = self.pool_tokens
        context = self.max_context
        if context is None:
            return pool - max_tokens
        return min(pool, context + 1) - min(max_tokens, context // 2)

    def check(self, prompt: list[int], max_tokens: int) -> None:
        if not prompt:
            raise MlxkvError("prompt is empty")
        if not whole(max_tokens) or max_tokens < 1:
            raise MlxkvError(f"max_tokens must be a whole number, at least 1, got {max_tokens!r}")
        limit = self.max_context
        if limit is not None and len(prompt) > limit:
            raise MlxkvError(f"prompt has {len(prompt)} tokens but the model's context is {limit}")
        bs = self.block_size
        reply = self.reply_room(len(prompt), max_tokens)
        need = self.blocks_needed(len(prompt) + reply)
        if need > self.num_blocks:
            raise MlxkvError(
                f"prompt ({len(prompt)} tokens) plus a reply of up to {reply} tokens needs {need} "
                f"blocks of {bs} tokens but the pool has {self.num_blocks}; "
                "raise --num-blocks or lower --max-tokens"
            )
