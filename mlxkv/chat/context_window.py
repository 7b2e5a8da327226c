"""Fitting a chat into the context: the oldest turns left out, in big steps.

A chat longer than the context would be refused, and so would every
later message of it. Instead its prompt keeps the system prompt and the
newest turns, starting at a user message.

The window's start moves in steps of half the limit, measured on the
chat's own token positions, so it stays put while the chat grows: every
turn until the next step begins with the same tokens and reuses the
cached prefix. A start that slid by one turn at a time would recompute
the whole prompt on every message.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

MESSAGE_OVERHEAD = 8  # tokens a chat template adds around a message: positions only, the fit is measured exactly


def fit_messages(
    messages: list[dict],
    limit: int,
    measure: Callable[[list[dict]], int],
    count: Callable[[dict], int],
) -> tuple[list[dict], int]:
    """The messages to send, and how many were left out to fit `limit` tokens.

    `measure(messages)` is the exact prompt length of a message list;
    `count(message)` estimates one message's tokens, for where the steps
    fall. When even the last user message alone does not fit, everything
    is returned, for the engine to refuse with its own error.
    """
    if measure(messages) <= limit:
        return messages, 0
    head = messages[:1] if messages and messages[0].get("role") == "system" else []
    turns = messages[len(head):]
    starts = list(itertools.accumulate((count(t) + MESSAGE_OVERHEAD for t in turns), initial=0))
    users = [i for i, t in enumerate(turns) if i > 0 and t.get("role") == "user"]
    if not users:
        return messages, 0
    step = max(1, limit // 2)
    for k in itertools.count(1):
        first = next((i for i in users if starts[i] >= k * step), users[-1])
        kept = head + turns[first:]
        if measure(kept) <= limit:
            return kept, first
        if first == users[-1]:
            break
    return messages, 0
