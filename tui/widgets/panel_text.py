"""A panel section of plain text lines, redrawn only when its text changes.

Cheaper than a Rich Table (no measuring pass), and the sections are
updated a few times a second while a reply streams.
"""

from __future__ import annotations

from textual.widgets import Static


class PanelText(Static):
    def __init__(self, **kwargs) -> None:
        super().__init__(markup=False, **kwargs)
        self._shown = ""

    def show_text(self, text: str) -> None:
        if text != self._shown:
            self._shown = text
            self.update(text, layout=False)  # fixed height in the stylesheet
