"""One row's grammar state: llguidance's matcher, kept level with the row's reply.

Steps are pipelined (engine/loop.py): a row's newest token may still be on
the device when its next mask is wanted. The matcher therefore catches up
when a mask is computed (masks.py), over the reply's tokens it has not
consumed yet plus that in-flight token; `consumed` counts them. Tokens a
verifier rejects are never consumed: proposals are checked with
`valid_prefix` and the draft masks, which leave the state as it was.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class RowMatcher:
    def __init__(self, matcher, compiler, grammar):
        self.ll = matcher  # llguidance.LLMatcher, this row's own copy
        self.compiler = compiler  # the GrammarCompiler it came from: tokenizer, EOS, executor, stats
        self.grammar = grammar
        self.consumed = 0  # reply tokens advanced over
        self.failed: str | None = None  # why the row left its grammar (a bug: masks allow no such token)

    @property
    def accepting(self) -> bool:
        """The reply so far is a whole match: EOS is allowed here."""
        return self.ll.is_accepting()

    @property
    def stopped(self) -> bool:
        """Nothing may follow but EOS (the grammar is complete, or the row failed)."""
        return self.failed is not None or self.ll.is_stopped()

    def advance(self, tokens: list[int]) -> None:
        """Consume `tokens`, the next ones of the reply."""
        for token in tokens:
            self.consumed += 1
            if self.stopped:
                continue  # a row computed past its end (pipelining) is dropped; nothing to check
            if not self.ll.consume_token(int(token)):
                self.failed = self.ll.get_error() or f"token {token} is not allowed"
                log.warning("a constrained reply left its grammar (%s): it ends here", self.failed)

    def catch_up(self, request, in_flight: list[int] = ()) -> None:
        """Advance over `request`'s reply tokens not consumed yet, then a token still in flight.
        Reads only the new tokens (Request.tokens_since): this runs every step of a constrained row."""
        known = request.num_output
        if self.consumed < known:
            self.advance(request.tokens_since(len(request.prompt) + self.consumed))
        if self.consumed == known:
            self.advance(list(in_flight))

    def rollback(self, n: int) -> None:
        """Undo the last `n` tokens consumed."""
        if n > 0:
            self.ll.rollback(n)
            self.consumed -= n

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (a proposal) the grammar allows in a row, from here; state unchanged."""
        if not tokens or self.stopped:
            return 0
        return self.ll.validate_tokens([int(t) for t in tokens])
