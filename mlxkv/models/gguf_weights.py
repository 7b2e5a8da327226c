"""A GGUF file's tensors written as mlx-lm safetensors shards, one tensor at a time.

Weight matrices in a block quantization stay quantized (gguf_affine.py
picks the bits); everything else (norms, biases, float matrices) becomes
float32. Gemma's norms lose the one llama.cpp added. A shard is written
once it holds `shard_bytes`, so the import never holds the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxkv.errors import MlxkvError
from mlxkv.models import gguf_affine, gguf_blocks
from mlxkv.models.gguf_architectures import CONFIG_TENSORS, Architecture, is_norm, mlx_name
from mlxkv.models.gguf_file import GGUFFile, TensorInfo


@dataclass
class Converted:
    vocab_size: int = 0
    has_output: bool = False
    config_tensors: dict[str, np.ndarray] = field(default_factory=dict)  # rope factors, as float32
    quantization: dict = field(default_factory=dict)  # mlx-lm's: common bits, per-module exceptions


def convert_weights(gguf: GGUFFile, arch: Architecture, directory: Path, shard_bytes: int) -> Converted:
    result, shard, bits = Converted(), _Shards(directory, shard_bytes), {}
    for info in gguf.tensors.values():
        raw = gguf.raw(info, _nbytes(info))
        if info.name.rpartition(".")[0] in CONFIG_TENSORS:
            result.config_tensors[info.name] = gguf_blocks.dequantize(raw, info.type).reshape(info.shape)
            continue
        name = mlx_name(arch, info.name)
        if name is None:
            continue
        module = name.rpartition(".")[0]
        if _stays_quantized(info, name):
            for key, value in gguf_affine.to_affine(raw, info.type, info.shape).items():
                shard.add(f"{module}.{key}", value)
            bits[module] = gguf_affine.BITS[info.type]
        else:
            value = gguf_affine.to_floats(raw, info.type, info.shape)
            shard.add(name, value - arch.norm_shift if arch.norm_shift and is_norm(name) else value)
        if module == "model.embed_tokens":
            result.vocab_size = info.shape[0]
        result.has_output |= module == "lm_head"
    shard.close()
    result.quantization = quantization_config(bits)
    return result


def _nbytes(info: TensorInfo) -> int:
    if not gguf_affine.supported(info.type):
        supported = ", ".join(gguf_blocks.type_name(k) for k in sorted(gguf_blocks.TYPES))
        raise MlxkvError(f"tensor {info.name!r} is {gguf_blocks.type_name(info.type)}, "
                         f"which is not supported (supported: {supported})")
    t = gguf_blocks.TYPES[info.type]
    if info.shape[-1] % t.block:
        raise MlxkvError(f"tensor {info.name!r} has rows of {info.shape[-1]}, not whole {t.name} blocks")
    return int(np.prod(info.shape[:-1], dtype=np.int64)) * gguf_blocks.row_bytes(info.type, info.shape[-1])


def _stays_quantized(info: TensorInfo, name: str) -> bool:
    """A quantized weight matrix stays quantized; a quantized norm or bias is made float."""
    return info.type not in gguf_blocks.FLOATS and len(info.shape) >= 2 and name.endswith(".weight")


def quantization_config(bits: dict[str, int]) -> dict:
    """The most common bits for all, and a per-module entry where a tensor differs."""
    if not bits:
        return {}
    values = list(bits.values())
    common = max(set(values), key=values.count)
    quantization = {"group_size": gguf_affine.GROUP_SIZE, "bits": common}
    for module, b in bits.items():
        if b != common:
            quantization[module] = {"group_size": gguf_affine.GROUP_SIZE, "bits": b}
    return quantization


class _Shards:
    def __init__(self, directory: Path, shard_bytes: int):
        self.directory, self.limit = directory, shard_bytes
        self.pending: dict[str, mx.array] = {}
        self.pending_bytes = 0
        self.written: list[Path] = []

    def add(self, name: str, value: mx.array) -> None:
        self.pending[name] = value
        self.pending_bytes += value.nbytes
        if self.pending_bytes >= self.limit:
            self._flush()

    def _flush(self) -> None:
        path = self.directory / f"model-{len(self.written) + 1:05d}.safetensors"
        mx.save_safetensors(str(path), self.pending, metadata={"format": "mlx"})
        self.written.append(path)
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.written:
            self._flush()
        if len(self.written) == 1:  # one file: the usual name
            self.written[0].rename(self.directory / "model.safetensors")
