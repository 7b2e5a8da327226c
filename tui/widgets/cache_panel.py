"""The live cache panel: last turn, reuse per turn, pool, tiers and the block map."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll

from mlxkv.host.pool_view import PoolSnapshot
from mlxkv.tui.cache_stats import reuse_ratio
from mlxkv.tui.widgets.block_map import BlockMap
from mlxkv.tui.widgets.pool_usage import PoolUsage
from mlxkv.tui.widgets.reuse_sparkline import ReuseSparkline
from mlxkv.tui.widgets.tier_table import TierTable
from mlxkv.tui.widgets.turn_stats import TurnStats


class CachePanel(VerticalScroll):
    def compose(self) -> ComposeResult:
        yield TurnStats(id="turn-stats")
        yield ReuseSparkline(id="reuse-sparkline")
        yield PoolUsage(id="pool-usage")
        yield TierTable(id="tier-table")
        yield BlockMap(id="block-map")

    def on_mount(self) -> None:
        self.border_title = "KV cache"

    def show_snapshot(self, snapshot: PoolSnapshot) -> None:
        self.query_one(PoolUsage).show(snapshot.usage, snapshot.block_size, snapshot.kv_format,
                                       snapshot.kv_bytes_per_token)
        self.query_one(TierTable).show_tiers(snapshot.tiers, snapshot.usage["cached"])
        self.query_one(BlockMap).show(snapshot)

    def show_live(self, tokens: int, tokens_per_s: float | None) -> None:
        self.query_one(TurnStats).show_live(tokens, tokens_per_s)

    def show_turn(self, stats: dict, kind: str = "reply") -> None:
        """A finished turn (or a reopened chat's prefill) with its stats."""
        self.query_one(TurnStats).show_turn(stats, kind)
        self.query_one(TierTable).add_turn(stats)
        if kind == "reply":
            sparkline = self.query_one(ReuseSparkline)
            sparkline.ratios = sparkline.ratios + (reuse_ratio(stats),)

    def show_history(self, turn_stats: list[dict]) -> None:
        """The reuse ratios of the open chat's earlier turns."""
        self.query_one(ReuseSparkline).ratios = tuple(reuse_ratio(s) for s in turn_stats)
