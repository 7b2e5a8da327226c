"""The last turn: prompt tokens by where they came from, time to first token, decode speed."""

from __future__ import annotations

from mlxkv.tui.cache_stats import SOURCE_LABELS, SOURCES, reused_tokens
from mlxkv.tui.widgets.panel_text import PanelText

TITLES = {"reply": "Last turn", "prefill": "Reopened chat (prefix prefill)"}


def image_line(tokens: int, cached: int) -> str:
    """The prompt's images as their own source: 'image: 12 tokens, cached'."""
    state = "cached" if cached == tokens else "computed" if not cached else f"{cached:,} cached"
    return f"image: {tokens:,} token{'' if tokens == 1 else 's'}, {state}"


def _row(label: str, value: str, share: str = "") -> str:
    return f"{label:<20}{value:>10}{share:>6}"


class TurnStats(PanelText):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.stats: dict | None = None  # the turn shown, as RequestStats.as_dict()
        self.kind = ""

    def on_mount(self) -> None:
        self.border_title = "Last turn"
        self.show_text("No turn yet. Send a message.")

    def show_live(self, tokens: int, tokens_per_s: float | None) -> None:
        """While a reply streams: tokens so far."""
        self.border_title = "This turn"
        rate = f", {tokens_per_s:.0f} tok/s" if tokens_per_s else ""
        self.show_text(f"generating: {tokens} token{'' if tokens == 1 else 's'}{rate}")

    def show_turn(self, stats: dict, kind: str = "reply") -> None:
        self.stats, self.kind = stats, kind
        self.border_title = TITLES.get(kind, kind)
        prompt = stats["prompt_tokens"]

        def share(n: int) -> str:
            return f"{n / prompt:.0%}" if prompt else ""

        rows = [_row("prompt tokens", f"{prompt:,}")]
        images = stats.get("image_tokens", 0)
        if images:  # in place of the speculated row: image rows do not speculate (docs/vision.md)
            rows.append(f"  {image_line(images, stats.get('cached_image_tokens', 0))}")
        for source in SOURCES:
            n = stats["cached_tokens"].get(source, 0)
            rows.append(_row(f"  from {SOURCE_LABELS[source]}", f"{n:,}", share(n)))
        rows.append(_row("  computed", f"{stats['computed_tokens']:,}", share(stats["computed_tokens"])))
        rows.append(_row("reused", f"{reused_tokens(stats):,}", share(reused_tokens(stats))))
        rows.append(_row("time to first token", f"{stats['ttft_s'] * 1000:,.1f} ms"))
        if kind == "reply":
            rows.append(_row("reply tokens", f"{stats['generation_tokens']:,}"))
            rows.append(_row("decode", f"{stats['decode_tokens_per_s']:,.1f} tok/s"))
            proposed = stats.get("proposed_tokens", 0)
            if proposed:
                accepted = stats["accepted_tokens"]
                rows.append(_row("  speculated", f"{accepted:,}/{proposed:,}", f"{accepted / proposed:.0%}"))
        self.show_text("\n".join(rows))
