"""A map of the block pool: one cell per block, or per group of blocks in a big pool.

A cell's glyph and color show the block's state (free, cached, in use,
shared) or, stronger, what the current turn did to it: a prefix hit, a
block hydrated from the memory, SSD or remote tier, a new block, a spill.
"""

from __future__ import annotations

import itertools

from rich.text import Text
from textual.geometry import Size
from textual.widget import Widget

from mlxkv.host.pool_view import PoolSnapshot

MAX_ROWS = 8
# (character in the snapshot, glyph, component class, legend label), strongest first.
MARKS = [
    ("x", "×", "spill", "spill"),
    ("r", "◆", "remote", "net"),
    ("d", "◆", "disk", "ssd"),
    ("m", "◆", "memory", "mem"),
    ("p", "●", "hit", "hit"),
    ("n", "+", "new", "new"),
]
MARK_LEGEND = "pmdrnx"  # reading order: hits, hydrations, new, spills
OPTIONAL_MARKS = "r"  # in the legend only when a turn has them (most setups have no remote tier)
STATES = [
    ("s", "■", "shared", "shared"),
    ("u", "■", "in-use", "in use"),
    ("c", "▪", "cached", "cached"),
    (".", "·", "free", "free"),
]


def cell_of(states: str, marks: str) -> tuple[str, str]:
    """The glyph and class of a group of blocks: its strongest mark, else its busiest state."""
    for char, glyph, name, _ in MARKS:
        if char in marks:
            return glyph, name
    for char, glyph, name, _ in STATES:
        if char in states:
            return glyph, name
    return " ", "free"


class BlockMap(Widget):
    COMPONENT_CLASSES = {f"block-map--{name}" for _, _, name, _ in MARKS + STATES}

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.snapshot: PoolSnapshot | None = None

    def on_mount(self) -> None:
        self.border_title = "Block map"

    def show(self, snapshot: PoolSnapshot) -> None:
        old, self.snapshot = self.snapshot, snapshot
        if old is None or old.num_blocks != snapshot.num_blocks:
            self.refresh(layout=True)  # the height depends on the pool's size only
            self._show_scale()
        elif (old.states, old.marks) != (snapshot.states, snapshot.marks):
            self.refresh()

    def on_resize(self) -> None:
        self._show_scale()

    def _show_scale(self) -> None:
        width = self.content_size.width
        if self.snapshot is not None and width > 0:
            per = self._grid(width)[1]
            self.border_subtitle = f"1 cell = {per} blocks" if per > 1 else "1 cell = 1 block"

    def _grid(self, width: int) -> tuple[int, int]:
        """(rows, blocks per cell) for a pool drawn `width` cells wide."""
        n = self.snapshot.num_blocks
        per_cell = max(1, -(-n // (width * MAX_ROWS)))
        return -(-n // (per_cell * width)), per_cell

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        if self.snapshot is None or width < 1:
            return 1
        return self._grid(width)[0] + 3  # the map, a blank line, two legend lines

    def render(self) -> Text:
        snap = self.snapshot
        width = self.content_size.width
        if snap is None or width < 1:
            return Text("no pool yet", style="dim")
        rows, per = self._grid(width)
        text = Text(no_wrap=True, overflow="crop")
        for row in range(rows):
            cells = [cell_of(snap.states[i:i + per], snap.marks[i:i + per])
                     for i in range(row * width * per, min(snap.num_blocks, (row + 1) * width * per), per)]
            for name, run in itertools.groupby(cells, key=lambda cell: cell[1]):
                text.append("".join(glyph for glyph, _ in run), self.get_component_rich_style(f"block-map--{name}"))
            text.append("\n")
        text.append("\n")
        by_char = {item[0]: item for item in MARKS}
        shown = [c for c in MARK_LEGEND if c not in OPTIONAL_MARKS or snap.mark_counts.get(c)]
        text.append_text(self._legend([by_char[c] for c in shown], snap.mark_counts))
        text.append("\n")
        text.append_text(self._legend(STATES))
        return text

    def _legend(self, items, counts: dict | None = None) -> Text:
        legend = Text(no_wrap=True, overflow="ellipsis")
        for char, glyph, name, label in items:
            legend.append(glyph, self.get_component_rich_style(f"block-map--{name}"))
            count = f" {counts.get(char, 0)}" if counts is not None else ""
            legend.append(f"{label}{count} ")
        return legend
