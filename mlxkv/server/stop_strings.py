"""Stop sequences over a stream of text deltas.

The engine stops on end-of-sequence ids; the APIs' `stop` and
`stop_sequences` are strings, which a model may write across several
tokens. Text that could still be the start of a stop string is held back
until the next delta says whether it is.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """The part of `text` (after what was held) that is safe to send."""
        if self.matched is not None:
            return ""
        text = self._held + text
        if not self.stops:
            self._held = ""
            return text
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            at, stop = min(hits)
            self.matched, self._held = stop, ""
            return text[:at]
        keep = partial_tail(text, self.stops)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """What was held back, once the reply has ended without a stop."""
        held, self._held = self._held, ""
        return held


def partial_tail(text: str, markers: list[str]) -> int:
    """Length of the longest end of `text` that could begin one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best
