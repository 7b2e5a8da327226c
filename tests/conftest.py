"""Shared fixtures: tiny random-weight models, written once per test session."""

from __future__ import annotations

import subprocess

import pytest

from faults import mount_tmpfs
from real_parts import require

from mlxkv.models.tiny import TinyModelSpec, write_tiny_model

# GQA everywhere (4 query heads over 2 KV heads) unless a family needs otherwise.
FAMILY_SPECS = {
    "llama": TinyModelSpec(family="llama", seed=1),
    "qwen3": TinyModelSpec(family="qwen3", num_heads=8, num_kv_heads=2, head_dim=16, seed=2),
    "mistral": TinyModelSpec(family="mistral", seed=3),
    "qwen2": TinyModelSpec(family="qwen2", seed=4),
    "phi3": TinyModelSpec(family="phi3", num_kv_heads=4, seed=5),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: str(write_tiny_model(root / name, spec)) for name, spec in FAMILY_SPECS.items()}


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs["llama"]


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path_factory, monkeypatch):
    # The demo model and any on-disk state go to a per-session directory,
    # never the user's real cache or data dir (the chat app's conversations).
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "mlxkv-cache"))
    monkeypatch.setenv("MLXKV_DATA_DIR", str(tmp_path_factory.getbasetemp() / "mlxkv-data"))
    # A developer's team server is never a test's.
    monkeypatch.delenv("MLXKV_REMOTE_TIER", raising=False)
    monkeypatch.delenv("MLXKV_REMOTE_TIER_SALT", raising=False)


@pytest.fixture
def tmpfs(tmp_path):
    """`tmpfs(size)` mounts a small tmpfs (a real full disk, a real read-only mount)."""
    mounted = []

    def mount(size: str = "1m", inodes: int | None = None):
        d = mount_tmpfs(tmp_path / f"tmpfs{len(mounted)}", size, inodes)
        mounted.append(d)
        return d

    yield mount
    for d in reversed(mounted):
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


@pytest.fixture
def redis_server(tmp_path):
    """`redis_server(**options)` starts a real redis-server on a free loopback port, with its own
    config and data directory (LocalRedisServer's options: password, settings), stopped after the test."""
    from mlxkv.connectors.remote.local_server import LocalRedisServer, server_binary

    require("redis-server", server_binary())
    started = []

    def start(**options):
        server = LocalRedisServer(tmp_path / f"redis{len(started)}", **options).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
