"""The last turn: prompt tokens by where they came from, time to first token, decode speed."""

from __future__ import annotations

from rich.table import Table
from textual.widgets import Static

from tui.cache_stats import SOURCE_LABELS, SOURCES, reused_tokens

TITLES = {"reply": "Last turn", "prefill": "Reopened chat (prefix prefill)"}


class TurnStats(Static):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.stats: dict | None = None  # the turn shown, as RequestStats.as_dict()
        self.kind = ""

    def on_mount(self) -> None:
        self.border_title = "Last turn"
        self.update("No turn yet. Send a message.")

    def show_live(self, tokens: int, tokens_per_s: float | None) -> None:
        """While a reply streams: tokens so far."""
        self.border_title = "This turn"
        rate = f", {tokens_per_s:.0f} tok/s" if tokens_per_s else ""
        self.update(f"generating: {tokens} tokens{rate}", layout=False)

    def show_turn(self, stats: dict, kind: str = "reply") -> None:
        self.stats, self.kind = stats, kind
        self.border_title = TITLES.get(kind, kind)
        table = Table.grid(padding=(0, 1))
        table.add_column()
        table.add_column(justify="right")
        table.add_column(justify="right")
        prompt = stats["prompt_tokens"] or 1
        table.add_row("prompt tokens", f"{stats['prompt_tokens']:,}", "")
        for source in SOURCES:
            n = stats["cached_tokens"].get(source, 0)
            table.add_row(f"  from {SOURCE_LABELS[source]}", f"{n:,}", f"{n / prompt:.0%}")
        table.add_row("  computed", f"{stats['computed_tokens']:,}", f"{stats['computed_tokens'] / prompt:.0%}")
        table.add_row("reused", f"{reused_tokens(stats):,}", f"{reused_tokens(stats) / prompt:.0%}")
        table.add_row("time to first token", f"{stats['ttft_s'] * 1000:,.1f} ms", "")
        if kind == "reply":
            table.add_row("decode", f"{stats['decode_tokens_per_s']:,.1f} tok/s", f"{stats['generation_tokens']} tok")
        self.update(table, layout=False)
