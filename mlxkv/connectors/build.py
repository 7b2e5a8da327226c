"""The connector a TierConfig (config.py) asks for: explicit, tiers, or the no-op."""

from __future__ import annotations

from mlxkv.cache.connector import NoopKVCacheConnector
from mlxkv.connectors.memory import InMemoryKVCacheConnector
from mlxkv.connectors.tiered import TieredKVCacheConnector


def build_connector(cache_config, fingerprint: bytes, layout):
    """The connector `cache_config` (a TierConfig) asks for: explicit, tiers (memory, SSD, remote), or the no-op."""
    if cache_config.connector is not None:
        return cache_config.connector
    disk, remote = _disk_tier(cache_config, fingerprint, layout), _remote_tier(cache_config, fingerprint, layout)
    memory_bytes, bits = cache_config.memory_tier_bytes, cache_config.memory_tier_bits
    behind = [t for t in (disk, remote) if t is not None]
    if memory_bytes and behind or len(behind) > 1:
        return TieredKVCacheConnector(disk, memory_bytes, layout.block_size, bits, remote=remote)
    if memory_bytes:
        return InMemoryKVCacheConnector(memory_bytes, layout.block_size, bits)
    return behind[0] if behind else NoopKVCacheConnector()


def _dtype(layout) -> str:
    return str(layout.dtype).removeprefix("mlx.core.")


def _kv_format(layout) -> str | None:
    """A quantized pool's format, which its files carry; None for full precision."""
    return layout.kv_format if layout.kv.quantized else None


def _disk_tier(cache_config, fingerprint: bytes, layout):
    if cache_config.disk_tier is None:
        return None
    from mlxkv.connectors.disk.connector import DiskKVCacheConnector

    disk = DiskKVCacheConnector(
        cache_config.disk_tier,
        fingerprint,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        dtype=_dtype(layout),
        budget_bytes=cache_config.disk_tier_bytes,
        min_free_bytes=cache_config.disk_tier_min_free_bytes,
        page=layout.stored_page,  # so a tier never returns pages of another shape
        kv_format=_kv_format(layout),
    )
    if disk.disabled:  # it warned why; left in, it would show as an empty tier
        disk.close()
        return None
    return disk


def _remote_tier(cache_config, fingerprint: bytes, layout):
    """The remote tier, even when its server is down at start: it warned, and it comes back by itself."""
    if cache_config.remote_tier is None:
        return None
    from mlxkv.connectors.remote.connector import RemoteKVCacheConnector

    return RemoteKVCacheConnector(
        cache_config.remote_tier,
        fingerprint,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        dtype=_dtype(layout),
        block_nbytes=layout.bytes_per_block,
        prefix=cache_config.remote_tier_prefix,
        ttl_s=cache_config.remote_tier_ttl_s,
        timeout_s=cache_config.remote_tier_timeout_ms / 1000,
        checkpoints=layout.group_layout.has_recurrent,
        page=layout.stored_page,  # so a tier never returns pages of another shape
        kv_format=_kv_format(layout),
    )
