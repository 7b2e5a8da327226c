"""The engine config (mlxkv/config.py): split by what it configures, each default in one place."""

from __future__ import annotations

import dataclasses

import pytest

from mlxkv import config
from mlxkv.config import (AttentionConfig, CacheConfig, CheckpointConfig, EngineConfig, PoolConfig,
                          SpeculationConfig, TierConfig)
from mlxkv.errors import MlxkvError
from mlxkv.kv_format import KVFormat


def test_the_flat_builder_fills_each_part_of_the_engine_config():
    built = CacheConfig(block_size=32, kv_bits=8, kv_group_size=32, disk_tier="/x", remote_tier_salt="s",
                        attention="reference", speculative="lookup", speculative_tokens=3,
                        checkpoint_interval=512, idle_checkpoint_s=1.0, idle_shrink_s=9.0).engine_config()
    assert built == EngineConfig(
        pool=PoolConfig(block_size=32, kv_format=KVFormat(8, 32), idle_shrink_s=9.0),
        tiers=TierConfig(disk_tier="/x", remote_tier_salt="s"),
        attention=AttentionConfig("reference"),
        speculation=SpeculationConfig("lookup", 3),
        checkpoints=CheckpointConfig(interval=512, idle_s=1.0),
    )
    assert CacheConfig().engine_config() == EngineConfig()


@pytest.mark.parametrize("make, match", [
    (lambda: PoolConfig(block_size=12), "power of two"),
    (lambda: PoolConfig(kv_format=8), "KVFormat"),
    (lambda: TierConfig(remote_tier="http://host"), "scheme"),
    (lambda: AttentionConfig("fast"), "auto, reference or kernel"),
    (lambda: SpeculationConfig("draft"), "give both or neither"),
    (lambda: CheckpointConfig(share=1.0), "between 0 and 1"),
    (lambda: EngineConfig(pool=PoolConfig(kv_format=KVFormat(8)), tiers=TierConfig(memory_tier_bits=8)),
     "memory-tier-bits"),
    (lambda: CacheConfig(kv_format=KVFormat(8), kv_bits=4), "not both"),
])
def test_each_part_checks_itself_at_construction(make, match):
    with pytest.raises(MlxkvError, match=match):
        make()


def test_the_parts_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PoolConfig().block_size = 32


def test_the_flags_and_the_tiers_take_their_defaults_from_config(monkeypatch):
    from mlxkv.cli import build_parser
    from mlxkv.cli_flags import REMOTE_TIER_ENV, REMOTE_TIER_SALT_ENV, cache_config
    from mlxkv.connectors.remote import keys, link

    monkeypatch.delenv(REMOTE_TIER_ENV, raising=False)
    monkeypatch.delenv(REMOTE_TIER_SALT_ENV, raising=False)
    args = build_parser().parse_args(["generate", "--kv-bits", "8", "--prompt", "hi"])
    built = cache_config(args).engine_config()
    assert built.pool.block_size == config.DEFAULT_BLOCK_SIZE
    assert built.pool.kv_format == KVFormat(8, config.DEFAULT_KV_GROUP_SIZE)
    assert built.tiers == TierConfig(disk_tier=built.tiers.disk_tier)  # every other tier field: its default
    assert built.speculation == SpeculationConfig()
    assert keys.DEFAULT_PREFIX == config.DEFAULT_REMOTE_TIER_PREFIX
    assert link.DEFAULT_TIMEOUT_S * 1000 == config.DEFAULT_REMOTE_TIER_TIMEOUT_MS
