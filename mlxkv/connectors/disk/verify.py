"""Checking stored bytes without a model: `mlxkv cache info --verify`, on the SSD tier's files or the remote tier's values.

Without the model there is no FileSpec to check a file against, so only
what the file says of itself is checked: that it parses, names a known
checksum, and its tensors' bytes have that checksum. That is what a torn
write or a flipped bit breaks; a file of another model or version is
judged when a model reads it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mlxkv.connectors.disk import run_file, state_file
from mlxkv.connectors.disk.run_file import CHECKSUMS, CorruptBlockError

CORRUPT_LISTED = 20  # corrupt files (or keys) named in a report; the rest are counted


def problem(data: np.ndarray) -> str | None:
    """Why these bytes are not an intact block run or checkpoint file, or None if they are."""
    try:
        meta, tensors = run_file.parse(data)
    except CorruptBlockError as e:
        return str(e)
    algo = meta.get("checksum_algo")
    if algo not in CHECKSUMS:
        return f"checksum_algo {algo!r}"
    if meta.get("format") == state_file.STATE_FORMAT:
        found = state_file.tensors_checksum(tensors, algo)
    elif set(tensors) == {"keys", "values"}:
        found = run_file.checksum(tensors["keys"], tensors["values"], algo)
    else:
        return f"tensors {sorted(tensors)}"
    return None if found == meta.get("checksum") else "checksum mismatch"


def file_problem(path: Path) -> str | None:
    try:
        return problem(np.fromfile(path, np.uint8))
    except OSError as e:
        return f"unreadable: {e.strerror or e}"


def verify_files(paths: list[Path]) -> dict:
    """{"verified", "corrupt", "corrupt_files"} for these files."""
    corrupt = [(p, why) for p in paths if (why := file_problem(p)) is not None]
    return {"verified": len(paths), "corrupt": len(corrupt),
            "corrupt_files": [f"{os.fspath(p)}: {why}" for p, why in corrupt[:CORRUPT_LISTED]]}
