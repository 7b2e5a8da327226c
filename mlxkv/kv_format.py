"""How a pool stores K and V: in the model's dtype, or quantized as `mx.quantize` lays it out.

A value type every layer shares: the flag parser makes one (cli_flags.py),
the engine config holds it (config.py), the pool, the tiers and the
attention kernels read it (cache/kv_format.py has the page layout). So it
sits at the bottom of the package, beside config.py and errors.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlxkv.errors import MlxkvError

BITS = (8, 4)
GROUP_SIZES = (64, 32)


@dataclass(frozen=True, slots=True)
class KVFormat:
    """`bits` None: full precision; else 8 or 4 bits in groups of `group_size` along the head dim."""

    bits: int | None = None
    group_size: int = 64

    def __post_init__(self):
        if self.bits is not None and self.bits not in BITS:
            raise MlxkvError(f"kv bits must be {' or '.join(map(str, BITS))}, got {self.bits!r}")
        if self.group_size not in GROUP_SIZES:
            raise MlxkvError(f"kv group size must be {' or '.join(map(str, GROUP_SIZES))}, got {self.group_size!r}")

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def name(self, dtype) -> str:
        """What stats and files call it: the dtype ("float16"), or "q8g64"."""
        return f"q{self.bits}g{self.group_size}" if self.quantized else str(dtype).removeprefix("mlx.core.")

    def vector_bytes(self, dim: int, dtype) -> int:
        """Bytes one token's vector of `dim` takes in a page layer."""
        if not self.quantized:
            return dim * dtype.size
        return dim * self.bits // 8 + 2 * (dim // self.group_size) * dtype.size

    def stored_dim(self, dim: int, dtype) -> int:
        """The last axis of a page outside the pool: `dim` values, or a quantized vector's bytes."""
        return self.vector_bytes(dim, dtype) if self.quantized else dim

    def check(self, dim: int) -> None:
        """MlxkvError unless vectors of `dim` quantize in this format's groups."""
        if self.quantized and dim % self.group_size:
            other = [g for g in GROUP_SIZES if dim % g == 0]
            hint = f"; use --kv-group-size {other[0]}" if other else ""
            raise MlxkvError(f"a head dim of {dim} does not split into quantization groups of "
                             f"{self.group_size}{hint}")

    # -- pool pages -------------------------------------------------------

    def zeros(self, shape: tuple[int, ...], dtype):
        """A page layer of `shape` (`[..., dim]`) holding zeros: an array, or (packed, scales, biases)."""
        if not self.quantized:
            return mx.zeros(shape, dtype)
        *lead, dim = shape
        return (mx.zeros((*lead, dim * self.bits // 32), mx.uint32),
                mx.zeros((*lead, dim // self.group_size), dtype), mx.zeros((*lead, dim // self.group_size), dtype))

    def quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Each vector along the last axis alone: (packed, scales, biases)."""
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def dequantize(self, parts, dtype) -> mx.array:
        packed, scales, biases = parts
        return mx.dequantize(packed, scales, biases, group_size=self.group_size, bits=self.bits).astype(dtype)

    # -- pages outside the pool --------------------------------------------

    def to_bytes(self, parts) -> mx.array:
        """(packed, scales, biases) as one `uint8` array: each vector's bytes in that order."""
        return mx.concatenate([p.view(mx.uint8) for p in parts], axis=-1)

    def from_bytes(self, data: mx.array, dim: int, dtype) -> tuple[mx.array, mx.array, mx.array]:
        """The inverse of `to_bytes` for vectors of `dim` with scales in `dtype`."""
        words = dim * self.bits // 8
        side = (dim // self.group_size) * dtype.size
        cuts = ((0, words, mx.uint32), (words, words + side, dtype), (words + side, words + 2 * side, dtype))
        return tuple(mx.contiguous(data[..., a:b]).view(t) for a, b, t in cuts)


FULL = KVFormat()
