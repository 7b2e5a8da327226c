"""User-facing errors.

Every error a user can cause is an `MlxkvError` whose message fits on one
line and says what to do; the CLI prints it and exits with status 2.
"""


class MlxkvError(Exception):
    """A bad input or an impossible request, explained in one line."""


class PoolExhaustedError(MlxkvError):
    """Every block in the pool is referenced by a running sequence."""


class MlxkvWarning(RuntimeWarning):
    """Something the user should know that does not stop the work (a cache
    tier left off, a slow BLAS), in one line that starts with "mlxkv: ".

    The CLI prints these as one line; the chat app shows them on screen,
    where a line on stderr would be lost under the UI.
    """


def warning_text(message) -> str:
    """An MlxkvWarning's message without its "mlxkv: " (the CLI and the app add their own)."""
    return str(message).removeprefix("mlxkv: ")


def error_line(error: BaseException, log) -> str:
    """The one line a user sees for `error`. Anything but an MlxkvError is a
    bug or a failure of something below us, so its traceback goes to `log`."""
    if isinstance(error, MlxkvError):
        return str(error)
    log.error("unexpected %s", type(error).__name__, exc_info=error)
    return f"{type(error).__name__}: {error}"


def first_line(error: BaseException) -> str:
    """An exception's message cut to its first line (a third party's may run to many), or its type."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
