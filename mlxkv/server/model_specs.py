"""What `mlxkv serve` is asked to serve: models by name, their options, sizes and durations.

Parsed here, at the boundary, into plain values with one-line errors: the
registry and the router below never see a flag's text.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

from mlxkv.errors import MlxkvError
from mlxkv.kv_format import KVFormat

# A name is what a client sends in "model": no "/" (a source's path or Hugging Face id has one).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]*")
NEVER = math.inf  # a keep-alive of -1: the model stays loaded
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}
_SIZES = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40}
OPTIONS = ("source", "kv_bits", "speculative", "draft_model", "pin", "keep_alive", "context")


@dataclass(frozen=True)
class ModelSpec:
    """One served model. `keep_alive_s` None: the server's --keep-alive; NEVER: never unloaded
    for idleness. `context`: the tokens its KV pool holds (None: sized as usual). `kv_format`:
    its pool's (the file's `kv_bits`, in the server's --kv-group-size; None: the server's)."""

    name: str
    source: str
    pin: bool = False
    keep_alive_s: float | None = None
    kv_format: KVFormat | None = None
    speculative: str | None = None
    draft_model: str | None = None
    context: int | None = None

    def __post_init__(self):
        if not self.name or self.name != self.name.strip():
            raise MlxkvError(f"model name {self.name!r}: it must be non-empty, without spaces around it")
        if not self.source:
            raise MlxkvError(f"model {self.name!r}: its source is empty")
        if self.kv_format is not None and not isinstance(self.kv_format, KVFormat):
            raise MlxkvError(f"model {self.name!r}: kv_format must be a KVFormat, got {self.kv_format!r}")
        if self.speculative not in (None, "lookup", "draft"):
            raise MlxkvError(f"model {self.name!r}: speculative must be \"lookup\" or \"draft\", "
                             f"got {self.speculative!r}")
        if self.context is not None and (not isinstance(self.context, int) or self.context < 1):
            raise MlxkvError(f"model {self.name!r}: context must be a whole number of tokens, got {self.context!r}")
        if self.keep_alive_s is not None and self.keep_alive_s < 0:
            raise MlxkvError(f"model {self.name!r}: keep_alive must be 0 or more, or -1 for never")


def model_flag(text: str, short_name) -> ModelSpec:
    """`--model [NAME=]SOURCE`: NAME defaults to the source's short name (`short_name(source)`)."""
    name, sep, source = text.partition("=")
    if sep and _NAME.fullmatch(name):
        return ModelSpec(name, source)
    return ModelSpec(short_name(text), text)


def alias_flag(text: str) -> tuple[str, str]:
    """`--alias PATTERN=NAME`."""
    pattern, sep, name = text.rpartition("=")
    if not sep or not pattern or not name:
        raise MlxkvError(f"--alias {text!r}: expected PATTERN=NAME, e.g. 'claude-haiku-*=small'")
    return pattern, name


def duration(text: str | int | float) -> float:
    """Seconds from "300", "90s", "5m", "1h"; "0" is at once and "-1" never (NEVER)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
        if match is None:
            raise MlxkvError(f"expected a duration such as 30s, 5m, 1h, 0 or -1, got {text!r}")
        value = float(match.group(1)) * _UNITS[match.group(2)]
    if value == -1:
        return NEVER
    if value < 0 or not math.isfinite(value):
        raise MlxkvError(f"a duration must be 0 or more, or -1 for never, got {text!r}")
    return value


def size(text: str | int) -> int:
    """Bytes from "24GB", "512m", "1.5g" or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?b?)\s*", str(text).lower())
    if match is None or float(match.group(1)) <= 0:
        raise MlxkvError(f"expected a size such as 512MB or 24GB, got {text!r}")
    return int(float(match.group(1)) * _SIZES[match.group(2)])


def from_table(name: str, table: dict) -> ModelSpec:
    """A model's table in the --models file: its source and its options."""
    unknown = sorted(set(table) - set(OPTIONS))
    if unknown:
        raise MlxkvError(f"model {name!r}: unknown option {unknown[0]!r} (known: {', '.join(OPTIONS)})")
    if "source" not in table:
        raise MlxkvError(f"model {name!r}: it needs a source (a path, a GGUF, a Hugging Face id, demo or tiny)")
    fields = {k: v for k, v in table.items() if k not in ("keep_alive", "kv_bits")}
    if "keep_alive" in table:
        fields["keep_alive_s"] = duration(table["keep_alive"])
    if "kv_bits" in table:
        fields["kv_format"] = _kv_format(name, table["kv_bits"])
    for key, kind in (("pin", bool), ("source", str)):
        if key in fields and not isinstance(fields[key], kind):
            raise MlxkvError(f"model {name!r}: {key} must be a {kind.__name__}, got {fields[key]!r}")
    return ModelSpec(name, **fields)


def _kv_format(name: str, bits) -> KVFormat:
    """The file's `kv_bits` as the pool format the model is served with (its group size: the server's)."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise MlxkvError(f"model {name!r}: kv_bits must be 4 or 8, got {bits!r}")
    try:
        return KVFormat(bits)
    except MlxkvError:
        raise MlxkvError(f"model {name!r}: kv_bits must be 4 or 8, got {bits!r}") from None


def weights_estimate(source: str) -> int:
    """Bytes of a model's weight files, before it is loaded: a directory's safetensors (or
    npz), a GGUF file; 0 when the source is not a local path (it has not been fetched)."""
    path = Path(source).expanduser()
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(f.stat().st_size for pattern in ("*.safetensors", "*.npz", "*.gguf") for f in path.glob(pattern))
    return 0


def with_keep_alive(spec: ModelSpec, default_s: float) -> ModelSpec:
    return spec if spec.keep_alive_s is not None else dataclasses.replace(spec, keep_alive_s=default_s)


def unique(specs: list[ModelSpec]) -> list[ModelSpec]:
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise MlxkvError(f"two models are named {spec.name!r}; give one another name: --model NAME=SOURCE")
        seen.add(spec.name)
    return specs
