"""Where a streamed reply is cut into segments, each drawn by its own Markdown widget.

Textual's Markdown stream re-parses and re-wraps the document's last block
on every update, so one long paragraph costs more per update the longer it
gets (on a 2-core machine: 15 ms at 500 characters, 40 ms at 10,000). A new
segment starts at a line break once the current one holds SEGMENT_CHARS,
or at a space past HARD_SEGMENT_CHARS when no line break comes, and never
inside a code fence. The finished reply is drawn again as one document.
"""

from __future__ import annotations

import re

SEGMENT_CHARS = 600
HARD_SEGMENT_CHARS = 1000
_FENCES = ("```", "~~~")


class Segmenter:
    def __init__(self) -> None:
        self.length = 0  # characters in the current segment
        self.in_fence = False
        self._line = ""  # the current line so far, to spot fences

    def feed(self, delta: str) -> list[str]:
        """Pieces of `delta`: the first continues the current segment, each
        further one starts a new segment (an empty last one: start it now)."""
        pieces = [""]
        for part in re.split(r"(\n)", delta):
            if part == "\n":
                pieces[-1] += part
                self.length += 1
                self._end_line()
                if self.length >= SEGMENT_CHARS and not self.in_fence:
                    pieces.append("")
                    self.length = 0
            elif part:
                self._add_to_line(part, pieces)
        return pieces

    def _add_to_line(self, part: str, pieces: list[str]) -> None:
        cut = part.rfind(" ") + 1
        if self.length + len(part) >= HARD_SEGMENT_CHARS and not self.in_fence and cut:
            pieces[-1] += part[:cut]
            pieces.append(part[cut:])
            self.length = len(part) - cut
        else:
            pieces[-1] += part
            self.length += len(part)
        self._line += part

    def _end_line(self) -> None:
        if self._line.lstrip().startswith(_FENCES):
            self.in_fence = not self.in_fence
        self._line = ""
