"""The vision tower's output per image hash, kept within a byte budget (LRU).

An image re-sent in a new conversation, or after its KV left every tier,
is embedded from here without running the vision tower again. Keys are
image hashes (image_keys.py), so two requests share an entry exactly when
their preprocessed pixels, grid and processor settings are equal.

Its stats also count the image tokens of the prompts that came through,
and how many of them a prefix hit served from the KV cache (the other
half of what an image costs): /v1/cache/stats and /metrics show both.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_BUDGET_BYTES = 256 * 1024 * 1024


class EncoderCache:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[bytes, object] = OrderedDict()  # image hash -> features (mx.array)
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.image_tokens = 0
        self.cached_image_tokens = 0

    def count_prompt(self, image_tokens: int, cached_image_tokens: int) -> None:
        """A prompt's image tokens, once per request (at its first forward, its hit known)."""
        self.image_tokens += image_tokens
        self.cached_image_tokens += cached_image_tokens

    def get(self, digest: bytes):
        features = self._entries.get(digest)
        if features is None:
            self.misses += 1
            return None
        self._entries.move_to_end(digest)
        self.hits += 1
        return features

    def put(self, digest: bytes, features) -> None:
        """Keep `features` unless they alone exceed the budget; older entries make room."""
        if digest in self._entries or features.nbytes > self.budget_bytes:
            return
        self._entries[digest] = features
        self.nbytes += features.nbytes
        while self.nbytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evictions += 1

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self.nbytes, "budget_bytes": self.budget_bytes,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "image_tokens": self.image_tokens, "cached_image_tokens": self.cached_image_tokens}
