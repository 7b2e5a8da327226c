"""Restore or recompute: the running estimates and the choice they make."""

from __future__ import annotations

import pytest

from mlxkv.cache.restore_cost import RestoreCost

PER_TOKEN = 128 << 10  # an 8B model's KV per token


def test_unknown_speeds_restore():
    cost = RestoreCost(PER_TOKEN)
    assert cost.restores("disk")
    cost.record_prefill(4096, 1.0)
    assert cost.restores("disk")  # the tier's speed is still unknown


def test_a_tier_slower_than_prefill_is_recomputed_and_a_faster_one_restored():
    cost = RestoreCost(PER_TOKEN).known(2000.0, {"disk": 100e6, "memory": 10e9})
    # Reading a token: 128 KiB at 100 MB/s is 1.3 ms; computing one: 0.5 ms.
    assert not cost.restores("disk")
    assert cost.restores("memory")


def test_estimates_follow_measurements():
    cost = RestoreCost(PER_TOKEN)
    cost.record_prefill(4096, 2.0)  # 2048 tok/s
    for _ in range(20):
        cost.record_read("disk", 1 << 30, 1.0)  # ~1 GB/s: 0.13 ms a token
    assert cost.restores("disk")
    for _ in range(20):
        cost.record_read("disk", 100 << 20, 1.0)  # a throttled disk: 1.25 ms a token
    assert not cost.restores("disk")
    cost.record_read("disk", 10, 1e-9)  # too small a read to say anything
    cost.record_prefill(3, 1e-9)
    assert not cost.restores("disk")


@pytest.mark.parametrize("policy,expected", [("restore", True), ("recompute", False)])
def test_a_pinned_policy_ignores_the_estimates(policy, expected):
    cost = RestoreCost(PER_TOKEN, policy=policy).known(2000.0, {"disk": 1.0 if expected else 1e15})
    assert cost.restores("disk") is expected


def test_a_bad_policy_is_refused():
    with pytest.raises(ValueError, match="restore policy"):
        RestoreCost(PER_TOKEN, policy="sometimes")
