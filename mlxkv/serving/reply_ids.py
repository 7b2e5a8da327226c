"""The ids of the replies the server generated, so a reply sent back as text
keeps them.

HTTP clients send the whole conversation every turn, with each earlier reply
as text. Tokenizing that text again need not give back the ids the model
generated (reply_tokens.py says why), and the prefix cache hits only up to
the first id that differs. The server remembers, in a bounded LRU, each
reply's ids under its text; a message that carries the same text gets them
back as its "tokens", and reply_tokens.py decides, with its own checks,
whether they can stand in for the text.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

DEFAULT_KEPT = 4096


def _key(text: str) -> bytes:
    # A digest, not the text: a long reply is kept once, as its ids.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class ReplyIds:
    """At most `kept` replies' ids by their text, least recently used out first.

    Requests are handled on several threads, so the LRU takes a lock.
    """

    def __init__(self, kept: int = DEFAULT_KEPT):
        self.kept = kept
        self._ids: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, text: str, ids: list[int]) -> None:
        if not text or not ids or self.kept < 1:
            return
        key = _key(text)
        with self._lock:
            self._ids[key] = tuple(ids)
            self._ids.move_to_end(key)
            while len(self._ids) > self.kept:
                self._ids.popitem(last=False)

    def lookup(self, text: str) -> list[int] | None:
        if not text:
            return None
        key = _key(text)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
        return None if ids is None else list(ids)

    def attach(self, messages: list[dict]) -> list[dict]:
        """`messages` with each remembered assistant reply's ids as its "tokens"."""
        out = []
        for m in messages:
            if m.get("role") == "assistant" and "tokens" not in m and isinstance(m.get("content"), str):
                ids = self.lookup(m["content"])
                if ids is not None:
                    m = {**m, "tokens": ids}
            out.append(m)
        return out

    def __len__(self) -> int:
        return len(self._ids)
