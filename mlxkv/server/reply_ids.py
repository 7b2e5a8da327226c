"""The ids of the replies the server generated, so a reply sent back as text
keeps them.

HTTP clients send the whole conversation every turn, with each earlier reply
as text. Tokenizing that text again need not give back the ids the model
generated (reply_tokens.py says why), and the prefix cache hits only up to
the first id that differs. The server remembers, in a bounded LRU, each
reply's ids under its text; a message that carries the same text gets them
back as its "tokens", and reply_tokens.py decides, with its own checks,
whether they can stand in for the text.

With a `path` (beside the SSD tier's blocks) the memory survives restarts:
without it, a restarted server would re-tokenize every earlier reply, and
the SSD tier's blocks past the first reply would never be hit. Each reply
appends one JSON line; loading keeps the newest `kept` and rewrites a log
grown past twice that. A torn last line (a crash mid-write) is skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

from mlxkv.system.private_files import make_private_dirs, open_private

log = logging.getLogger(__name__)

DEFAULT_KEPT = 4096


def _key(text: str) -> bytes:
    # A digest, not the text: a long reply is kept once, as its ids.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class ReplyIds:
    """At most `kept` replies' ids by their text, least recently used out first.

    Requests are handled on several threads, so the LRU takes a lock.
    """

    def __init__(self, kept: int = DEFAULT_KEPT, path: Path | None = None):
        self.kept = kept
        self._ids: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self._log = None
        if path is not None:
            try:
                self._log = self._open(Path(path))
            except OSError as e:  # the cache still works; only restarts re-tokenize
                log.warning("reply ids will not survive a restart: cannot use %s (%s)", path, e.strerror or e)

    def _open(self, path: Path):
        make_private_dirs(path.parent)
        lines, torn = 0, False
        if path.exists():
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    lines += 1
                    torn = not line.endswith("\n")
                    self._load_line(line)
        if lines > 2 * max(self.kept, 1):
            self._rewrite(path)
            torn = False
        f = open_private(path, "a")
        if torn:  # end the torn line, or the next entry would be glued to it
            f.write("\n")
        return f

    def _load_line(self, line: str) -> None:
        try:
            entry = json.loads(line)
            key, ids = bytes.fromhex(entry["k"]), tuple(int(t) for t in entry["ids"])
        except (ValueError, KeyError, TypeError):
            return  # a torn or foreign line
        self._ids[key] = ids
        self._ids.move_to_end(key)
        while len(self._ids) > self.kept:
            self._ids.popitem(last=False)

    def _rewrite(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open_private(tmp, "w") as f:
            for key, ids in self._ids.items():
                f.write(_line(key, ids))
        os.replace(tmp, path)

    def close(self) -> None:
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None

    def remember(self, text: str, ids: list[int]) -> None:
        if not text or not ids or self.kept < 1:
            return
        key = _key(text)
        with self._lock:
            self._ids[key] = tuple(ids)
            self._ids.move_to_end(key)
            while len(self._ids) > self.kept:
                self._ids.popitem(last=False)
            if self._log is not None:
                try:
                    self._log.write(_line(key, ids))
                    self._log.flush()
                except OSError as e:  # a full disk: keep serving, stop logging
                    log.warning("stopped logging reply ids: %s", e.strerror or e)
                    self._log = None

    def lookup(self, text: str) -> list[int] | None:
        if not text:
            return None
        key = _key(text)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
        return None if ids is None else list(ids)

    def attach(self, messages: list[dict]) -> list[dict]:
        """`messages` with each remembered assistant reply's ids as its "tokens"."""
        out = []
        for m in messages:
            if m.get("role") == "assistant" and "tokens" not in m and isinstance(m.get("content"), str):
                ids = self.lookup(m["content"])
                if ids is not None:
                    m = {**m, "tokens": ids}
            out.append(m)
        return out

    def __len__(self) -> int:
        return len(self._ids)


def _line(key: bytes, ids) -> str:
    return json.dumps({"k": key.hex(), "ids": list(ids)}, separators=(",", ":")) + "\n"
