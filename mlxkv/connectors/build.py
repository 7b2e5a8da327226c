"""The connector a CacheConfig asks for: explicit, tiers, or the no-op."""

from __future__ import annotations

from mlxkv.cache.connector import NoopKVCacheConnector
from mlxkv.connectors.memory import InMemoryKVCacheConnector
from mlxkv.connectors.tiered import TieredKVCacheConnector


def build_connector(cache_config, fingerprint: bytes, layout):
    """The connector a CacheConfig asks for: explicit, tiers, or the no-op."""
    if cache_config.connector is not None:
        return cache_config.connector
    disk = None
    if cache_config.disk_tier is not None:
        from mlxkv.connectors.disk.connector import DiskKVCacheConnector

        disk = DiskKVCacheConnector(
            cache_config.disk_tier,
            fingerprint,
            block_size=layout.block_size,
            num_layers=layout.num_layers,
            dtype=str(layout.dtype).removeprefix("mlx.core."),
            budget_bytes=cache_config.disk_tier_bytes,
            page=(layout.n_kv_heads, layout.head_dim, layout.num_v_heads, layout.v_head_dim),
        )
        if disk.disabled:  # it warned why; left in, it would show as an empty tier
            disk.close()
            disk = None
    memory_bytes, bits = cache_config.memory_tier_bytes, cache_config.memory_tier_bits
    if memory_bytes and disk:
        return TieredKVCacheConnector(disk, memory_bytes, layout.block_size, bits)
    if memory_bytes:
        return InMemoryKVCacheConnector(memory_bytes, layout.block_size, bits)
    return disk or NoopKVCacheConnector()
