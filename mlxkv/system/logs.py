"""Where mlxkv's log records go.

A library logs and leaves the choice to the program: `import mlxkv` adds
only a NullHandler, so nothing is printed unless the program asks. The CLI
sends warnings and errors to stderr as one line each, like its errors; the
chat app owns the terminal, so it writes everything to a private file in
its data dir instead, tracebacks included.

`MLXKV_LOG` sets the level (debug, info, warning, error); at debug the
CLI's lines carry tracebacks too.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from pathlib import Path

from mlxkv.system.private_files import make_private_dirs, open_private, private_file

ROOT = "mlxkv"
LEVEL_ENV = "MLXKV_LOG"
LOG_FILE_BYTES = 4 << 20  # a file this big is rotated, keeping one old file


def level_from_env(default: int) -> int:
    """The level MLXKV_LOG names, or `default` when unset or unknown."""
    name = os.environ.get(LEVEL_ENV, "").strip().upper()
    level = logging.getLevelName(name) if name else None
    return level if isinstance(level, int) else default


class OneLineFormatter(logging.Formatter):
    """`mlxkv: warning: ...`, as the CLI prints its errors; no traceback
    unless the logger is at debug level."""

    def __init__(self, tracebacks: bool):
        super().__init__("mlxkv: %(levelname)s: %(message)s")
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        record.levelname = record.levelname.lower()
        if self.tracebacks:
            return super().format(record)
        return self.formatMessage(self._with_message(record))

    @staticmethod
    def _with_message(record: logging.LogRecord) -> logging.LogRecord:
        record.message = record.getMessage()
        return record


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (a test may have swapped it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def log_to_stderr(level: int | None = None) -> logging.Handler:
    """One line per record on stderr, at WARNING (or MLXKV_LOG) and above."""
    level = level if level is not None else level_from_env(logging.WARNING)
    handler = _StderrHandler()
    handler.setFormatter(OneLineFormatter(tracebacks=level <= logging.DEBUG))
    return _attach(handler, level)


def log_to_file(path: Path, level: int | None = None) -> logging.Handler:
    """Every record at INFO (or MLXKV_LOG) and above, with tracebacks, in a
    file only its owner can read (mode 0600 in a 0700 directory)."""
    level = level if level is not None else level_from_env(logging.INFO)
    make_private_dirs(path.parent)
    private_file(path)
    handler = _PrivateRotatingFileHandler(path, maxBytes=LOG_FILE_BYTES, backupCount=1, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s"))
    return _attach(handler, level)


class _PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A rotated-in file is created 0600 too."""

    def _open(self):
        return open_private(self.baseFilename, self.mode, self.encoding)


def _attach(handler: logging.Handler, level: int) -> logging.Handler:
    """Add the handler, replacing one of the same kind added before (main() may run twice)."""
    handler.setLevel(level)
    root = logging.getLogger(ROOT)
    for old in [h for h in root.handlers if type(h) is type(handler)]:
        detach(old)
    root.addHandler(handler)
    root.setLevel(min(level, root.level or logging.CRITICAL))
    return handler


def detach(handler: logging.Handler) -> None:
    logging.getLogger(ROOT).removeHandler(handler)
    handler.close()
