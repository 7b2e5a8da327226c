"""One message of a chat, rendered as Markdown; an assistant reply can stream in."""

from __future__ import annotations

import re

from textual.reactive import reactive
from textual.widgets import Markdown
from textual.widgets.markdown import MarkdownStream

ROLE_TITLES = {"user": "you", "assistant": "assistant", "system": "system"}
# Control characters (a "\r" moves the terminal's cursor) and the line
# separators Markdown's line counting does not share with str.splitlines.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: str) -> str:
    """`text` as shown: unprintable characters become U+FFFD. The raw text is kept."""
    return _UNPRINTABLE.sub("\ufffd", text)


class MessageView(Markdown):
    text: reactive[str] = reactive("", init=False)

    def __init__(self, role: str, text: str = "", finish_reason: str | None = None) -> None:
        super().__init__(printable(text), classes=f"message {role}")
        self.role = role
        self.set_reactive(MessageView.text, text)
        self._stream: MarkdownStream | None = None
        self.border_title = ROLE_TITLES.get(role, role)
        self.show_finish_reason(finish_reason)

    def watch_text(self, text: str) -> None:
        self.update(printable(text))

    def show_finish_reason(self, finish_reason: str | None) -> None:
        if finish_reason == "cancelled":
            self.border_subtitle = "stopped"
        elif finish_reason == "length":
            self.border_subtitle = "max tokens"
        elif finish_reason == "error":
            self.border_subtitle = "failed"

    async def stream_in(self, delta: str) -> None:
        """Stream `delta` in; the raw text is kept without a re-render."""
        self.set_reactive(MessageView.text, self.text + delta)
        if not self.is_attached:
            return  # its chat was closed mid-reply; the text is still kept
        if self._stream is None:
            self._stream = Markdown.get_stream(self)
        await self._stream.write(printable(delta))

    async def end_stream(self, finish_reason: str | None = None) -> None:
        """Stop streaming, then render the whole text once (fences stay intact)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.show_finish_reason(finish_reason)
        await self.update(printable(self.text))
