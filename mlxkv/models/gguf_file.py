"""Reading a GGUF file: its metadata, and each tensor's raw bytes, memory-mapped.

The layout (llama.cpp's gguf.md): the magic `GGUF`, a version (2 or 3),
the tensor and key-value counts, the key-values (typed), one record per
tensor (name, dims innermost first, type, offset), then the tensor data,
aligned to `general.alignment` (32 by default). Only the header is parsed
here; tensor bytes stay in the file's memory map until a caller reads them,
so a multi-GB file costs no memory to open, and `mlxkv models list` can read
a header without touching the weights.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlxkv.errors import MlxkvError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Metadata value types: fixed-size ones as (struct code, numpy dtype).
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9


class NotGGUF(MlxkvError):
    """A file that is not GGUF at all (not a damaged or unsupported one)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost first (GGUF lists dims innermost first)
    type: int  # GGML type code (gguf_blocks.TYPES)
    offset: int  # from the start of the data section


class GGUFFile:
    """One GGUF file: `.metadata` (dict) and `.tensors` (name -> TensorInfo); `raw(info)` reads bytes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except ValueError:  # numpy cannot map an empty file
            raise NotGGUF("not a GGUF file (it is empty)") from None
        except OSError as e:
            raise MlxkvError(f"cannot read it: {e.strerror or e}") from None
        if bytes(self._map[:4]) != MAGIC:
            raise NotGGUF(f"not a GGUF file (it starts with {bytes(self._map[:4])!r}, not b'GGUF')")
        reader = _Reader(self._map)
        try:
            self.metadata, self.tensors, header_end = _parse(reader)
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
            raise MlxkvError(f"damaged GGUF header ({e})") from None
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)) or DEFAULT_ALIGNMENT
        self.data_start = -(-header_end // alignment) * alignment

    def raw(self, info: TensorInfo, nbytes: int) -> np.ndarray:
        """The tensor's `nbytes` bytes (a view of the map: read lazily)."""
        start = self.data_start + info.offset
        if start + nbytes > len(self._map):
            raise MlxkvError(f"the file is truncated: tensor {info.name!r} runs past its end")
        return self._map[start:start + nbytes]


def read_metadata(path: str | Path) -> dict:
    """A GGUF file's metadata alone (the catalog's view of a file)."""
    return GGUFFile(path).metadata


def is_gguf_file(path: str | Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


class _Reader:
    def __init__(self, buffer: np.ndarray):
        self.buf = memoryview(buffer)
        self.pos = 0

    def scalar(self, code: str):
        size = struct.calcsize(code)
        (value,) = struct.unpack_from(code, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        raise ValueError(f"unknown metadata type {kind}")

    def array(self):
        kind, n = self.scalar("<I"), self.scalar("<Q")
        if kind in _SCALARS:  # numbers in one read (token scores, types: 100k+ entries)
            dtype = np.dtype(_SCALARS[kind][1]).newbyteorder("<")
            end = self.pos + n * dtype.itemsize
            if end > len(self.buf):
                raise ValueError("an array runs past the end of the file")
            values = np.frombuffer(self.buf[self.pos:end], dtype=dtype).copy()
            self.pos = end
            return values
        return [self.value(kind) for _ in range(n)]


def _parse(reader: _Reader) -> tuple[dict, dict[str, TensorInfo], int]:
    reader.pos = 4
    version = reader.scalar("<I")
    if version not in VERSIONS:
        raise MlxkvError(f"GGUF version {version} is not supported (supported: {', '.join(map(str, VERSIONS))})")
    n_tensors, n_kv = reader.scalar("<Q"), reader.scalar("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar("<I"))
    tensors = {}
    for _ in range(n_tensors):
        name = reader.string()
        dims = [reader.scalar("<Q") for _ in range(reader.scalar("<I"))]
        kind, offset = reader.scalar("<I"), reader.scalar("<Q")
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), kind, offset)
    return metadata, tensors, reader.pos
