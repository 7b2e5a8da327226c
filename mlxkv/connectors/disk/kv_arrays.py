"""K/V between MLX and the files' numpy arrays: dtypes, the tier's FileSpec, and views for the writer.

numpy has no bfloat16, so bfloat16 is stored as its raw uint16 bit
patterns (the file's metadata names the real dtype). A quantized pool's
pages are bytes (`uint8`, cache/kv_format.py), and the file names their
format ("q8g64") beside the dtype of their scales. The SSD tier's
writes and the remote tier's values go through here alike, so a block's
bytes are the same on disk and on the server.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from mlxkv.cache.block_kv import BlockKV, KVRun
from mlxkv.connectors.disk.run_file import FileSpec

# Real dtype -> (mx dtype, numpy dtype it is stored as).
DTYPES = {
    "float32": (mx.float32, np.dtype(np.float32)),
    "float16": (mx.float16, np.dtype(np.float16)),
    "bfloat16": (mx.bfloat16, np.dtype(np.uint16)),
}


def normalize_dtype(dtype) -> str:
    name = str(dtype).removeprefix("mlx.core.")
    if name not in DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return name


def file_spec(fingerprint: bytes, block_size: int, num_layers: int, dtype,
              page: tuple[int, int, int, int] | None = None,
              kv_format: str | None = None) -> tuple[FileSpec, mx.Dtype]:
    """What every file (or remote value) of a tier says about itself, and the MLX dtype its K/V come back in.
    `kv_format`: a quantized pool's ("q8g64"), whose pages are bytes; None: full precision."""
    name = normalize_dtype(dtype)
    mx_dtype, np_dtype = (mx.uint8, np.dtype(np.uint8)) if kv_format else DTYPES[name]
    return FileSpec(fingerprint, block_size, num_layers, name, np_dtype, page, kv_format), mx_dtype


def to_numpy(kvs: Sequence[BlockKV], spec: FileSpec, mx_dtype: mx.Dtype) -> tuple[np.ndarray, np.ndarray]:
    """Layer-major numpy copies `[num_layers, n, heads, block_size, head_dim]` of the blocks.

    Consecutive views of one run (a pool read) are one slice of it; other
    blocks are stacked first. Runs on the engine thread, and copies nothing
    there: the arrays are read-only numpy views of the MLX memory (a pool
    read is evaluated and never written; the view keeps it alive), which the
    writer thread copies into a file's bytes. Writer threads never call MLX.
    """
    first, n = kvs[0], len(kvs)
    hint = f"[{spec.num_layers}, heads, {spec.block_size}, head_dim]"
    if first.run is not None and all(kv.run is first.run and kv.index == first.index + j
                                     for j, kv in enumerate(kvs)):
        keys = first.run.keys[:, first.index : first.index + n]
        values = first.run.values[:, first.index : first.index + n]
    else:
        for kv in kvs:
            if kv.keys.ndim != 4 or kv.values.ndim != 4:
                raise ValueError(f"expected KV of shape {hint}, got {list(kv.keys.shape)}")
        run = KVRun.stack(kvs)
        keys, values = run.keys, run.values
    for a in (keys, values):
        if a.dtype != mx_dtype:
            raise ValueError(f"the tier holds {spec.dtype} KV, got {a.dtype}")
        shape = tuple(a.shape)
        if len(shape) != 5 or shape[0] != spec.num_layers or shape[3] != spec.block_size:
            raise ValueError(f"expected KV of shape {hint}, got {[shape[0], *shape[2:]]}")
    if keys.shape[:2] != values.shape[:2]:  # V may be narrower than K (page formats)
        raise ValueError(f"keys {keys.shape} and values {values.shape} do not match")
    return _numpy(keys), _numpy(values)


def _numpy(a: mx.array) -> np.ndarray:
    """A read-only view of the array's memory (strided for a slice of a run: run_file.encode copies it)."""
    view = np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
    view.flags.writeable = False
    return view
