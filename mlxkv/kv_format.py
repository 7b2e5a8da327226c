"""How a pool stores K and V: in the model's dtype, or quantized (mx.quantize's values, one record a vector).

A value type every layer shares: the flag parser makes one (cli_flags.py),
the engine config holds it (config.py), the pool, the tiers and the
attention kernels read it (cache/kv_format.py has the page layout). So it
sits at the bottom of the package, beside config.py and errors.py.
"""

from __future__ import annotations

import functools
import itertools
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
    # A quantized page layer is one `uint32` array `[..., record_words]`: each
    # vector's record, its packed words, then its scales, then its biases (in
    # the model's dtype), so a kernel reads a row's words, scales and biases as
    # one contiguous span. Outside the pool the record is the same bytes.

    def record_words(self, dim: int, dtype) -> int:
        """32-bit words of a quantized vector's record (its scales and biases, a pair per group
        of at least 2 bytes each, fill whole words)."""
        return self.vector_bytes(dim, dtype) // 4

    def zeros(self, shape: tuple[int, ...], dtype) -> mx.array:
        """A page layer of `shape` (`[..., dim]`) holding zeros: values, or quantized records."""
        if not self.quantized:
            return mx.zeros(shape, dtype)
        *lead, dim = shape
        return mx.zeros((*lead, self.record_words(dim, dtype)), mx.uint32)

    def quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Each vector along the last axis alone: mx.quantize's (packed, scales, biases)."""
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def record(self, parts) -> mx.array:
        """(packed, scales, biases) as each vector's `uint32` record."""
        packed, scales, biases = parts
        return mx.concatenate([packed, mx.concatenate([scales, biases], axis=-1).view(mx.uint32)], axis=-1)

    def page(self, x: mx.array) -> mx.array:
        """Vectors `[..., dim]` as a page layer holds them: as given, or quantized records."""
        return self.record(self.quantize(x)) if self.quantized else x

    def parts(self, records: mx.array, dim: int, dtype) -> tuple[mx.array, mx.array, mx.array]:
        """Records back as mx.quantize's (packed, scales, biases) of vectors of `dim`: views
        of `records` (strided slices; a gather or matmul reading them copies nothing more)."""
        words, groups = dim * self.bits // 32, dim // self.group_size
        side = records.view(dtype)  # before slicing: a view of a whole contiguous array is free
        at = words * 4 // dtype.size
        return records[..., :words], side[..., at : at + groups], side[..., at + groups : at + 2 * groups]

    def dequantize(self, parts, dtype) -> mx.array:
        packed, scales, biases = parts
        return mx.dequantize(packed, scales, biases, group_size=self.group_size, bits=self.bits).astype(dtype)

    # -- pages outside the pool --------------------------------------------

    def to_bytes(self, records: mx.array) -> mx.array:
        """Records as one `uint8` array: each vector's packed words, scales and biases."""
        return records.view(mx.uint8)

    def from_bytes(self, data: mx.array) -> mx.array:
        """The inverse of `to_bytes`."""
        return data.view(mx.uint32)


FULL = KVFormat()


@functools.lru_cache(maxsize=None)
def record_format(width: int, dim: int, dtype, bits=BITS, group_sizes=GROUP_SIZES) -> KVFormat | None:
    """The format among `bits` x `group_sizes` whose records of `dim`-vectors with scales in `dtype`
    are `width` words wide, or None. Formats differ for one dtype, not across dtypes (fp32 scales at
    8 bits in groups of 64 are as wide as fp16's in groups of 32), so `dtype` must be the pool's.
    Cached: the kernels ask for every layer of every decode step."""
    for b, g in itertools.product(bits, group_sizes):
        if dim % g == 0 and KVFormat(b, g).record_words(dim, dtype) == width:
            return KVFormat(b, g)
    return None
