"""`mlxkv models list`: every model runnable here, by the name `--model` takes.

Sources: the built-in `demo` and `tiny`; the Hugging Face cache (model
directories by repo id, GGUF files by path); Ollama's and LM Studio's
models (model_sources.py); GGUF files mlxkv imported whose file is
elsewhere. A GGUF file is shown once, marked imported when mlxkv holds
its import. For each: family, size on disk, quantization, context, and
whether mlxkv serves it (or why not), read from config.json or the GGUF
header, never from the weights.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlxkv.errors import MlxkvError, first_line
from mlxkv.models import model_sources

log = logging.getLogger(__name__)

# llama.cpp's LLAMA_FTYPE names: what a GGUF file says it is as a whole (general.file_type).
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
              18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
              25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M",
              32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4"}


@dataclass
class ModelEntry:
    name: str  # what --model takes
    source: str
    path: Path  # a GGUF file or a model directory
    family: str = "?"
    size: int = 0
    quantization: str = "?"
    context: int | None = None
    served: str = "yes"  # or why not
    imports: list[Path] = field(default_factory=list)  # mlxkv's imports of a GGUF file
    repo: Path | None = None  # a Hugging Face cache entry's folder

    def as_json(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else [str(p) for p in v] if k == "imports" else v
                for k, v in asdict(self).items()}


def scan() -> list[ModelEntry]:
    from mlxkv.models.fetch import demo_gguf

    entries = []
    demo = demo_gguf()
    if demo:
        entries.append(_gguf_entry("demo", "built in", Path(demo)))
    entries.append(_tiny_entry())
    entries += _hugging_face_entries()
    entries += [_gguf_entry(name, "Ollama", blob) for name, blob in model_sources.ollama_models()]
    for name, path in model_sources.lmstudio_models():
        entries.append(_gguf_entry(name, "LM Studio", path) if path.is_file() else _dir_entry(name, "LM Studio", path))
    return entries + _attach_imports(entries)


def find(name: str) -> ModelEntry:
    """The entry `mlxkv models list` shows for `name` (a name or a path)."""
    if name.startswith(model_sources.OLLAMA):  # `ollama:llama3.2` is `ollama:llama3.2:latest`, as in Ollama
        name = name if ":" in name[len(model_sources.OLLAMA):] else f"{name}:{model_sources.OLLAMA_TAG}"
    entries = scan()
    for entry in entries:
        if entry.name == name:
            return entry
    given = Path(name).expanduser()
    for entry in entries:
        if given.exists() and given.resolve() in (entry.path.resolve(), *(p.resolve() for p in entry.imports)):
            return entry
    raise MlxkvError(f"no model named {name!r} here (`mlxkv models list` shows them)")


def _tiny_entry() -> ModelEntry:
    from mlxkv.system.paths import cache_root

    path = cache_root() / "models" / "tiny"
    return ModelEntry("tiny", "built in (random weights, for tests)", path, family="llama", quantization="float32",
                      context=4096, size=disk_size(path))


def _hugging_face_entries() -> list[ModelEntry]:
    from huggingface_hub import constants, scan_cache_dir

    try:
        repos = scan_cache_dir(constants.HF_HUB_CACHE).repos
    except Exception:  # no cache yet, or one huggingface_hub cannot read
        log.debug("no Hugging Face cache to list", exc_info=True)
        return []
    entries = []
    for repo in sorted(repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        snapshot = max(repo.revisions, key=lambda r: r.last_modified).snapshot_path
        if (snapshot / "config.json").is_file():
            entry = _dir_entry(repo.repo_id, "Hugging Face cache", snapshot)
            entry.size, entry.repo = repo.size_on_disk, repo.repo_path
            entries.append(entry)
        for gguf in sorted(snapshot.glob("*.gguf")):
            entries.append(_gguf_entry(str(gguf), "Hugging Face cache", gguf))
    return entries


def _gguf_entry(name: str, source: str, path: Path) -> ModelEntry:
    from mlxkv.models import gguf_affine, gguf_blocks
    from mlxkv.models.gguf_architectures import ARCHITECTURES
    from mlxkv.models.gguf_file import GGUFFile
    from mlxkv.models.gguf_tokenizer import KINDS

    entry = ModelEntry(name, source, path, size=disk_size(path))
    try:
        gguf = GGUFFile(path)
    except MlxkvError as e:
        entry.served = f"no: {e}"
        return entry
    meta = gguf.metadata
    arch = str(meta.get("general.architecture", "?"))
    types = Counter(info.type for info in gguf.tensors.values())
    entry.family, entry.context = arch, _int(meta.get(f"{arch}.context_length"))
    entry.quantization = FILE_TYPES.get(_int(meta.get("general.file_type")),
                                        gguf_blocks.type_name(types.most_common(1)[0][0]) if types else "?")
    unsupported = sorted({gguf_blocks.type_name(t) for t in types if not gguf_affine.supported(t)})
    if arch not in ARCHITECTURES:
        entry.served = f"no: architecture {arch}"
    elif meta.get("tokenizer.ggml.model") not in KINDS:
        entry.served = f"no: tokenizer {meta.get('tokenizer.ggml.model')}"
    elif unsupported:
        entry.served = f"no: {', '.join(unsupported)} tensors"
    return entry


def _dir_entry(name: str, source: str, path: Path) -> ModelEntry:
    entry = ModelEntry(name, source, path, size=disk_size(path))
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        entry.served = f"no: unreadable config.json ({first_line(e)})"
        return entry
    text = config.get("text_config") or {}
    entry.family = str(config.get("model_type", "?"))
    entry.context = _int(config.get("max_position_embeddings") or text.get("max_position_embeddings"))
    bits = (config.get("quantization") or {}).get("bits")
    entry.quantization = f"{bits}-bit" if bits else str(config.get("torch_dtype") or config.get("dtype") or "?")
    entry.served = family_served(config)
    return entry


def family_served(config: dict) -> str:
    """"yes" when mlxkv pages this family, else "no: <why>", from the config alone
    (the model's classes are built without weights: their arrays are never computed)."""
    from mlxkv.models import compat
    from mlxkv.models.loader import LoadedModel, check_supported

    family = config.get("model_type", "?")
    try:
        model_class, args_class = compat.model_classes(family)
        check_supported(LoadedModel(model_class(args_class.from_dict(config)), None, config, family))
    except ImportError:
        return f"no: mlx-lm has no {family} family"
    except MlxkvError as e:
        return f"no: {e}"
    except Exception as e:  # a config its family's classes cannot build
        log.debug("building %s from its config failed", family, exc_info=True)
        return f"no: {first_line(e)}"
    return "yes"


def _attach_imports(entries: list[ModelEntry]) -> list[ModelEntry]:
    """Mark the GGUF entries mlxkv imported; the imports of files listed nowhere else, as entries."""
    from mlxkv.models.gguf import models_dir, source_of

    by_path = {e.path.resolve(): e for e in entries if e.path.is_file()}
    extra = []
    for directory in sorted(models_dir().glob("gguf-*")) if models_dir().is_dir() else []:
        record = source_of(directory)
        if record is None:
            continue
        source = Path(record["source"])
        entry = by_path.get(source)
        if entry is None:
            if source.is_file():
                entry = by_path[source] = _gguf_entry(str(source), "GGUF file", source)
            else:
                entry = _dir_entry(str(directory), "imported (its GGUF file is gone)", directory)
            extra.append(entry)
        entry.imports.append(directory)
        if "imported" not in entry.source:
            entry.source += ", imported"
    return extra


def disk_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _int(value) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
