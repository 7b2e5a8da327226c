"""The remote tier's address: `redis://[user:password@]host:port/db`, or `rediss://` for TLS.

Checked where the user hands it in (config.py's TierConfig), without importing the
client. A password never leaves this module but in the URL given to the
client: everything shown (stats, logs, `mlxkv cache info`) is `redacted`.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from mlxkv.errors import MlxkvError

SCHEMES = ("redis", "rediss")
DEFAULT_PORT = 6379
USAGE = "redis://[user:password@]host:port/db (rediss:// for TLS)"


def check_url(url: str) -> str:
    """The URL if the remote tier can use it, else MlxkvError saying what is wrong."""
    if not isinstance(url, str) or not url:
        raise MlxkvError(f"the remote tier needs a URL: {USAGE}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise MlxkvError(f"remote tier URL {redact(url)}: {e}; expected {USAGE}") from None
    if parts.scheme not in SCHEMES:
        raise MlxkvError(f"remote tier URL {redact(url)}: scheme {parts.scheme or '(none)'!r}; expected {USAGE}")
    if not parts.hostname:
        raise MlxkvError(f"remote tier URL {redact(url)} names no host; expected {USAGE}")
    if port == 0:
        raise MlxkvError(f"remote tier URL {redact(url)}: port 0; expected {USAGE}")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise MlxkvError(f"remote tier URL {redact(url)}: database {db!r} is not a number; expected {USAGE}")
    return url


def redact(url: str) -> str:
    """The URL with its password (if any) shown as ***."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.netloc.rsplit("@", 1)[1]
        return parts._replace(netloc=f"{user}:***@{host}").geturl()
    except ValueError:
        return "(an unreadable URL)"
