"""Per-request lines that agents put at the head of their prompt.

Some clients start every prompt with a line that changes from session to
session and means nothing to a local model. The prefix cache hits only up
to the first token that differs, so such a line at the head costs a new
session the whole prefix: Claude Code's billing line made a new session in
the same repository reuse 16 of 29,274 tokens instead of 99.9%.

Each rule removes one kind of line before templating. The list is short on
purpose: only lines measured to change between sessions, each with a test.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadLine:
    name: str  # who sends it
    pattern: re.Pattern  # matches the whole line, at the head of the system text

    def strip(self, text: str) -> str | None:
        """`text` without the line, or None when it does not start with it."""
        match = self.pattern.match(text)
        return None if match is None else text[match.end():]


HEAD_LINES = (
    # Claude Code 2.1: "x-anthropic-billing-header: cc_version=2.1.NNN.<3 hex>; ...",
    # the hex derived from the session's first prompt. Its own system block
    # (Anthropic API), or the first line of a system message (via a proxy).
    HeadLine("Claude Code's billing header", re.compile(r"x-anthropic-billing-header:[^\n]*(\n|$)")),
)


def strip_head(text: str) -> str:
    """A system text without the per-request lines at its head (each rule once, in order)."""
    for rule in HEAD_LINES:
        rest = rule.strip(text)
        if rest is not None:
            log.debug("left out %s at the head of the prompt", rule.name)
            text = rest
    return text


def strip_head_blocks(texts: list[str]) -> list[str]:
    """Leading system blocks without per-request lines; a block that was only such a line goes."""
    out = list(texts)
    while out:
        rest = strip_head(out[0])
        if rest == out[0]:
            break
        if rest.strip():
            out[0] = rest
            break
        out.pop(0)
    return out


def strip_heads(messages: list[dict]) -> list[dict]:
    """Chat messages whose first system message has no per-request lines at its head."""
    if not messages or messages[0].get("role") != "system" or not isinstance(messages[0].get("content"), str):
        return messages
    return [{**messages[0], "content": strip_head(messages[0]["content"])}, *messages[1:]]
