"""The remote tier's connection to its server: two clients, one state.

Reads run on the engine thread with short timeouts (`timeout_s`, tens of
milliseconds per socket operation); writes run on the tier's own thread
with longer ones (a SET of a few MB). Both are redis-py connection pools
without the client's own retries: a failed call is a miss or a dropped
write, never a wait.

Every call goes through `read` or `write`, one round trip each (a command
or a pipeline), which turn the client's errors into the tier's health
(health.py) and return None:

- connection refused or reset, TIMEOUTS_TO_DOWN reads in a row that time
  out (one alone is a miss): down; the writer thread's `probe` tries again
  after a backoff that doubles up to BACKOFF_MAX_S;
- a wrong password: down, and the reason says so;
- an ACL refusal: down for reads, read-only for writes;
- `OOM command not allowed` (maxmemory with noeviction): dropping writes;
- a read-only replica: read-only.

While down, calls return None at once, without touching the network;
while writes are refused, writes wait out the same backoff.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mlxkv.config import DEFAULT_REMOTE_TIER_TIMEOUT_MS
from mlxkv.connectors.health import DOWN, DROPPING, OK, READ_ONLY, TierHealth
from mlxkv.connectors.remote.url import redact
from mlxkv.errors import first_line

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = DEFAULT_REMOTE_TIER_TIMEOUT_MS / 1000
WRITE_TIMEOUT_S = 2.0  # a SET's whole send: a few MB on a slow network
PROBE_TIMEOUT_S = 1.0
BACKOFF_MIN_S = 0.25
BACKOFF_MAX_S = 8.0
# Reads in a row that time out before the tier is marked down: one slow
# moment is a miss, a server that stopped answering is down (each of those
# reads waited its timeout, so a hung server costs a few lookups that much).
TIMEOUTS_TO_DOWN = 3


def classify(error: Exception, write: bool) -> tuple[str, str]:
    """The state a failed call leaves the tier in, and why, in words a user acts on."""
    from redis import exceptions as rx

    text = first_line(error)
    if isinstance(error, rx.AuthenticationError) or text.startswith(("WRONGPASS", "NOAUTH", "invalid password",
                                                                      "invalid username-password")):
        return DOWN, f"authentication failed (wrong user or password?): {text}"
    if isinstance(error, rx.NoPermissionError) or text.startswith("NOPERM"):
        return (READ_ONLY if write else DOWN), f"refused by the server's ACL: {text}"
    if isinstance(error, rx.OutOfMemoryError) or text.startswith("OOM"):
        return DROPPING, (f"the server is full ({text}); give it maxmemory-policy allkeys-lru, "
                          "or more maxmemory")
    if isinstance(error, rx.ReadOnlyError):
        return READ_ONLY, f"the server is a read-only replica: {text}"
    if isinstance(error, (rx.ConnectionError, rx.TimeoutError, OSError)):
        return DOWN, text
    return (DROPPING if write else DOWN), text


class RemoteLink:
    def __init__(self, url: str, health: TierHealth, timeout_s: float = DEFAULT_TIMEOUT_S,
                 write_timeout_s: float = WRITE_TIMEOUT_S, clock=time.monotonic):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.where = redact(url)
        self.health = health
        self._clock = clock
        options = dict(retry=Retry(NoBackoff(), 0), socket_keepalive=True)
        self.reads = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                          **options)
        self.writes = redis.Redis.from_url(url, socket_timeout=write_timeout_s,
                                           socket_connect_timeout=PROBE_TIMEOUT_S, **options)
        self.backoff_min, self.backoff_max = BACKOFF_MIN_S, BACKOFF_MAX_S
        self._backoff = self.backoff_min
        self._retry_at = 0.0  # down: when the writer thread probes; writes refused: when writes try again
        self.round_trips = 0  # calls made: each is one request/reply exchange
        self.timeouts = 0  # reads that waited their whole timeout (each a miss)
        self._late_reads = 0  # such reads in a row

    # -- state -----------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self.health.state != DOWN

    @property
    def writable(self) -> bool:
        return self.health.state == OK or (self.up and self._clock() >= self._retry_at)

    @property
    def probe_due(self) -> bool:
        return not self.up and self._clock() >= self._retry_at

    def seconds_to_retry(self) -> float:
        return max(0.0, self._retry_at - self._clock())

    # -- calls -----------------------------------------------------------------

    def open(self) -> str | None:
        """Ping once at start (with the probe's longer timeouts): None if the server answers, else why
        not. The tier then starts in that state without a log line: its opener warns once."""
        from redis.exceptions import RedisError

        self.round_trips += 1
        try:
            self.writes.ping()
        except (RedisError, OSError) as e:
            state, reason = classify(e, write=False)
            self.health.start(state, f"{reason} ({self.where})")
            self._later()
            return self.health.reason
        return None

    def read(self, fn: Callable):
        """fn(client) on the read client: its result, or None (down, or it failed)."""
        if not self.up:
            return None
        return self._call(fn, self.reads, write=False)

    def fetch(self, fn: Callable):
        """fn(client) on the write client (the tier's thread: longer timeouts), as a read."""
        if not self.up:
            return None
        return self._call(fn, self.writes, write=False)

    def write(self, fn: Callable):
        """fn(client) on the write client: its result, or None (refused, down, or it failed)."""
        if not self.writable:
            return None
        result = self._call(fn, self.writes, write=True)
        if result is not None:
            self._backoff = self.backoff_min
            self.health.fine()
        return result

    def probe(self) -> bool:
        """Down: is the server back? (The writer thread asks, never the engine thread.)"""
        try:
            self.round_trips += 1
            self.writes.ping()
        except Exception as e:  # noqa: BLE001 - every failure of a probe means: still down
            self._later()
            log.debug("remote tier probe failed: %s", first_line(e))
            return False
        self._backoff = self.backoff_min
        self.health.fine(now=True)
        return True

    def _call(self, fn: Callable, client, write: bool):
        from redis.exceptions import RedisError, TimeoutError

        self.round_trips += 1
        try:
            result = fn(client)
        except (RedisError, OSError) as e:
            if isinstance(e, TimeoutError) and not write and self._late_reads < TIMEOUTS_TO_DOWN - 1:
                self._late_reads += 1  # a slow moment (Wi-Fi, a busy server): a miss, not yet down
                self.timeouts += 1
                return None
            self.timeouts += isinstance(e, TimeoutError)
            state, reason = classify(e, write)
            self.health.trouble(state, f"{reason} ({self.where})")
            self._later()
            return None
        self._late_reads = 0
        return result

    def _later(self) -> None:
        self._retry_at = self._clock() + self._backoff
        self._backoff = min(self._backoff * 2, self.backoff_max)

    def close(self) -> None:
        for client in (self.reads, self.writes):
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing sockets of a server that is gone
                log.debug("closing a remote tier client failed", exc_info=True)
