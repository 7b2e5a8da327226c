"""Which served model a request's `model` names: exact names, aliases, a default.

Agents send names of their own (Claude Code: `claude-sonnet-...` for the
main turns, `claude-haiku-...` for titles and quick checks), so shell-style
alias patterns map them onto the models served. Exact names win over
patterns, and the first pattern that matches wins, so a narrow pattern goes
before a wide one (`claude-haiku-*` before `claude-*`).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from mlxkv.errors import MlxkvError

_WILDCARDS = set("*?[")


class ModelNames:
    def __init__(self, names: list[str], aliases: list[tuple[str, str]] = (), default: str | None = None):
        self.names = list(names)
        for pattern, target in aliases:
            self._check(target, f"--alias {pattern}={target}")
        if default is not None:
            self._check(default, f"--default-model {default}")
        self.exact = {p: t for p, t in reversed(aliases) if not _WILDCARDS & set(p)}  # the first one given wins
        self.patterns = [(p, t) for p, t in aliases if _WILDCARDS & set(p)]
        self.default = default

    def _check(self, target: str, where: str) -> None:
        if target not in self.names:
            raise MlxkvError(f"{where}: no model is named {target!r} (models: {', '.join(self.names)})")

    def resolve(self, requested: str) -> str | None:
        """The served model's name for `requested`, or None when nothing matches and there is no default."""
        if requested in self.names:
            return requested
        if requested in self.exact:
            return self.exact[requested]
        for pattern, target in self.patterns:
            if fnmatchcase(requested, pattern):
                return target
        return self.default

    def unknown(self, requested: str) -> str:
        """The 404's message: what was asked, and what exists."""
        served = ", ".join(repr(n) for n in self.names)
        if self.default is not None:  # only /v1/models/{id} names no model then
            return f"no model {requested!r} here; this server has {served} (and answers other names with " \
                   f"{self.default!r})"
        return f"no model {requested!r} here; this server has {served} (add --alias PATTERN=NAME or " \
               "--default-model NAME to serve other names)"
