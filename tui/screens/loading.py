"""Shown while the engine thread fetches and loads the model."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.markup import escape
from textual.widgets import Label, ProgressBar


class LoadingScreen(ModalScreen[None]):
    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box", classes="dialog"):
            # Model names and progress lines are text, not markup: a path
            # with "[/]" in it crashed the app before the error screen.
            yield Label(f"Loading [b]{escape(self.model)}[/b]", id="loading-title")
            yield Label("starting the engine thread", id="loading-status", markup=False)
            yield ProgressBar(total=None, show_eta=False, id="loading-progress")

    def show_progress(self, text: str, fraction: float | None) -> None:
        self.query_one("#loading-status", Label).update(text)
        bar = self.query_one(ProgressBar)
        if fraction is None:
            bar.update(total=None)
        else:
            bar.update(total=100, progress=100 * fraction)
