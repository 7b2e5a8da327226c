"""GGUF files (LM Studio's, Ollama's, llama.cpp's) as mlx-lm model directories.

A file is read by gguf_file.py (header parsed, tensors memory-mapped), its
tensors renamed and its hyper-parameters mapped to an mlx-lm family by
gguf_architectures.py, its block quantizations turned into MLX's affine
quantization by gguf_affine.py (per tensor, keeping the file's
precision), and its tokenizer written by gguf_tokenizer.py. The result is
kept in the mlxkv cache (`models/gguf-<name>-<key>`), imported once per
file, keyed by its path, size and modification time; `mlxkv-gguf.json`
beside the weights names the file it came from (the catalog reads it).

Scales and biases are float32 here (float16 in the file): MLX's CPU
back-end ran the float16 quantized matmul ~25x slower; on a GPU the cost
is a few percent of a 4-bit model's bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from mlxkv.errors import MlxkvError
from mlxkv.system.paths import cache_root

FORMAT = 2  # bump when the written directory changes (2: K-quants, families, shards, source record)
SOURCE_RECORD = "mlxkv-gguf.json"
SHARD_BYTES = 1 << 30  # weights written a shard at a time: an import never holds the whole model
EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def models_dir() -> Path:
    return cache_root() / "models"


def import_dir(source: Path, st: os.stat_result) -> Path:
    key = hashlib.sha256(f"{FORMAT}:{source.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return models_dir() / f"gguf-{source.stem}-{key}"


def imported_model(path: str | os.PathLike) -> Path:
    """The mlx-lm directory of GGUF file `path`, importing it on first use."""
    source = Path(path).expanduser()
    try:
        st = source.stat()
    except OSError as e:
        raise MlxkvError(f"cannot read GGUF file {str(path)!r}: {e.strerror}") from None
    target = import_dir(source, st)
    if (target / "config.json").exists():
        return target
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write_model(source, staging)
        _record_source(staging, source, st)
        staging.rename(target)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if not (isinstance(e, OSError) and (target / "config.json").exists()):  # else: another process won
            raise
    return target


def write_model(source: Path, directory: Path) -> None:
    try:
        _write_model(source, directory)
    except MlxkvError as e:
        raise MlxkvError(f"cannot import {source.name}: {e}") from None


def _write_model(source: Path, directory: Path) -> None:
    from mlxkv.models.gguf_architectures import architecture, model_config
    from mlxkv.models.gguf_file import GGUFFile
    from mlxkv.models.gguf_tokenizer import write_tokenizer
    from mlxkv.models.gguf_weights import convert_weights

    gguf = GGUFFile(source)
    meta = gguf.metadata
    arch_name = str(meta.get("general.architecture", "unknown"))
    arch = architecture(arch_name)
    directory.mkdir(parents=True)
    context = int(meta.get(f"{arch_name}.context_length", 4096))
    write_tokenizer(meta, directory, context)  # before the weights: a refusal should come at once
    weights = convert_weights(gguf, arch, directory, SHARD_BYTES)
    config = model_config(meta, arch_name, weights.config_tensors, weights.vocab_size)
    config["tie_word_embeddings"] = not weights.has_output
    config["bos_token_id"] = _int(meta.get("tokenizer.ggml.bos_token_id"))
    config["eos_token_id"] = list(dict.fromkeys(int(meta[k]) for k in EOS_KEYS if meta.get(k) is not None))
    if weights.quantization:
        config["quantization"] = weights.quantization
    (directory / "config.json").write_text(json.dumps(config, indent=1))


def _int(value) -> int | None:
    return None if value is None else int(value)


def _record_source(directory: Path, source: Path, st: os.stat_result) -> None:
    record = {"source": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "format": FORMAT}
    (directory / SOURCE_RECORD).write_text(json.dumps(record, indent=1))


def source_of(directory: Path) -> dict | None:
    """What an imported directory says about the GGUF file it came from (None: not an import)."""
    try:
        return json.loads((directory / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return None
