"""Where other tools keep the models people already have, and the names mlxkv gives them.

- Ollama: `$OLLAMA_MODELS` or `~/.ollama/models`. A model is a manifest,
  `manifests/<host>/<namespace>/<model>/<tag>` (JSON, Docker's image manifest),
  whose layer of media type `application/vnd.ollama.image.model` names the
  GGUF blob by digest: `blobs/sha256-<hex>`. mlxkv calls it `ollama:` and the
  name `ollama list` shows (`llama3.2:3b`; `ollama:llama3.2` means `:latest`).
- LM Studio: `~/.lmstudio/models/<publisher>/<model>/` (older versions:
  `~/.cache/lm-studio/models/`), holding GGUF files, or an MLX model
  directory. mlxkv calls them `lmstudio:<publisher>/<model>/<file>.gguf` and
  `lmstudio:<publisher>/<model>`.
Nothing here reads more than a directory listing and a manifest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from mlxkv.errors import MlxkvError

OLLAMA, LMSTUDIO = "ollama:", "lmstudio:"
OLLAMA_HOST, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


def home() -> Path:
    return Path(os.path.expanduser("~"))


def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or home() / ".ollama" / "models")


def lmstudio_roots() -> list[Path]:
    return [home() / ".lmstudio" / "models", home() / ".cache" / "lm-studio" / "models"]


def is_source_name(name: str) -> bool:
    return name.startswith((OLLAMA, LMSTUDIO))


def locate(name: str) -> Path:
    """The GGUF file or model directory an `ollama:` or `lmstudio:` name stands for."""
    path = _ollama_blob(name[len(OLLAMA):]) if name.startswith(OLLAMA) else _lmstudio_path(name[len(LMSTUDIO):])
    if path is None or not path.exists():
        raise MlxkvError(f"model not found: {name!r} (`mlxkv models list` shows the models here)")
    return path


# -- Ollama ------------------------------------------------------------------


def _ollama_parts(spec: str) -> tuple[str, str, str, str]:
    """`[host/][namespace/]model[:tag]` -> host, namespace, model, tag (Ollama's defaults filled in)."""
    path, _, tag = spec.partition(":")
    parts = path.split("/")
    if not all(parts) or len(parts) > 3:
        raise MlxkvError(f"not an Ollama model name: {spec!r}")
    parts = [OLLAMA_HOST, OLLAMA_NAMESPACE][: 3 - len(parts)] + parts
    return parts[0], parts[1], parts[2], tag or OLLAMA_TAG


def ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    """The name as `ollama list` shows it."""
    if host == OLLAMA_HOST:
        return f"{model}:{tag}" if namespace == OLLAMA_NAMESPACE else f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def _ollama_blob(spec: str) -> Path | None:
    host, namespace, model, tag = _ollama_parts(spec)
    return manifest_blob(ollama_root() / "manifests" / host / namespace / model / tag)


def manifest_blob(manifest: Path) -> Path | None:
    """The GGUF blob an Ollama manifest names (None: no model layer, or an unreadable manifest)."""
    try:
        layers = json.loads(manifest.read_text()).get("layers", [])
    except (OSError, ValueError, AttributeError):
        return None
    for layer in layers:
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER:
            digest = str(layer.get("digest", ""))
            for blob in (digest.replace(":", "-", 1), digest):  # newer and older blob names
                path = ollama_root() / "blobs" / blob
                if path.is_file():
                    return path
    return None


def ollama_models() -> Iterator[tuple[str, Path]]:
    """(mlxkv name, GGUF blob) of every Ollama model here."""
    manifests = ollama_root() / "manifests"
    for manifest in sorted(manifests.glob("*/*/*/*")) if manifests.is_dir() else []:
        blob = manifest_blob(manifest) if manifest.is_file() else None
        if blob is not None:
            host, namespace, model, tag = manifest.relative_to(manifests).parts
            yield OLLAMA + ollama_name(host, namespace, model, tag), blob


# -- LM Studio -----------------------------------------------------------------


def _lmstudio_path(rest: str) -> Path | None:
    if ".." in Path(rest).parts or rest.startswith("/"):
        return None
    for root in lmstudio_roots():
        if (root / rest).exists():
            return root / rest
    return None


def lmstudio_models() -> Iterator[tuple[str, Path]]:
    """(mlxkv name, GGUF file or MLX model directory) of every LM Studio model here."""
    seen = set()
    for root in lmstudio_roots():
        for folder in sorted(root.glob("*/*")) if root.is_dir() else []:
            rest = folder.relative_to(root).as_posix()
            if rest in seen or not folder.is_dir():
                continue
            seen.add(rest)
            if (folder / "config.json").is_file():
                yield LMSTUDIO + rest, folder
                continue
            for gguf in sorted(folder.glob("*.gguf")):
                if not gguf.name.startswith("mmproj"):  # a vision projector, not a model
                    yield f"{LMSTUDIO}{rest}/{gguf.name}", gguf
