"""The remote tier's values: the SSD tier's checksummed file bytes, out of MLX and back.

A block's value is the file of a one-block run (run_file.py): format,
fingerprint, block size, layer count, dtype, its hash, its layer group and
the XXH3 checksum of its tensors, so a value is verified exactly as a file
is, and a value under another key, model or format is never taken.

Out: on the engine thread, blocks become numpy copies (disk/kv_arrays.py,
as for the SSD tier), and the tier's thread encodes them. Back: a
hydrate's values are verified, then made one new layer-major MLX run, so
the pool takes the whole stretch with one slice copy per layer
(kv_pool.write_blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from mlxkv.cache.block_kv import KVRun
from mlxkv.cache.hashing import BlockHash
from mlxkv.connectors.disk import run_file
from mlxkv.connectors.disk.run_file import CorruptBlockError, FileSpec, RunData


def decode(spec: FileSpec, block_hash: BlockHash, value: bytes) -> RunData:
    """A value's one-block run, every field and the checksum checked; CorruptBlockError if not."""
    data = run_file.decode(spec, np.frombuffer(value, np.uint8), block_hash)
    if len(data.block_hashes) != 1:
        raise CorruptBlockError(f"a value of {len(data.block_hashes)} blocks")
    data.verify()
    return data


def as_run(runs: Sequence[RunData], mx_dtype: mx.Dtype) -> KVRun:
    """The blocks of verified one-block runs as one new layer-major MLX run, in order.

    One numpy concatenation per side, then one copy into MLX memory
    (cheaper, measured, than filling an MLX buffer made with mx.zeros).
    """
    return KVRun(_mx(np.concatenate([r.keys for r in runs], axis=1), mx_dtype),
                 _mx(np.concatenate([r.values for r in runs], axis=1), mx_dtype))


def _mx(a: np.ndarray, mx_dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    return out.view(mx_dtype) if out.dtype != mx_dtype else out  # bfloat16 comes back from its uint16 bits


def same_shape(a: RunData, b: RunData) -> bool:
    return a.keys.shape == b.keys.shape and a.values.shape == b.values.shape
