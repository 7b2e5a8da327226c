"""GGUF block types: numpy dequantizers against the `gguf` package's, bit for bit,
and MLX's affine form of each, exact or within the promised rounding."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as reference_dequantize

from gguf_export import quantize
from mlxkv.models import gguf_affine, gguf_blocks

# Where each type keeps its float16 fields: made finite, so a NaN never stands in for a value.
F16_AT = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82),
          T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
EXACT = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K)
REQUANTIZED = (T.Q2_K, T.Q3_K, T.Q6_K)


def random_blocks(kind: T, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    nbytes = gguf_blocks.TYPES[int(kind)].nbytes
    blocks = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    for at in F16_AT[kind]:
        values = (rng.normal(size=n) * 10.0 ** rng.integers(-4, 2, n)).astype(np.float16)
        blocks[:, at:at + 2] = values.reshape(n, 1).view(np.uint8)
    return blocks


@pytest.mark.parametrize("kind", list(F16_AT), ids=lambda k: k.name)
def test_dequantize_equals_the_gguf_package_bit_for_bit(kind):
    raw = random_blocks(kind, 512, seed=int(kind)).reshape(64, -1)  # rows of 8 blocks
    ours, theirs = gguf_blocks.dequantize(raw, int(kind)), reference_dequantize(raw, kind)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_float_types_equal_the_gguf_package():
    x = np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32)
    f16 = x.astype(np.float16).view(np.uint8)
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    for raw, kind in ((f16, T.F16), (bf16, T.BF16)):
        expected = reference_dequantize(raw, kind).astype(np.float32)
        assert np.array_equal(gguf_blocks.dequantize(raw, int(kind)).view(np.uint32), expected.view(np.uint32))
    assert np.array_equal(gguf_blocks.dequantize(x.view(np.uint8), int(T.F32)), x)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packing_is_mlx_layout(bits):
    q = np.random.default_rng(bits).integers(0, 2 ** bits, (4, 64), dtype=np.uint8)
    packed = mx.array(gguf_affine.pack(q, bits))
    values = mx.dequantize(packed, mx.ones((4, 2)), mx.zeros((4, 2)), group_size=32, bits=bits)
    assert np.array_equal(np.array(values), q.astype(np.float32))


def _through_mlx(raw: np.ndarray, kind: T, shape) -> np.ndarray:
    t = gguf_affine.to_affine(raw, int(kind), shape)
    return np.array(mx.dequantize(t["weight"], t["scales"], t["biases"], group_size=32,
                                  bits=gguf_affine.BITS[int(kind)]))


@pytest.mark.parametrize("kind", EXACT, ids=lambda k: k.name)
def test_types_with_a_scale_per_32_values_are_the_same_numbers_in_mlx(kind):
    raw = random_blocks(kind, 256, seed=7).reshape(16, -1)
    expected = gguf_blocks.dequantize(raw, int(kind))
    got = _through_mlx(raw, kind, expected.shape)
    scale = np.abs(expected).max(axis=1, keepdims=True)
    assert np.all(np.abs(got - expected) <= 1e-6 * scale)  # only the float rounding of scale * q + bias


@pytest.mark.parametrize("kind", REQUANTIZED, ids=lambda k: k.name)
def test_types_with_a_scale_per_16_values_add_under_half_their_own_rounding(kind):
    weights = np.random.default_rng(3).normal(size=(32, 512)).astype(np.float32)
    raw = quantize(weights, kind)
    in_file = reference_dequantize(raw, kind)
    got = _through_mlx(raw, kind, weights.shape)
    own, added = np.abs(in_file - weights).max(), np.abs(got - in_file).max()
    assert 0 < added <= 0.5 * own


def test_large_tensors_convert_in_chunks_to_the_same_result(monkeypatch):
    raw = random_blocks(T.Q4_K, 64, seed=2).reshape(8, -1)
    whole = gguf_affine.to_affine(raw, int(T.Q4_K), (8, 2048))
    monkeypatch.setattr(gguf_affine, "CHUNK_VALUES", 2048 * 3)
    chunked = gguf_affine.to_affine(raw, int(T.Q4_K), (8, 2048))
    assert all(mx.array_equal(whole[k], chunked[k]) for k in whole)
