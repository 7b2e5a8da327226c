"""Ask for a chat's new title."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label


class RenameScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel", id="rename.cancel", tooltip="Keep the old title")]

    def __init__(self, title: str) -> None:
        super().__init__()
        self.old_title = title

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Rename chat (Enter to save, Esc to cancel)")
            yield Input(self.old_title, id="rename-input", select_on_focus=True)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
