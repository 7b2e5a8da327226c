"""KV cache connectors: tiers behind the block pool (see base.py)."""

from mlxkv.connectors.base import BlockKV, KvCacheConnector, LoadedBlock, NoopKvCacheConnector, TierStats

__all__ = ["BlockKV", "KvCacheConnector", "LoadedBlock", "NoopKvCacheConnector", "TierStats"]
