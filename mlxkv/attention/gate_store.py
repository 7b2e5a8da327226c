"""The speed gate's choices, kept on disk so that a restart neither re-times nor flips them.

A gate's buckets (speed_gate.py) hold for one model shape, KV format, chip,
MLX version and kernel source: that is the key, and a file under the cache
directory (`MLXKV_CACHE_DIR`/speed_gate) holds one key's buckets. A model
load finds its key's file and reuses it, or times the gate and stores it;
the gate says which (`SpeedGate.source`, shown by `mlxkv doctor`). A new
MLX, another chip, edited kernels or a change to what the gate measures
(GATE_VERSION) is another key, so it is timed again. An unreadable file is
timed again and rewritten; a store that cannot be written logs why and the
gate still serves this load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, replace
from pathlib import Path

import mlx.core as mx

from mlxkv.attention import kernels
from mlxkv.attention.speed_gate import AttentionShape, Bucket, SpeedGate, measure
from mlxkv.system.paths import cache_root

log = logging.getLogger(__name__)

GATE_VERSION = 2  # 2: pipelined steps of many layers, distinct rows, a margin (issue 47)
KERNEL_SOURCES = ("common", "paged_decode", "paged_decode_multi", "paged_reduce")


def chip() -> str:
    """The GPU's name (Metal), else the CPU's: timings hold for this chip only."""
    try:
        if mx.metal.is_available():
            # mx.device_info, not mx.metal.device_info: MLX deprecated the latter (0.29)
            return str(mx.device_info().get("device_name", "metal"))
    except Exception:  # an MLX without device_info: the platform still names the machine
        log.exception("could not read the Metal device's name")
    return platform.processor() or platform.machine() or "cpu"


def kernels_digest() -> str:
    """A digest of the shipped kernel sources: edited kernels are timed again."""
    text = "".join(kernels.kernel_source(name) for name in KERNEL_SOURCES)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def gate_key(shape: AttentionShape) -> dict:
    """What a stored gate holds for."""
    return {"gate": GATE_VERSION, "dtype": str(shape.dtype).removeprefix("mlx.core."), "head_dim": shape.head_dim,
            "block_size": shape.block_size, "n_heads": shape.n_heads, "n_kv_heads": shape.n_kv_heads,
            "kv_bits": shape.kv.bits, "kv_group_size": shape.kv.group_size if shape.kv.quantized else None,
            "chip": chip(), "mlx": mx.__version__, "kernels": kernels_digest()}


class GateStore:
    """One JSON file per gate key under `directory` (default: the cache dir's speed_gate/)."""

    def __init__(self, directory: Path | str | None = None):
        self.directory = Path(directory) if directory is not None else cache_root() / "speed_gate"

    def path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return self.directory / f"{key['dtype']}-d{key['head_dim']}-h{key['n_heads']}x{key['n_kv_heads']}-{digest}.json"

    def load(self, key: dict) -> SpeedGate | None:
        """The gate stored for `key`, or None (none stored, or unreadable: logged)."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            if data["key"] != key:
                raise ValueError("stored for another key")
            buckets = tuple(Bucket(**{k: b[k] for k in ("batch", "context", "kernel_ms", "reference_ms", "queries")})
                            for b in data["buckets"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("the stored speed gate %s is unreadable (%s); timing it again", path, e)
            return None
        return SpeedGate(buckets, f"stored in {path}, timed {data.get('timed', '?')}")

    def save(self, key: dict, gate: SpeedGate) -> SpeedGate:
        """Store `gate` for `key` (atomically); the gate, saying where it went."""
        path = self.path(key)
        timed = time.strftime("%Y-%m-%d %H:%M:%S")
        data = {"key": key, "timed": timed, "buckets": [asdict(b) for b in gate.buckets]}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("could not store the speed gate in %s (%s); it is timed again at the next load", path, e)
            return replace(gate, source=f"timed at this load {timed} (not stored: {e})")
        return replace(gate, source=f"timed at this load {timed}, stored in {path}")


def stored_or_measured(shape: AttentionShape, run=None, timer=None, store: GateStore | None = None) -> SpeedGate:
    """The gate stored for this shape here, else timed now (speed_gate.measure) and stored."""
    store = store or GateStore()
    key = gate_key(shape)
    return store.load(key) or store.save(key, measure(shape, run=run, timer=timer))
