"""A chat prompt's head: where its system messages and tools end.

An agent's sessions all open on one system-and-tools head. A hybrid model
(recurrent layers) resumes only at a checkpoint, so the first session on a
head must leave one at the head's end, or a new session after a restart
recomputes the whole head (cache/groups/recurrent.py, branch points). The
head is found by rendering the system messages and tools alone and
keeping what the whole prompt shares with them, in whole blocks. Some
templates refuse a chat without a user turn (Qwen3.5's: "No user query
found"); they render the head before a placeholder user turn instead,
whose text no prompt shares, so the head then ends inside the user turn's
own header at most: still a prefix of every chat on that head.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict

from mlxkv.chat.reply_tokens import chat_tokens

log = logging.getLogger(__name__)

# A user turn no prompt holds (a private-use code point), for templates that want one.
_PLACEHOLDER = "\ue002"


class SystemHeads:
    """Heads rendered once per system-and-tools text: an agent re-sends the same 10-30k tokens of
    system prompt and tools every turn, and rendering them is a second template render and
    tokenization. Keyed by a digest of the system messages and tools; the newest `size` kept.
    Called from the threads that apply chat templates, so it takes a lock."""

    def __init__(self, size: int = 16):
        self.size = size
        self._heads: OrderedDict[str, list[int] | None] = OrderedDict()  # None: no head renders
        self._lock = threading.Lock()

    def length(self, tokenizer, messages: list[dict], tools: list | None, prompt: list[int],
               block_size: int) -> int:
        """Tokens of `prompt` (the chat's whole prompt) that its system-and-tools head covers,
        floored to whole blocks; 0 when there is no head or it is shorter than a block."""
        system = [m for m in messages if m.get("role") == "system"]
        if not system and not tools:
            return 0
        key = hashlib.sha256(json.dumps([system, tools], sort_keys=True, default=str).encode()).hexdigest()
        with self._lock:
            known = key in self._heads
            head = self._heads.get(key)
            if known:
                self._heads.move_to_end(key)
        if not known:
            head = _render(tokenizer, system, tools)
            with self._lock:
                self._heads[key] = head
                while len(self._heads) > self.size:
                    self._heads.popitem(last=False)
        return 0 if head is None else common_prefix(head, prompt) // block_size * block_size


def head_length(tokenizer, messages: list[dict], tools: list | None, prompt: list[int], block_size: int) -> int:
    """SystemHeads.length for one prompt, nothing kept."""
    return SystemHeads(1).length(tokenizer, messages, tools, prompt, block_size)


def _render(tokenizer, system: list[dict], tools: list | None) -> list[int] | None:
    """The head's tokens: the system messages and tools alone, or before a placeholder user turn."""
    for alone in (system, system + [{"role": "user", "content": _PLACEHOLDER}]):
        try:
            return chat_tokens(tokenizer, alone, add_generation_prompt=False, tools=tools)
        except Exception as e:  # the template wants a user turn (or more): try with one, then give up
            log.debug("could not render the system-and-tools head: %s", e)
    return None  # no head, never a failed request


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two token lists share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
