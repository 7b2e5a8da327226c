"""Helpers for fault tests: real filesystem conditions and damaged block files."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import safetensors.numpy


def rewrite(path: Path, *, meta_changes=None, tensors=None) -> None:
    """Re-save a block file with some metadata or tensors replaced."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    meta.update(meta_changes or {})
    arrays = safetensors.numpy.load(data)
    arrays.update(tensors or {})
    path.write_bytes(safetensors.numpy.save(arrays, metadata=meta))


def remount_read_only(mountpoint: Path) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(mountpoint)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only: {r.stderr.strip()}")


def mount_tmpfs(directory: Path, size: str, inodes: int | None = None) -> Path:
    """Mount a tmpfs of `size` (and at most `inodes` files and directories) on a new `directory`,
    or skip saying why not."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    directory.mkdir()
    options = f"size={size},mode=0755" + (f",nr_inodes={inodes}" if inodes else "")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {r.stderr.strip()}")
    return directory


def fill_disk(directory: Path) -> Path:
    """Fill the file system of `directory` with one file of other data, to its last byte."""
    ballast = directory / "other-data"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 16, 512, 1):
            try:
                while os.write(fd, b"\0" * chunk):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)
    return ballast


def use_up_inodes(directory: Path) -> list[Path]:
    """Create empty files in `directory` until its file system has no inode left."""
    made = []
    try:
        while True:
            path = directory / f"inode-{len(made)}"
            path.touch()
            made.append(path)
    except OSError:
        return made


def wait_until(predicate, timeout: float = 20.0) -> bool:
    """Whether `predicate()` came true within `timeout` seconds (a tier recovering, a state changing)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def fill_redis(url: str) -> None:
    """Fill a `noeviction` server with someone else's 2 MB, then cap it at 1 MB, so every write is refused.

    Far over the cap, not just over: a client buffer freed later could
    otherwise bring it back under and let a write in.
    """
    import redis

    filler = redis.Redis.from_url(url)
    for i in range(200):
        filler.set(f"other:{i}", b"x" * 10_000)
    filler.config_set("maxmemory", "1mb")
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        filler.set("other:more", b"x")
    filler.close()
