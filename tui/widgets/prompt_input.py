"""The message box: Enter sends, Shift+Enter (or Ctrl+J) starts a new line."""

from __future__ import annotations

from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    BINDINGS = [
        Binding("enter", "submit", "Send", id="prompt.send", priority=True,
                tooltip="Send the message to the model"),
        Binding("shift+enter,ctrl+j", "newline", "New line", id="prompt.newline", priority=True,
                show=False, tooltip="Insert a line break (Ctrl+J where Shift+Enter is not told apart)"),
    ]

    class Submitted(Message):
        def __init__(self, prompt_input: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt_input = prompt_input
            self.text = text

        @property
        def control(self) -> PromptInput:
            return self.prompt_input

    def __init__(self, *, cursor_blink: bool = True, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.cursor_blink = cursor_blink
        # Short enough for the box at 110 columns, where the chats list still
        # shows (the long form was cut mid-word); the footer says Enter sends.
        self.placeholder = "Message (Shift+Enter for a new line)"

    # Priority bindings run on the app's queue as the key arrives there, while
    # the keys typed before it still wait in this widget's queue: keys that
    # came in one read of the terminal (fast typing, a busy machine) had
    # Enter send the message without its last characters. The actions queue
    # their work behind those keys.

    def action_submit(self) -> None:
        self.call_later(self._submit)

    def action_newline(self) -> None:
        self.call_later(self.insert, "\n")

    def _submit(self) -> None:
        if self.text.strip():
            self.post_message(self.Submitted(self, self.text))

    def take(self, sent: str) -> None:
        """Empty the box of a message that was sent, keeping what was typed after its Enter."""
        self.load_text(self.text[len(sent):] if self.text.startswith(sent) else "")
        self.move_cursor(self.document.end)
