"""Pool occupancy: free, cached-but-free, in use and shared blocks."""

from __future__ import annotations

from rich.table import Table
from textual.widgets import Static


class PoolUsage(Static):
    def on_mount(self) -> None:
        self.border_title = "Block pool"
        self.update("waiting for the engine")

    def show(self, usage: dict, block_size: int) -> None:
        self.border_title = f"Block pool: {usage['num_blocks']:,} blocks x {block_size} tokens"
        table = Table.grid(padding=(0, 1))
        table.add_column()
        table.add_column(justify="right")
        table.add_column()
        table.add_column(justify="right")
        table.add_row("free", f"{usage['free']:,}", "cached", f"{usage['cached_free']:,}")
        table.add_row("in use", f"{usage['in_use']:,}", "shared", f"{usage['shared']:,}")
        table.add_row("evictions", f"{usage['evictions']:,}", "", "")
        self.update(table, layout=False)
