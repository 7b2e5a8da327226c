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
        self.placeholder = "Message (Enter to send, Shift+Enter for a new line)"

    def action_submit(self) -> None:
        if self.text.strip():
            self.post_message(self.Submitted(self, self.text))

    def action_newline(self) -> None:
        self.insert("\n")
