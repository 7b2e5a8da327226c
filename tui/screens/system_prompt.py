"""Edit a chat's own system prompt."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, TextArea


class SystemPromptScreen(ModalScreen[str | None]):
    BINDINGS = [
        # Not a priority binding: those run as the key reaches the app, ahead
        # of the keys before it still queued in the text box (see PromptInput),
        # and the text box has no Ctrl+S of its own.
        Binding("ctrl+s", "save", "Save", id="system_prompt.save",
                tooltip="Save the system prompt for this chat"),
        Binding("escape", "cancel", "Cancel", id="system_prompt.cancel", tooltip="Leave it unchanged"),
    ]

    def __init__(self, system_prompt: str) -> None:
        super().__init__()
        self.system_prompt = system_prompt

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("System prompt for this chat (Ctrl+S to save, Esc to cancel)")
            yield TextArea(self.system_prompt, id="system-prompt-input", soft_wrap=True)

    def action_save(self) -> None:
        self.dismiss(self.query_one(TextArea).text.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)
