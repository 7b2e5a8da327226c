"""Shown instead of the chat when the model cannot be loaded."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, Label, Static

HINT = (
    "Try [b]mlxkv chat --model demo[/b] (built in, works offline) or a local model "
    "directory: [b]mlxkv chat --model /path/to/mlx-model[/b]."
)


class ErrorScreen(Screen[None]):
    BINDINGS = [
        Binding("q,escape", "quit", "Quit", id="error.quit", tooltip="Leave the app"),
    ]

    def __init__(self, title: str, message: str) -> None:
        super().__init__()
        self.error_title = title
        self.message = message

    def compose(self) -> ComposeResult:
        with Vertical(id="error-box", classes="dialog"):
            yield Label(self.error_title, id="error-title", markup=False)  # it names the model
            yield Static(self.message, id="error-message", markup=False)
            yield Static(HINT, id="error-hint")
        yield Footer()

    def action_quit(self) -> None:
        self.app.exit(return_code=2, message=f"mlxkv: error: {self.message}")  # the app keeps it 2 on every way out
