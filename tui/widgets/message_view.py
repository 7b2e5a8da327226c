"""One message of a chat, rendered as Markdown; an assistant reply can stream in."""

from __future__ import annotations

import re

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Markdown
from textual.widgets.markdown import MarkdownStream

from mlxkv.tui.segments import Segmenter

ROLE_TITLES = {"user": "you", "assistant": "assistant", "system": "system"}
# "context" is the app's own: a "length" before max_tokens (ChatScreen._finish_reason).
FINISH_NOTES = {"cancelled": "stopped", "length": "max tokens", "context": "context full", "error": "failed"}
# Control characters (a "\r" moves the terminal's cursor) and the line
# separators Markdown's line counting does not share with str.splitlines.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: str) -> str:
    """`text` as shown: unprintable characters become U+FFFD. The raw text is kept."""
    return _UNPRINTABLE.sub("\ufffd", text)


class MessageView(Vertical):
    """A message: one Markdown document, or while streaming, segments of one (segments.py)."""

    text: reactive[str] = reactive("", init=False)

    def __init__(self, role: str, text: str = "", finish_reason: str | None = None) -> None:
        super().__init__(classes=f"message {role}")
        self.role = role
        self.set_reactive(MessageView.text, text)
        self._stream: MarkdownStream | None = None
        self._segmenter = Segmenter()
        self.border_title = ROLE_TITLES.get(role, role)
        self.show_finish_reason(finish_reason)

    @classmethod
    def resumed(cls, role: str, text: str) -> MessageView:
        """A view of a reply still streaming, for its chat opened again; it streams on from `text`."""
        view = cls(role, text)
        view._segmenter.feed(printable(text))  # so a code fence open in `text` stays whole
        return view

    def compose(self) -> ComposeResult:
        yield Markdown(printable(self.text))

    async def watch_text(self, text: str) -> None:
        await self._show_whole()

    def show_finish_reason(self, finish_reason: str | None) -> None:
        self.border_subtitle = FINISH_NOTES.get(finish_reason, "")

    async def stream_in(self, delta: str) -> None:
        """Stream `delta` in; the raw text is kept without a re-render."""
        self.set_reactive(MessageView.text, self.text + delta)
        if not self.is_attached:
            return  # its chat was closed mid-reply; the text is still kept
        for i, piece in enumerate(self._segmenter.feed(printable(delta))):
            if i > 0 or self._stream is None:
                await self._next_segment(first=self._stream is None and i == 0)
            if piece:
                await self._stream.write(piece)

    async def _next_segment(self, first: bool) -> None:
        if self._stream is not None:
            await self._stream.stop()
        segment = self.query_children(Markdown).last()
        if not first:
            segment = Markdown()
            await self.mount(segment)
        self._stream = Markdown.get_stream(segment)

    async def end_stream(self, finish_reason: str | None = None) -> None:
        """Stop streaming, then render the whole text once (fences stay intact)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.show_finish_reason(finish_reason)
        await self._show_whole()

    async def _show_whole(self) -> None:
        first, *rest = self.query_children(Markdown)
        if rest:
            await self.remove_children(rest)
        await first.update(printable(self.text))
