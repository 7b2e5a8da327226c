"""GGUF tensors as MLX tensors: floats as float32, block types as MLX's affine quantization.

MLX quantizes in groups of 32 (or 64, 128) with a float scale and bias per
group: w = scale * q + bias, q unsigned of 2-8 bits. Each GGUF type gets
the bits that keep the file's precision (docs/models.md, "How the bits are
chosen"):

- types whose scale covers 32 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
  Q5_K) are the same numbers in MLX's form: q moved to unsigned, the
  scale kept, the offset folded into the bias. Nothing is rounded;
- types with a scale per 16 values (Q2_K, Q3_K, Q6_K) have no exact form
  in groups of 32, so they are dequantized and requantized with enough
  bits that the rounding added is at most half of the file's own:
  2^bits - 1 >= 4 * (2^file_bits - 1), which gives Q2_K 4, Q3_K 5, Q6_K 8.

Scales and biases are float32 (gguf.py says why). Work goes in chunks of
rows, so a large tensor never has a float32 copy of itself in memory.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxkv.errors import MlxkvError
from mlxkv.models import gguf_blocks as blocks

GROUP_SIZE = 32
BITS = {blocks.Q4_0: 4, blocks.Q4_1: 4, blocks.Q4_K: 4, blocks.Q5_0: 5, blocks.Q5_1: 5, blocks.Q5_K: 5,
        blocks.Q8_0: 8, blocks.Q2_K: 4, blocks.Q3_K: 5, blocks.Q6_K: 8}
# ggml's q is signed in these: q + offset is MLX's unsigned q.
_OFFSET = {blocks.Q4_0: 8, blocks.Q5_0: 16, blocks.Q8_0: 128}
CHUNK_VALUES = 1 << 24  # values converted at a time (64 MB as float32)


def supported(kind: int) -> bool:
    return kind in BITS or kind in blocks.FLOATS


def is_exact(kind: int) -> bool:
    """Whether the type is MLX's affine form as it is (a scale per 32 values)."""
    return kind in BITS and blocks.TYPES[kind].sub == GROUP_SIZE


def to_floats(raw: np.ndarray, kind: int, shape: tuple[int, ...]) -> mx.array:
    """Any supported tensor as float32 (norms, biases; a quantized one is dequantized)."""
    return mx.array(blocks.dequantize(raw, kind).reshape(shape))


def to_affine(raw: np.ndarray, kind: int, shape: tuple[int, ...]) -> dict[str, mx.array]:
    """A quantized tensor as {"weight", "scales", "biases"}, MLX's affine form of its bits."""
    if not supported(kind) or kind in blocks.FLOATS:
        raise MlxkvError(f"tensor type {blocks.type_name(kind)} is not supported")
    row = shape[-1]
    rows = raw.reshape(-1, blocks.row_bytes(kind, row))
    step = max(1, CHUNK_VALUES // row)
    parts = [_convert(rows[i:i + step], kind) for i in range(0, len(rows), step)]
    lead = shape[:-1]
    return {name: mx.concatenate([p[k] for p in parts]).reshape(*lead, -1)
            for k, name in enumerate(("weight", "scales", "biases"))}


def _convert(rows: np.ndarray, kind: int) -> tuple[mx.array, mx.array, mx.array]:
    n_rows, bits = len(rows), BITS[kind]
    if not is_exact(kind):
        values = blocks.dequantize(np.asarray(rows), kind)
        return mx.quantize(mx.array(values), group_size=GROUP_SIZE, bits=bits)
    u = blocks.unpack(np.asarray(rows).reshape(-1, blocks.TYPES[kind].nbytes), kind)
    offset = _OFFSET.get(kind, 0)
    q = (u.q.astype(np.int16) + offset).astype(np.uint8).reshape(n_rows, -1)
    bias = -offset * u.d if u.m is None else u.m + (-offset * u.d if offset else 0)
    return (mx.array(pack(q, bits)), mx.array(u.d.reshape(n_rows, -1)),
            mx.array(bias.astype(np.float32).reshape(n_rows, -1)))


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """[rows, n] values of `bits` bits as MLX packs them: one little-endian bit stream, as uint32."""
    n_rows, n = q.shape
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8).view(np.uint32)
    if bits == 4:  # the common case, without the 64-bit detour: two values a byte, low nibble first
        return np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)).view(np.uint32)
    groups = q.reshape(n_rows, n // 8, 8).astype(np.uint64)  # 8 values are `bits` whole bytes
    words = groups[:, :, 0].copy()
    for i in range(1, 8):
        words |= groups[:, :, i] << np.uint64(i * bits)
    return np.ascontiguousarray(words.view(np.uint8).reshape(n_rows, n // 8, 8)[:, :, :bits]) \
        .reshape(n_rows, -1).view(np.uint32)
