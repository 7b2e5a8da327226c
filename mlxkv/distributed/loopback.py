"""A set of ranks on this one machine, over MLX's ring back-end on 127.0.0.1: for the tests
and `mlxkv bench distributed` (ports are asked of the OS, so runs side by side never clash)."""

from __future__ import annotations

import json
import socket
from pathlib import Path


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def loopback_hostfile(path: Path, n: int) -> Path:
    """The MLX_HOSTFILE of `n` ranks on 127.0.0.1 (one `host:port` list per rank)."""
    path.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(n)]))
    return path
