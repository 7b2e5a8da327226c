"""A tier's health: its state, why, and one WARNING line whenever it changes.

- ok: reads and writes work;
- read-only: reads work, writes are refused (a read-only disk, an ACL
  that allows reads only, a replica);
- down: neither; the tier is tried again with backoff (a server lost, a
  wrong password);
- dropping-writes: reads work, writes are being lost (a full disk or
  server, out of inodes, a queue the disk or server cannot keep up with).

Set from any thread (the engine thread, a tier's writer thread). Whoever
opens a tier says its state at start once, as an MlxkvWarning (the CLI
prints it, the chat app shows it, the engine thread logs it). Each change
after that is one WARNING log line, which the CLI and `mlxkv serve` print
on stderr and the chat app writes to its log. A tier that dropped writes
is ok again only after `hold_s` without trouble, so a disk hovering at its
free-space floor says so once, not on every write.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

OK = "ok"
READ_ONLY = "read-only"
DOWN = "down"
DROPPING = "dropping-writes"
STATES = (OK, READ_ONLY, DOWN, DROPPING)
HOLD_S = 5.0


class TierHealth:
    def __init__(self, label: str, *, hold_s: float = HOLD_S, clock=time.monotonic):
        self.label = label  # "SSD tier", "remote tier": how log lines name it
        self.hold_s = hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self.state = OK
        self.reason: str | None = None
        self.changes = 0  # state changes since start
        self._last_trouble = float("-inf")

    def start(self, state: str, reason: str | None) -> None:
        """The state the tier opened in; its opener warns (see the module's docstring)."""
        with self._lock:
            self.state, self.reason = state, reason
            if state != OK:
                self._last_trouble = self._clock()

    def trouble(self, state: str, reason: str) -> None:
        """Something failed: the tier is now `state`, because `reason`. One line if that is news."""
        assert state in STATES and state != OK
        with self._lock:
            self._last_trouble = self._clock()
            if state == self.state:
                return  # said already; the first reason stands until it recovers
            was = self.state
            self.state, self.reason = state, reason
            self.changes += 1
        log.warning("%s %s: %s%s", self.label, _describe(state), reason, "" if was == OK else f" (was {was})")

    def fine(self, *, now: bool = False) -> None:
        """Something worked. Back to ok if the trouble is `hold_s` old (or `now`: a probe answered)."""
        with self._lock:
            if self.state == OK or (not now and self._clock() - self._last_trouble < self.hold_s):
                return
            was, why = self.state, self.reason
            self.state, self.reason = OK, None
            self.changes += 1
        log.warning("%s ok again (was %s: %s)", self.label, was, why)

    @property
    def ok(self) -> bool:
        return self.state == OK

    def as_dict(self) -> dict:
        with self._lock:
            return {"state": self.state, "reason": self.reason}


def _describe(state: str) -> str:
    return {DROPPING: "dropping writes"}.get(state, state)
