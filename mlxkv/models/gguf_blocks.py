"""GGUF's block quantizations, unpacked with numpy.

Every block type stores a row as blocks of 32 (legacy types) or 256
(K-quants) values. Unpacked, a block is integers `q` with, per sub-block,
a float scale `d` and, in the types that have one, an offset `m`:

    x = d * q + m        (x = d * q where there is no m)

computed in float32 in that order, which is how ggml dequantizes; so
`dequantize` here equals ggml's (and the `gguf` package's) bit for bit.
`q` keeps ggml's sign (Q4_0 stores q - 8, Q6_K q - 32, ...), so the sums
are the same operations, not merely the same algebra.

The layouts (ggml-common.h), bytes in order:
    Q4_0  d:f16 qs[16]                  q = nibble - 8         32 per block
    Q4_1  d:f16 m:f16 qs[16]            q = nibble
    Q5_0  d:f16 qh[4] qs[16]            q = nibble | h<<4 - 16
    Q5_1  d:f16 m:f16 qh[4] qs[16]      q = nibble | h<<4
    Q8_0  d:f16 qs[32]:i8
    Q2_K  scales[16] qs[64] d dmin      16 sub-blocks of 16: 4-bit scale, 4-bit min; 2-bit q
    Q3_K  hmask[32] qs[64] scales[12] d 16 of 16: 6-bit scale - 32; 3-bit q - 4
    Q4_K  d dmin scales[12] qs[128]     8 of 32: 6-bit scale and min; 4-bit q
    Q5_K  d dmin scales[12] qh[32] qs[128]   8 of 32; 5-bit q
    Q6_K  ql[128] qh[64] scales[16]:i8 d    16 of 16; 6-bit q - 32
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockType:
    name: str
    block: int  # values per block
    nbytes: int  # bytes per block
    sub: int  # values sharing one scale


F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = (
    0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30)
TYPES = {
    F32: BlockType("F32", 1, 4, 1), F16: BlockType("F16", 1, 2, 1), BF16: BlockType("BF16", 1, 2, 1),
    Q4_0: BlockType("Q4_0", 32, 18, 32), Q4_1: BlockType("Q4_1", 32, 20, 32),
    Q5_0: BlockType("Q5_0", 32, 22, 32), Q5_1: BlockType("Q5_1", 32, 24, 32),
    Q8_0: BlockType("Q8_0", 32, 34, 32),
    Q2_K: BlockType("Q2_K", 256, 84, 16), Q3_K: BlockType("Q3_K", 256, 110, 16),
    Q4_K: BlockType("Q4_K", 256, 144, 32), Q5_K: BlockType("Q5_K", 256, 176, 32),
    Q6_K: BlockType("Q6_K", 256, 210, 16),
}
FLOATS = (F32, F16, BF16)
# Types that exist but are not read here: named in the refusal.
UNSUPPORTED_NAMES = {9: "Q8_1", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL",
                     21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
                     29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}


@dataclass
class Unpacked:
    """Blocks as integers and per-sub-block floats: x = d * q (+ m)."""

    q: np.ndarray  # [blocks, block] integers, ggml's sign
    d: np.ndarray  # [blocks, block // sub] float32
    m: np.ndarray | None  # like d, or None
    sub: int


def type_name(kind: int) -> str:
    return TYPES[kind].name if kind in TYPES else UNSUPPORTED_NAMES.get(kind, f"type {kind}")


def row_bytes(kind: int, row: int) -> int:
    t = TYPES[kind]
    return row // t.block * t.nbytes


def floats(raw: np.ndarray, kind: int) -> np.ndarray:
    """F32, F16 or BF16 bytes as float32 (BF16 is the top half of a float32)."""
    if kind == F32:
        return raw.view(np.float32).copy()
    if kind == F16:
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def dequantize(raw: np.ndarray, kind: int) -> np.ndarray:
    """Bytes [..., k * nbytes] of one type as float32 [..., k * block]."""
    if kind in FLOATS:
        return floats(np.ascontiguousarray(raw), kind)
    lead = raw.shape[:-1]
    u = unpack(raw.reshape(-1, TYPES[kind].nbytes), kind)
    q = u.q.reshape(len(u.q), -1, u.sub).astype(np.float32)
    x = u.d[..., None] * q
    if u.m is not None:
        x = x + u.m[..., None]
    return x.reshape(*lead, -1)


def unpack(blocks: np.ndarray, kind: int) -> Unpacked:
    """Blocks [n, nbytes] of a quantized type, unpacked."""
    return _UNPACK[kind](np.ascontiguousarray(blocks))


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Low nibbles, then high nibbles: the order every legacy type and Q4_K/Q5_K use."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _bits(packed: np.ndarray, count: int, width: int = 1) -> np.ndarray:
    """[n, k] bytes -> [n, count, k]: field i of every byte (fields of `width` bits, low first)."""
    shifts = (np.arange(count, dtype=np.uint8) * width)[:, None]
    return (packed[:, None, :] >> shifts) & ((1 << width) - 1)


def _q4_0(b):
    return Unpacked(_nibbles(b[:, 2:18]).astype(np.int8) - 8, _f16(b, 0), None, 32)


def _q4_1(b):
    return Unpacked(_nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2), 32)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    high = _bits(qh, 8).transpose(0, 2, 1).reshape(len(qh), 32)  # bit j of the little-endian uint32: value j
    return _nibbles(qs) | (high << 4)


def _q5_0(b):
    return Unpacked(_five_bits(b[:, 2:6], b[:, 6:22]).astype(np.int8) - 16, _f16(b, 0), None, 32)


def _q5_1(b):
    return Unpacked(_five_bits(b[:, 4:8], b[:, 8:24]), _f16(b, 0), _f16(b, 2), 32)


def _q8_0(b):
    return Unpacked(b[:, 2:34].view(np.int8), _f16(b, 0), None, 32)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's 2-bit fields: byte l of each 32-byte half holds values l, l+32, l+64, l+96 of it."""
    n = len(qs)
    return _bits(qs.reshape(n * 2, 32), 4, 2).reshape(n, 256)


def _q2_k(b):
    scales = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    return Unpacked(_crumbs(b[:, 16:80]), d * (scales & 0xF), -(dmin * (scales >> 4)), 16)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """12 bytes -> 16 six-bit scales: low 4 bits in bytes 0-7 (low then high nibbles),
    high 2 bits in bytes 8-11 (scale k's at byte 8 + k % 4, bits 2 * (k // 4))."""
    low = np.concatenate([s[:, 0:8] & 0xF, s[:, 0:8] >> 4], axis=1)
    high = _bits(s[:, 8:12], 4, 2).reshape(len(s), 16)
    return (low | (high << 4)).astype(np.int8) - 32


def _q3_k(b):
    n = len(b)
    high = _bits(b[:, 0:32], 8).reshape(n, 256)  # bit i of hmask[l]: value 32 * i + l
    q = _crumbs(b[:, 32:96]).astype(np.int8) - 4 * (1 - high.astype(np.int8))
    return Unpacked(q, _f16(b, 108) * _q3_k_scales(b[:, 96:108]), None, 16)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins.
    Sub-blocks 0-3: low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7: nibbles
    of bytes 8-11, with the top 2 bits of bytes 0-3 and 4-7 above them."""
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc, mn


def _pairs(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K nibbles: 32 bytes per 64 values, low nibbles first."""
    n = len(qs)
    return _nibbles(qs.reshape(n * 4, 32)).reshape(n, 256)


def _q4_k(b):
    sc, mn = _k_scales(b[:, 4:16])
    d, dmin = _f16(b, 0), _f16(b, 2)
    return Unpacked(_pairs(b[:, 16:144]), d * sc, -(dmin * mn), 32)


def _q5_k(b):
    sc, mn = _k_scales(b[:, 4:16])
    d, dmin = _f16(b, 0), _f16(b, 2)
    high = _bits(b[:, 16:48], 8).reshape(len(b), 256)  # bit i of qh[l]: value 32 * i + l
    return Unpacked(_pairs(b[:, 48:176]) | (high << 4), d * sc, -(dmin * mn), 32)


def _q6_k(b):
    n = len(b)
    low = _nibbles(b[:, 0:128].reshape(n * 2, 64))  # per 128 values: ql[0:64] low, then high nibbles
    high = _bits(b[:, 128:192].reshape(n * 2, 32), 4, 2).reshape(n * 2, 128)
    q = (low | (high << 4)).reshape(n, 256).astype(np.int8) - 32
    return Unpacked(q, _f16(b, 208) * b[:, 192:208].view(np.int8), None, 16)


_UNPACK = {Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0,
           Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}
