"""Files only their owner may read: the KV cache, the chats, the log.

A person's conversations and what the model computed from them stay
private on a shared Mac: every directory made here is 0700 and every file
0600, whatever the umask says.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def make_private_dirs(path: Path) -> None:
    """mkdir -p, with every directory created here 0700 (umask notwithstanding)."""
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue  # another process made it first
        os.chmod(d, DIR_MODE)


def private_file(path: Path) -> Path:
    """Create `path` 0600 if it is missing; make an existing file of ours 0600.

    An existing file keeps working where its mode cannot be changed (a
    read-only disk): reading it is still allowed, and writing fails later
    with its own error.
    """
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
        return path
    except FileExistsError:
        pass
    if os.stat(path).st_mode & 0o077:
        try:
            os.chmod(path, FILE_MODE)
        except PermissionError:
            pass  # not ours to change
        except OSError as e:
            if e.errno != errno.EROFS:
                raise
    return path


def open_private(path: str | os.PathLike, mode: str = "a", encoding: str | None = "utf-8"):
    """`open(path, mode)`, creating the file 0600 (for handlers that reopen files)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, FILE_MODE), mode, encoding=encoding)
