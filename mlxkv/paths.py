"""Where mlxkv keeps things on disk: the user cache dir, or MLXKV_CACHE_DIR."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_root() -> Path:
    return Path(os.environ.get("MLXKV_CACHE_DIR") or platformdirs.user_cache_dir("mlxkv"))


def default_disk_tier_dir() -> Path:
    """The SSD tier's default home (used by `mlxkv chat` and `mlxkv cache`)."""
    return cache_root() / "kv"
