"""Errors as each API writes them: one exception, two JSON shapes.

Every bad request gets a 4xx and the API's own error JSON with a one-line
message; only a failure of ours is a 500, and its traceback goes to the log.
"""

from __future__ import annotations

# status -> (OpenAI's error type, Anthropic's)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def openai_body(self) -> dict:
        kind = _TYPES.get(self.status, _TYPES[500 if self.status >= 500 else 400])[0]
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}

    def anthropic_body(self) -> dict:
        kind = _TYPES.get(self.status, _TYPES[500 if self.status >= 500 else 400])[1]
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def is_anthropic_path(path: str) -> bool:
    """Anthropic's endpoints answer in its error shape; everything else in OpenAI's."""
    return path.startswith("/v1/messages")


def validation_message(error) -> str:
    """A pydantic ValidationError as one line: the first problem, with its field's path."""
    first = error.errors()[0]
    # A union's member types show up in the path ("content.str"); the field's path is what a user needs.
    where = ".".join(str(p) for p in first.get("loc", ()) if isinstance(p, int) or not _is_type_name(p))
    text = first.get("msg", "invalid value")
    return f"{where}: {text}" if where else text


def _is_type_name(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "none", "dict", "list") or part[:1].isupper()
