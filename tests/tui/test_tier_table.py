"""The chat app's tier table: remote beside pool, memory and SSD, and a tier in trouble shows its state."""

from __future__ import annotations

from mlxkv.tui.widgets.tier_table import TierTable


def rows(tiers: dict) -> dict[str, list[str]]:
    table = TierTable()
    table.show_tiers(tiers, cached_blocks=12)
    return {line.split()[0]: line.split()[1:] for line in table._shown.splitlines()[1:]}


def test_every_tier_has_a_row_and_one_in_trouble_shows_its_state():
    ok = {"bytes_held": 2_000_000, "spills": 3, "state": "ok"}
    shown = rows({"memory": ok, "disk": {**ok, "state": "dropping-writes", "reason": "out of inodes"},
                  "remote": {**ok, "server_bytes": 5_000_000, "state": "ok"}})
    assert shown["pool"] == ["12", "blk", "-"]
    assert shown["memory"] == ["2.0", "MB", "-", "3"]
    assert shown["SSD"] == ["dropping", "-", "3"]
    assert shown["remote"] == ["5.0", "MB", "-", "3"]  # a shared server: what it holds in all
    assert rows({})["remote"] == ["off"]
    assert rows({"remote": {**ok, "state": "down", "server_bytes": 0}})["remote"][0] == "down"
