"""Stored responses, for the Responses API's `previous_response_id`.

With `store` (the API's default) the server keeps each response's
conversation: the input items as chat messages, and the reply. A follow-up
that sends only its new input and the previous response's id continues
that conversation, and its prompt is the same prefix the cache holds.
Instructions are not carried over, as in OpenAI's API: each request sends
its own. Kept in memory, the newest `kept` first out when full.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

DEFAULT_KEPT = 512


class ResponseStore:
    def __init__(self, kept: int = DEFAULT_KEPT):
        self.kept = kept
        self._conversations: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict]) -> None:
        with self._lock:
            self._conversations[response_id] = messages
            while len(self._conversations) > self.kept:
                self._conversations.popitem(last=False)

    def get(self, response_id: str) -> list[dict] | None:
        with self._lock:
            messages = self._conversations.get(response_id)
            if messages is not None:
                self._conversations.move_to_end(response_id)
        return messages
