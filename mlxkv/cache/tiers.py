"""The names of the places a prompt's reused tokens come from.

The pool itself, then the connector's tiers behind it. The same names key
`RequestStats.cached_tokens`, the connectors' stats, the CLI's JSON and the
chat app's cache panel.
"""

from __future__ import annotations

POOL = "pool"
MEMORY = "memory"
DISK = "disk"
REMOTE = "remote"  # a Redis or Valkey server many processes share
TIERS = (POOL, MEMORY, DISK, REMOTE)  # in the order a lookup tries them


def no_reuse() -> dict[str, int]:
    """Reused tokens per tier, all zero."""
    return dict.fromkeys(TIERS, 0)
