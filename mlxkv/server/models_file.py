"""`mlxkv serve --models FILE`: the models, their options and aliases in one TOML file.

    default_model = "coder"        # optional; so are max_loaded, memory_budget, keep_alive
    max_loaded = 2

    [models.coder]
    source = "~/models/Qwen3-Coder-30B-A3B-4bit"
    kv_bits = 8
    pin = true

    [models.small]
    source = "mlx-community/Qwen3-1.7B-4bit"
    keep_alive = "1m"

    [aliases]                      # in order: the first pattern that matches wins
    "claude-haiku-*" = "small"
    "claude-*" = "coder"
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from mlxkv.errors import MlxkvError
from mlxkv.server.model_specs import ModelSpec, duration, from_table, size

_TOP = ("models", "aliases", "default_model", "max_loaded", "memory_budget", "keep_alive")


@dataclass
class ModelsFile:
    specs: list[ModelSpec] = field(default_factory=list)
    aliases: list[tuple[str, str]] = field(default_factory=list)
    default_model: str | None = None
    max_loaded: int | None = None
    memory_budget: int | None = None
    keep_alive_s: float | None = None


def read_models_file(path: str) -> ModelsFile:
    where = Path(path).expanduser()
    try:
        data = tomllib.loads(where.read_text())
    except OSError as e:
        raise MlxkvError(f"--models {path}: cannot read it: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise MlxkvError(f"--models {path}: not valid TOML: {e}") from None
    try:
        return _parse(data)
    except MlxkvError as e:
        raise MlxkvError(f"--models {path}: {e}") from None


def _parse(data: dict) -> ModelsFile:
    unknown = sorted(set(data) - set(_TOP))
    if unknown:
        raise MlxkvError(f"unknown key {unknown[0]!r} (known: {', '.join(_TOP)})")
    models, aliases = data.get("models", {}), data.get("aliases", {})
    if not isinstance(models, dict) or not all(isinstance(t, dict) for t in models.values()):
        raise MlxkvError("models: expected tables, [models.NAME] with a source")
    if not isinstance(aliases, dict) or not all(isinstance(t, str) for t in aliases.values()):
        raise MlxkvError('aliases: expected "PATTERN" = "NAME" lines')
    max_loaded = data.get("max_loaded")
    if max_loaded is not None and (not isinstance(max_loaded, int) or max_loaded < 1):
        raise MlxkvError(f"max_loaded must be a whole number, at least 1, got {max_loaded!r}")
    return ModelsFile(
        specs=[from_table(name, table) for name, table in models.items()],
        aliases=list(aliases.items()),
        default_model=data.get("default_model"),
        max_loaded=max_loaded,
        memory_budget=None if "memory_budget" not in data else size(data["memory_budget"]),
        keep_alive_s=None if "keep_alive" not in data else duration(data["keep_alive"]),
    )
