"""Pool occupancy: free, cached-but-free, in use and shared blocks, and how the pool stores K/V."""

from __future__ import annotations

from mlxkv.tui.widgets.panel_text import PanelText


class PoolUsage(PanelText):
    def on_mount(self) -> None:
        self.border_title = "Block pool"
        self.show_text("waiting for the engine")

    def show(self, usage: dict, block_size: int, kv_format: str = "", kv_bytes_per_token: int = 0) -> None:
        # The pool grows on demand: its size now, and the budget it may grow to.
        self.border_title = f"Block pool: {usage['size_blocks']:,}/{usage['budget_blocks']:,} blocks of {block_size}"
        # the KV format in the second column's label place, its bytes per token as the value
        kv = f"   {kv_format:<8}{_per_token(kv_bytes_per_token):>8}" if kv_format else ""
        self.show_text(
            f"{'free':<10}{usage['free']:>8,}   {'cached':<8}{usage['cached_free']:>8,}\n"
            f"{'in use':<10}{usage['in_use']:>8,}   {'shared':<8}{usage['shared']:>8,}\n"
            f"{'evictions':<10}{usage['evictions']:>8,}{kv}"
        )


def _per_token(n: int) -> str:
    """KV bytes per token in at most 8 characters: "68K/tok", "3.2K/tok", "640B/tok"."""
    if n >= 10 * 1024:
        return f"{n / 1024:.0f}K/tok"
    return f"{n / 1024:.1f}K/tok" if n >= 1024 else f"{n}B/tok"
