"""The panel's last-turn section shows a reply's speculative decoding when it had any."""

from __future__ import annotations

from textual.app import App

from mlxkv.engine.records import RequestStats
from mlxkv.tui.widgets.turn_stats import TurnStats
from tui_support import pilot_test, shown


class _Panel(App):
    def compose(self):
        yield TurnStats()


def _stats(**fields) -> dict:
    return RequestStats(200, {"pool": 160, "memory": 0, "disk": 0}, 40, 48, ttft_s=0.05,
                        decode_tokens_per_s=80.0, **fields).as_dict()


@pilot_test
async def test_a_turn_with_speculation_shows_what_was_accepted():
    app = _Panel()
    async with app.run_test(size=(60, 20)) as pilot:
        panel = app.query_one(TurnStats)
        panel.show_turn(_stats(proposed_tokens=40, accepted_tokens=30))
        await pilot.pause()
        assert "speculated" in shown(panel) and "30/40" in shown(panel) and "75%" in shown(panel)
        panel.show_turn(_stats())
        await pilot.pause()
        assert "speculated" not in shown(panel)
