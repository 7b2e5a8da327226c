"""KV cache connectors: tiers behind the block pool (see base.py)."""
