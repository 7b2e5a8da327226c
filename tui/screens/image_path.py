"""Ask for the path of an image to attach to the next message (the palette's "Attach image")."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label


class ImagePathScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel", id="image_path.cancel", tooltip="Attach nothing")]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Attach an image: its path (Enter to attach, Esc to cancel)")
            yield Input(placeholder="~/Pictures/diagram.png", id="image-path-input")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
