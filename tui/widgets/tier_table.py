"""Each cache tier: what it holds, its hit rate this session, and its state when not ok."""

from __future__ import annotations

from mlxkv.cache.tiers import DISK, MEMORY, POOL, REMOTE
from mlxkv.tui.cache_stats import HitRates, human_bytes
from mlxkv.tui.widgets.panel_text import PanelText

SHORT_LABELS = {MEMORY: "memory", DISK: "SSD", REMOTE: "remote"}
# A tier in trouble shows its state where its bytes would be (the log has the reason).
SHORT_STATES = {"read-only": "read-only", "down": "down", "dropping-writes": "dropping"}


def _row(*cells: str) -> str:
    tier, held, rate, spills = cells
    return f"{tier:<8}{held:>11}{rate:>10}{spills:>8}"


class TierTable(PanelText):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tiers: dict[str, dict] = {}
        self.cached_blocks = 0
        self.hit_rates = HitRates()

    def on_mount(self) -> None:
        self.border_title = "Tiers"
        self._show()

    def show_tiers(self, tiers: dict, cached_blocks: int) -> None:
        self.tiers, self.cached_blocks = tiers, cached_blocks
        self._show()

    def add_turn(self, stats: dict) -> None:
        self.hit_rates.add(stats)
        self._show()

    def _show(self) -> None:
        rows = [_row("tier", "held", "hit rate", "spills"),
                _row(POOL, f"{self.cached_blocks:,} blk", self._rate(POOL), "")]
        for name in (MEMORY, DISK, REMOTE):
            tier = self.tiers.get(name)
            if tier is None:
                rows.append(_row(SHORT_LABELS[name], "off", "", ""))
            else:
                rows.append(_row(SHORT_LABELS[name], self._held(name, tier), self._rate(name), f"{tier['spills']:,}"))
        self.show_text("\n".join(rows))

    @staticmethod
    def _held(name: str, tier: dict) -> str:
        state = SHORT_STATES.get(tier.get("state", "ok"))
        if state is not None:
            return state
        # A remote server is shared: what it holds in all is what there is to show.
        return human_bytes(tier["server_bytes"] if name == REMOTE else tier["bytes_held"])

    def _rate(self, source: str) -> str:
        rate = self.hit_rates.rate(source)
        return "-" if rate is None else f"{rate:.0%}"
