"""User-facing errors.

Every error a user can cause is an `MlxkvError` whose message fits on one
line and says what to do; the CLI prints it and exits with status 2.
"""


class MlxkvError(Exception):
    """A bad input or an impossible request, explained in one line."""


class PoolExhaustedError(MlxkvError):
    """Every block in the pool is referenced by a running sequence."""
