"""Pool occupancy: free, cached-but-free, in use and shared blocks."""

from __future__ import annotations

from mlxkv.tui.widgets.panel_text import PanelText


class PoolUsage(PanelText):
    def on_mount(self) -> None:
        self.border_title = "Block pool"
        self.show_text("waiting for the engine")

    def show(self, usage: dict, block_size: int) -> None:
        # The pool grows on demand: its size now, and the budget it may grow to.
        self.border_title = f"Block pool: {usage['size_blocks']:,}/{usage['budget_blocks']:,} blocks of {block_size}"
        self.show_text(
            f"{'free':<10}{usage['free']:>8,}   {'cached':<8}{usage['cached_free']:>8,}\n"
            f"{'in use':<10}{usage['in_use']:>8,}   {'shared':<8}{usage['shared']:>8,}\n"
            f"{'evictions':<10}{usage['evictions']:>8,}"
        )
