"""How a pool stores K and V: in the model's dtype, or quantized as `mx.quantize` lays it out.

A quantized page layer is one `uint32` array `[blocks, heads, block,
record_words]`: per token vector, MLX's affine quantization along the head
dim as one record, its packed words (`dim * bits / 32`), then its scales,
then its biases (`dim / group` each, in the model's dtype). A kernel reads
a row's words, scales and biases as one contiguous span (attention/kernels.py);
the reference path gathers `KVFormat.parts`' views of the record, which are
`mx.quantize`'s three arrays as mlx-lm's `QuantizedKVCache` holds them. Each
token's vector is quantized alone, in groups along its own head dim, so a
block's bytes never depend on what else was in the batch or the step.

Outside the pool (the tiers, cache/block_kv.py) a quantized page is the
same records as `uint8`: each vector's packed words, then its scales, then
its biases. The tiers then move, count and check bytes whatever the format,
and store the pool's blocks as they are.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.kv_format import BITS, FULL, GROUP_SIZES, KVFormat  # noqa: F401  (the pool's format, defined below config)


def parts_of(page) -> list[mx.array]:
    """A page layer's arrays: itself, or a quantized one's three."""
    return list(page) if isinstance(page, tuple) else [page]


def page_map(fn, page):
    """`fn` applied to each array of a page layer, keeping its form."""
    return tuple(fn(p) for p in page) if isinstance(page, tuple) else fn(page)
