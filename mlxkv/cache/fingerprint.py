"""The model fingerprint that roots every block hash.

Blocks are only interchangeable between runs of the same weights, dtype,
block size, KV layout and KV format (a quantized pool's bits and group),
so all of these go in. Hashing every weight byte
of a multi-GB model would add seconds to each start, so each tensor
contributes its name, shape, dtype and an evenly strided sample of its
values: any fine-tune or re-initialisation changes the sample.
"""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

LAYOUT_VERSION = 1
SAMPLES_PER_TENSOR = 4096

_UINT_OF_SIZE = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def _sample_bytes(param: mx.array) -> bytes:
    flat = param.reshape(-1)
    stride = max(1, flat.size // SAMPLES_PER_TENSOR)
    sample = flat[::stride][:SAMPLES_PER_TENSOR]
    # Bit patterns, not values: numpy has no bfloat16.
    return np.array(sample.view(_UINT_OF_SIZE[param.dtype.size])).tobytes()


def model_fingerprint(model, config: dict, kv_dtype: mx.Dtype, block_size: int,
                      groups: str | None = None, kv_format: str | None = None) -> bytes:
    """`groups`: the layer-group layout (GroupLayout.describe) of a model that
    is not one full-attention group; `kv_format`: a quantized pool's ("q8g64").
    A plain full-precision model's fingerprint is as before."""
    h = hashlib.sha256(b"mlxkv-fingerprint\0")
    header = {
        "layout_version": LAYOUT_VERSION,
        "block_size": block_size,
        "kv_dtype": str(kv_dtype),
        "config": config,
    }
    if groups is not None:
        header["groups"] = groups
    if kv_format is not None:
        header["kv_format"] = kv_format
    h.update(json.dumps(header, sort_keys=True, default=str).encode())
    for name, param in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        h.update(f"\0{name}:{param.shape}:{param.dtype}\0".encode())
        h.update(_sample_bytes(param))
    return h.digest()
