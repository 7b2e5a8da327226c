"""Each cache tier: what it holds and its hit rate this session."""

from __future__ import annotations

from rich.table import Table
from textual.widgets import Static

from tui.cache_stats import HitRates, human_bytes

SHORT_LABELS = {"memory": "memory", "disk": "SSD"}


class TierTable(Static):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tiers: dict[str, dict[str, int]] = {}
        self.cached_blocks = 0
        self.hit_rates = HitRates()

    def on_mount(self) -> None:
        self.border_title = "Tiers"
        self._render_table()

    def show_tiers(self, tiers: dict, cached_blocks: int) -> None:
        self.tiers, self.cached_blocks = tiers, cached_blocks
        self._render_table()

    def add_turn(self, stats: dict) -> None:
        self.hit_rates.add(stats)
        self._render_table()

    def _render_table(self) -> None:
        table = Table(box=None, padding=(0, 1), show_edge=False)
        table.add_column("tier")
        table.add_column("held", justify="right")
        table.add_column("hit rate", justify="right")
        table.add_column("spills", justify="right")
        table.add_row("pool", f"{self.cached_blocks:,} blk", self._rate("pool"), "")
        for name in ("memory", "disk"):
            tier = self.tiers.get(name)
            if tier is None:
                table.add_row(SHORT_LABELS[name], "off", "", "", style="dim")
            else:
                table.add_row(SHORT_LABELS[name], human_bytes(tier["bytes_held"]), self._rate(name),
                              f"{tier['spills']:,}")
        self.update(table, layout=False)

    def _rate(self, source: str) -> str:
        rate = self.hit_rates.rate(source)
        return "-" if rate is None else f"{rate:.0%}"
