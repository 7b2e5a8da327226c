"""The SSD tier's directory: its layout on disk, and `mlxkv cache info | clear`.

    <root>/CACHEDIR.TAG
    <root>/<fingerprint hex>/<first 2 hex>/<last block hash hex>.safetensors
    <root>/<fingerprint hex>/<first 2 hex>/.<hash hex>.<pid>.<8 hex>.tmp   (a write in flight)

File names come only from hex digests, so nothing a user typed ends up in a
path. Every directory made here is 0700. The connector (disk.py) owns what
goes into the files; this module knows only where they live, so the cache
commands can read and clear a directory without opening a tier on it.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from mlxkv.connectors.disk import run_file
from mlxkv.connectors.disk.file_io import choose_io
from mlxkv.connectors.disk.run_file import CorruptBlockError
from mlxkv.errors import MlxkvError
from mlxkv.cache.hashing import BlockHash

SUFFIX = ".safetensors"
MARKER = "CACHEDIR.TAG"
MARKER_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This directory is an mlxkv KV block cache (safe to delete).\n"
)
HASH_LEN = 32
STALE_TEMP_SECONDS = 3600  # a temp file this old is dead even if its pid lives

_HEX64 = re.compile(r"[0-9a-f]{64}")
BLOCK_NAME = re.compile(r"([0-9a-f]{64})\.safetensors")
_TEMP_NAME = re.compile(r"\.[0-9a-f]{64}\.([0-9]+)\.[0-9a-f]{8}\.tmp")


# -- the layout -----------------------------------------------------------------


def block_path(fp_dir: Path, block_hash: BlockHash) -> Path:
    """Where the file named after `block_hash` lives under a fingerprint directory."""
    if not isinstance(block_hash, bytes) or len(block_hash) != HASH_LEN:
        raise ValueError("a block hash must be 32 bytes")
    name = block_hash.hex()
    return fp_dir / name[:2] / f"{name}{SUFFIX}"


def is_shard(entry: os.DirEntry) -> bool:
    """Whether a fingerprint directory's entry is a shard: the directory of names starting with its 2 hex digits."""
    return len(entry.name) == 2 and entry.is_dir(follow_symlinks=False)


def temp_path(directory: Path, name: str) -> Path:
    """A fresh temp file name in `directory` for a write of file `name` by this process."""
    return directory / f".{name[:64]}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def is_dead_temp(path: Path) -> bool:
    """Whether `path` is a temp file of ours left by a process that is gone (or long stuck)."""
    m = _TEMP_NAME.fullmatch(path.name)
    if m is None:
        return False
    try:
        stale = time.time() - os.path.getmtime(path) > STALE_TEMP_SECONDS
    except FileNotFoundError:
        return False
    pid = int(m.group(1))
    return stale or (pid != os.getpid() and not _pid_alive(pid))


def write_marker(root: Path) -> None:
    """CACHEDIR.TAG: backup tools skip the tree, and `cache_clear` knows it."""
    marker = root / MARKER
    try:
        if not marker.exists():
            marker.write_text(MARKER_TEXT)
            os.chmod(marker, 0o600)
    except OSError:
        pass  # only a convenience


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink(path: Path) -> bool:
    """Remove a file; False if it was already gone."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- mlxkv cache info | clear ---------------------------------------------------


def cache_info(directory: str | os.PathLike, verify: bool = False) -> dict:
    """Files, blocks and bytes per model fingerprint under a disk cache directory;
    with `verify`, every file's checksum too, and the corrupt ones counted."""
    root = Path(directory).expanduser()
    if root.exists() and not root.is_dir():
        raise MlxkvError(f"{root} is not a directory")
    info = {"directory": str(root), "exists": root.is_dir(), "read_backend": choose_io().name,
            "fingerprints": {}, "files": 0, "blocks": 0, "bytes": 0}
    if not info["exists"]:
        return info
    try:
        _count_into(info, root)
        if verify:
            from mlxkv.connectors.disk.verify import verify_files

            info.update(verify_files([p for fp_dir in _fingerprint_dirs(root) for p, _ in block_files(fp_dir)]))
    except OSError as e:
        raise MlxkvError(f"cannot read {root}: {e.strerror or e}") from None
    return info


def cache_clear(directory: str | os.PathLike) -> int:
    """Delete every mlxkv block file (and temp file) under `directory`; returns files removed.

    Refuses (MlxkvError) a directory that does not look like an mlxkv disk
    cache, and names what stopped it (a read-only disk). Anything else in
    it is left alone.
    """
    root = Path(directory).expanduser()
    if not root.exists():
        return 0
    removed = 0
    try:
        if not root.is_dir() or not _looks_like_cache(root):
            raise MlxkvError(f"{root} does not look like an mlxkv disk cache; not clearing it")
        for _ in _remove_block_files(root):
            removed += 1
    except OSError as e:
        raise MlxkvError(f"cannot clear {root} ({removed} block files removed): {e.strerror or e}") from None
    return removed


def remove_fingerprint(directory: str | os.PathLike, fingerprint_hex: str) -> None:
    """Delete one model fingerprint's directory and all in it (`mlxkv models rm`)."""
    root = Path(directory).expanduser()
    fp_dir = root / fingerprint_hex
    if not _HEX64.fullmatch(fingerprint_hex) or not fp_dir.is_dir() or not _looks_like_cache(root):
        raise MlxkvError(f"{fp_dir} is not a fingerprint directory of an mlxkv disk cache; not removing it")
    shutil.rmtree(fp_dir)


def block_files(fp_dir: Path) -> Iterator[tuple[Path, int]]:
    """(path, size) of every block file under one fingerprint directory."""
    for shard in os.scandir(fp_dir):
        if not is_shard(shard):
            continue
        for entry in os.scandir(shard.path):
            if BLOCK_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                try:
                    yield Path(entry.path), entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue


def _fingerprint_dirs(root: Path) -> list[Path]:
    return sorted(
        Path(e.path) for e in os.scandir(root) if _HEX64.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
    )


def _blocks_in(path: Path) -> int:
    """Blocks a file holds, by its header (1 for a file whose header is unreadable)."""
    try:
        listed = run_file.read_metadata(path).get("block_hashes")
    except (OSError, CorruptBlockError):
        return 1
    return len(listed.split(",")) if isinstance(listed, str) and listed else 1


def _count_into(info: dict, root: Path) -> None:
    for fp_dir in _fingerprint_dirs(root):
        files = list(block_files(fp_dir))
        entry = {"files": len(files), "blocks": sum(_blocks_in(p) for p, _ in files),
                 "bytes": sum(size for _, size in files)}
        info["fingerprints"][fp_dir.name] = entry
        for key in ("files", "blocks", "bytes"):
            info[key] += entry[key]


def _looks_like_cache(root: Path) -> bool:
    marker = root / MARKER
    if marker.is_file():
        try:
            return "mlxkv" in marker.read_text(errors="replace")
        except OSError:
            return False
    entries = list(os.scandir(root))
    return bool(entries) and len(_fingerprint_dirs(root)) == len(entries)


def _remove_block_files(root: Path) -> Iterator[Path]:
    """Remove our files under `root`, yielding each block file removed."""
    for fp_dir in _fingerprint_dirs(root):
        for path, _ in list(block_files(fp_dir)):
            if unlink(path):
                yield path
        for path in fp_dir.glob("**/.*.tmp"):
            if _TEMP_NAME.fullmatch(path.name):
                unlink(path)
        for shard in os.scandir(fp_dir):
            if is_shard(shard):
                _rmdir_if_empty(Path(shard.path))
        _rmdir_if_empty(fp_dir)


def _rmdir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
