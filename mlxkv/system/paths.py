"""Where mlxkv keeps things on disk: the user cache and data dirs (MLXKV_CACHE_DIR, MLXKV_DATA_DIR)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_root() -> Path:
    return Path(os.environ.get("MLXKV_CACHE_DIR") or platformdirs.user_cache_dir("mlxkv"))


def default_disk_tier_dir() -> Path:
    """The SSD tier's default home (used by `mlxkv chat` and `mlxkv cache`)."""
    return cache_root() / "kv"


def data_dir() -> Path:
    """Where user data lives (the chat app's conversations), or MLXKV_DATA_DIR."""
    return Path(os.environ.get("MLXKV_DATA_DIR") or platformdirs.user_data_dir("mlxkv"))
