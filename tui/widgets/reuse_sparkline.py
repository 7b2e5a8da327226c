"""Reuse ratio per turn of the open chat: one bar per turn, on a fixed 0-100% scale."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

BARS = "▁▂▃▄▅▆▇█"


def bar(ratio: float) -> str:
    return BARS[min(len(BARS) - 1, max(0, round(ratio * (len(BARS) - 1))))]


class ReuseSparkline(Widget):
    ratios: reactive[tuple[float, ...]] = reactive((), always_update=True)

    def on_mount(self) -> None:
        self.border_title = "Reuse per turn"

    def render(self) -> Text:
        if not self.ratios:
            return Text("no turns yet", style="dim")
        label = f" {self.ratios[-1]:.0%}"
        shown = self.ratios[-max(1, self.content_size.width - len(label)):]
        return Text.assemble((''.join(bar(r) for r in shown), "bold"), label)
