"""The SSD tier's file of one recurrent-state checkpoint (cache/checkpoints.py).

A safetensors file beside the block runs, named after the checkpoint's key
and listing that key as its one "block hash", so the tier's index, scan,
LRU budget and `mlxkv cache info|clear` treat it as any file. Its header
also names the block it follows and its boundary (`checkpoint_ref`), so a
restarted process's checkpoint index knows where it sits. Tensor
`s{slot}.{i}` is array i of recurrent slot `slot`; bfloat16 is stored as
its uint16 bits with the real dtype in the metadata. The format name
differs from a block run's, so neither is ever read as the other; a
checksum over every tensor, in name order, catches torn writes and
flipped bits (CorruptBlockError, as for runs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import safetensors.numpy

from mlxkv.cache.checkpoints import Checkpoint, CheckpointRef, States
from mlxkv.connectors.disk.run_file import (
    CHECKSUM_ALGO, CHECKSUMS, FORMAT_VERSION, CorruptBlockError, FileSpec, listed_hashes, parse,
)

STATE_FORMAT = "mlxkv-state"
# A decoded checkpoint before it is MLX: per slot, (array as stored, real dtype) or None.
StagedStates = tuple[tuple[tuple[np.ndarray, str] | None, ...], ...]
_STORED = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


@dataclass(slots=True)
class StateJob:
    """A checkpoint for the writer thread, already in numpy (the writer never touches MLX)."""

    block_hashes: tuple[bytes, ...]  # the checkpoint's key alone
    tensors: dict[str, np.ndarray]
    dtypes: dict[str, str]
    spill: bool
    ref: CheckpointRef

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def encode(self, spec: FileSpec) -> bytes:
        meta = {
            "format": STATE_FORMAT,
            "format_version": FORMAT_VERSION,
            "fingerprint": spec.fingerprint.hex(),
            "block_hashes": self.block_hashes[0].hex(),
            "checkpoint_of": self.ref.block_hash.hex(),
            "boundary": str(self.ref.boundary),
            "dtypes": json.dumps(self.dtypes, sort_keys=True),
            "checksum_algo": CHECKSUM_ALGO,
            "checksum": tensors_checksum(self.tensors, CHECKSUM_ALGO),
        }
        return safetensors.numpy.save(self.tensors, metadata=meta)


def state_job(checkpoint: Checkpoint, spill: bool) -> StateJob:
    """The write of a checkpoint; converts to numpy on the caller's (the engine's) thread."""
    tensors, dtypes = {}, {}
    for slot, arrays in enumerate(checkpoint.states):
        for i, a in enumerate(arrays):
            if a is None:
                continue
            name, dtype = f"s{slot}.{i}", str(a.dtype).removeprefix("mlx.core.")
            if dtype not in _STORED:
                raise ValueError(f"a checkpoint of {dtype} state cannot be stored")
            tensors[name] = np.array(a.view(mx.uint16) if dtype == "bfloat16" else a, copy=True)
            dtypes[name] = dtype
    return StateJob((checkpoint.key,), tensors, dtypes, spill, checkpoint.ref)


def checkpoint_ref(meta: dict, name: bytes) -> CheckpointRef | None:
    """The block and boundary a state file's header names, when they are its key's (else None)."""
    if meta.get("format") != STATE_FORMAT:
        return None
    try:
        ref = CheckpointRef(bytes.fromhex(meta.get("checkpoint_of", "")), int(meta.get("boundary", "")))
    except ValueError:
        return None
    return ref if len(ref.block_hash) == 32 and ref.boundary > 0 and ref.key == name else None


def decode_state(spec: FileSpec, data: np.ndarray, name: bytes) -> StagedStates:
    """The checkpoint in a file's bytes, every field and the checksum checked, as numpy (any
    thread: `mlx_states` makes it MLX on the engine thread); CorruptBlockError if not."""
    meta, tensors = parse(data)
    for field, want in (("format", STATE_FORMAT), ("format_version", FORMAT_VERSION),
                        ("fingerprint", spec.fingerprint.hex())):
        if meta.get(field) != want:
            raise CorruptBlockError(f"metadata {field}={meta.get(field)!r}, expected {want!r}")
    if listed_hashes(meta, name) != (name,):
        raise CorruptBlockError("the checkpoint file does not name its key")
    try:
        dtypes = json.loads(meta.get("dtypes", ""))
    except ValueError as e:
        raise CorruptBlockError(f"dtypes: {e}") from e
    if not isinstance(dtypes, dict) or set(dtypes) != set(tensors):
        raise CorruptBlockError("dtypes do not list the tensors")
    algo = meta.get("checksum_algo")
    if algo not in CHECKSUMS or meta.get("checksum") != tensors_checksum(tensors, algo):
        raise CorruptBlockError("checksum mismatch")
    return _states(tensors, dtypes)


def _states(tensors: dict[str, np.ndarray], dtypes: dict[str, str]) -> StagedStates:
    slots: dict[int, dict[int, tuple[np.ndarray, str]]] = {}
    for name, tensor in tensors.items():
        dtype = dtypes[name]
        if dtype not in _STORED or tensor.dtype != _STORED[dtype]:
            raise CorruptBlockError(f"tensor {name!r} stored as {tensor.dtype} for {dtype}")
        try:
            slot, i = (int(part) for part in name.removeprefix("s").split("."))
        except ValueError as e:
            raise CorruptBlockError(f"tensor name {name!r}") from e
        slots.setdefault(slot, {})[i] = (tensor, dtype)
    if sorted(slots) != list(range(len(slots))):
        raise CorruptBlockError("checkpoint slots are not 0..n-1")
    return tuple(tuple(arrays.get(i) for i in range(max(arrays) + 1)) for _, arrays in sorted(slots.items()))


def mlx_states(staged: StagedStates) -> States:
    """A decoded checkpoint's arrays as MLX (the engine thread's: one copy each)."""
    return tuple(tuple(None if a is None else _mlx(*a) for a in slot) for slot in staged)


def _mlx(tensor: np.ndarray, dtype: str) -> mx.array:
    array = mx.array(tensor)
    return array.view(mx.bfloat16) if dtype == "bfloat16" else array


def tensors_checksum(tensors: dict[str, np.ndarray], algo: str) -> str:
    ordered = [tensors[name] for name in sorted(tensors)]
    return CHECKSUMS[algo](np.ascontiguousarray(t).reshape(-1).view(np.uint8) for t in ordered)
