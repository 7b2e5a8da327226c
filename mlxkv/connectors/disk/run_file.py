"""The SSD tier's file format: one safetensors file per run of blocks.

A run is up to MAX_RUN_BLOCKS consecutive blocks of one sequence, written
together. Tensors `keys` and `values` are layer-major,
`[num_layers, n, n_kv_heads, block_size, head_dim]`, so a layer's share of
the run is one contiguous slab: it becomes one slice copy into the pool.
The file is named after its last block's hash, which (hashes being chained)
names the whole prefix and so everything the file holds; `block_hashes` in
the metadata lists every block's hash, so any part of the run is found.

Metadata also holds the format version, model fingerprint, block size,
dtype, layer count, a quantized pool's KV format (`kv_format`, "q8g64":
its tensors are each vector's bytes; absent in full-precision files), the layer group the blocks belong to (absent in files
written before groups: group 0) and a checksum of the tensor bytes, named by
`checksum_algo`: XXH3-64 in files written now, CRC-32 in files written
before; both are read. Anything that does not check out raises
CorruptBlockError.

Why runs: per-file costs (open, a device round trip, a header parse) were
measured at several times the device time of one 128 KiB block; a ~2 MiB
file reads at the disk's sequential speed.
"""

from __future__ import annotations

import errno
import json
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import safetensors.numpy
import xxhash

from mlxkv.connectors.disk.file_io import LinuxIO
from mlxkv.connectors.disk.read_buffer import ReadBuffer

FORMAT = "mlxkv-kv-block"
FORMAT_VERSION = "3"  # 3: runs of blocks, layer-major (2: one block per file; 1: blake2b)
CHECKSUM_ALGO = "xxh3_64"  # what new files carry; `CHECKSUMS` says what is read
MAX_RUN_BLOCKS = 16  # a lookup probes this many names for a run holding a block
RUN_BYTES = 2 << 20  # fewer blocks per file when blocks are big
HEAD_READ = 16 << 10  # first read of a header; more only if it is longer
MAX_HEADER = 1 << 20
ALIGN = 4096  # O_DIRECT wants buffer, offset and length aligned to the device's blocks; a page is enough

_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "U16": np.uint16, "U8": np.uint8}


class CorruptBlockError(ValueError):
    """A block file that failed verification."""


@dataclass(frozen=True, slots=True)
class FileSpec:
    """What every file of one tier must say about itself."""

    fingerprint: bytes
    block_size: int
    num_layers: int
    dtype: str  # the real dtype (bfloat16 is stored as uint16 bits)
    np_dtype: np.dtype
    page: tuple[int, int, int, int] | None = None  # a page layer's (K heads, K dim, V heads, V dim); None: any
    kv_format: str | None = None  # a quantized pool's ("q8g64": the dims are bytes); None: full precision

    def fixed_metadata(self) -> dict[str, str]:
        """The fields every file of the tier has in common."""
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "fingerprint": self.fingerprint.hex(),
            "block_size": str(self.block_size),
            "num_layers": str(self.num_layers),
            "dtype": self.dtype,
        }
        return {**meta, "kv_format": self.kv_format} if self.kv_format else meta

    def metadata(self, block_hashes, shape, group: int = 0) -> dict[str, str]:
        return {
            **self.fixed_metadata(),
            "shape": "x".join(map(str, shape)),
            "block_hashes": ",".join(h.hex() for h in block_hashes),
            "group": str(group),
        }

    def block_hashes(self, meta: dict, name: bytes) -> tuple[bytes, ...]:
        """The run's block hashes, once every field but shape and checksum checks out."""
        # kv_format is absent from a full-precision file: a quantized one is never read as one.
        for field, want in {"kv_format": None, **self.fixed_metadata()}.items():
            if meta.get(field) != want:
                raise CorruptBlockError(f"metadata {field}={meta.get(field)!r}, expected {want!r}")
        return listed_hashes(meta, name)


def listed_hashes(meta: dict, name: bytes) -> tuple[bytes, ...]:
    """The block hashes a header lists, checking only that they name this file.

    The index takes them from headers without checking the rest, so that a
    file of another version or model is still found, then counted as
    corrupt when read, as a one-block file would be.
    """
    try:
        hashes = tuple(bytes.fromhex(h) for h in str(meta.get("block_hashes", "")).split(","))
    except ValueError as e:
        raise CorruptBlockError(f"block_hashes: {e}") from e
    if not hashes or len(hashes) > MAX_RUN_BLOCKS or hashes[-1] != name or any(len(h) != 32 for h in hashes):
        raise CorruptBlockError("block_hashes do not name this file")
    return hashes


def run_blocks(block_nbytes: int) -> int:
    """Blocks per file: up to MAX_RUN_BLOCKS, about RUN_BYTES a file."""
    return max(1, min(MAX_RUN_BLOCKS, RUN_BYTES // max(block_nbytes, 1)))


def _xxh3_64(parts) -> str:
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def _crc32(parts) -> str:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return f"{crc:08x}"


# Both catch torn writes and flipped bits, the faults a cache file meets,
# and both drop the GIL; XXH3 is several times faster, which matters once
# the device reads as fast as the checksum runs.
CHECKSUMS = {"xxh3_64": _xxh3_64, "crc32": _crc32}


def checksum(keys: np.ndarray, values: np.ndarray, algo: str = CHECKSUM_ALGO) -> str:
    return CHECKSUMS[algo](np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in (keys, values))


def encode(spec: FileSpec, block_hashes, keys: np.ndarray, values: np.ndarray, group: int = 0) -> bytes:
    # safetensors saves a view's underlying buffer as is: a strided view (one
    # block of a run) must be made contiguous first, or the file holds other bytes.
    keys, values = np.ascontiguousarray(keys), np.ascontiguousarray(values)
    meta = spec.metadata(block_hashes, keys.shape, group)
    meta["checksum_algo"] = CHECKSUM_ALGO
    meta["checksum"] = checksum(keys, values)
    return safetensors.numpy.save({"keys": keys, "values": values}, metadata=meta)


def read_into(path, dest: Callable[[], np.ndarray], size: int,
              staging: ReadBuffer | None = None, io=None) -> tuple[np.ndarray | None, bool | None]:
    """Read a whole file of `size` bytes into the array `dest()` gives; (the bytes read, whether
    O_DIRECT worked). `io`: the OS's read backend (file_io.py; Linux's by default).

    (None, None) if the file has another size now (replaced since it was
    indexed). The array must start ALIGN-aligned and hold `size` rounded up to
    ALIGN; it is asked for only when needed, so a read through `staging` can
    start before it exists. Read with O_DIRECT where the file system allows:
    DMA, no page cache pages to allocate and copy from, and no second copy of
    the tier in the page cache once its blocks are in MLX memory. An O_DIRECT
    read goes through `staging` when given (huge pages: see read_buffer).
    """
    io = io or LinuxIO()
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != size:
            return None, None
        direct = io.prepare(fd, size)
        staged = direct and staging is not None
        target = staging.view(-(-size // ALIGN) * ALIGN) if staged else dest()
        got = _read_all(fd, target, size, direct)
        if got is None:  # an alignment the device wants more of: read through the cache
            io.undirect(fd)
            direct, staged, target = False, False, dest()
            got = _read_all(fd, target, size, direct)
        got = min(got, size)
        if staged:
            target, staged_bytes = dest(), target
            np.copyto(target[:got], staged_bytes[:got])
        return target[:got], direct
    finally:
        os.close(fd)


def _read_all(fd: int, dest: np.ndarray, size: int, direct: bool) -> int | None:
    """Bytes read into `dest` until `size` or the end of the file; None if O_DIRECT was refused."""
    view, got = memoryview(dest), 0
    end = -(-size // ALIGN) * ALIGN if direct else size
    while got < size:
        try:
            n = _pread_into(fd, view[got:end], got)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                return None
            raise
        if n == 0:
            break  # shrank meanwhile: the parse calls it truncated
        got += n
    return got


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    os.lseek(fd, offset, os.SEEK_SET)  # no preadv (older Pythons on macOS): the fd is ours alone
    return os.readv(fd, [view])


def read_metadata(path) -> dict:
    """The metadata of a file, reading only its header."""
    fd = os.open(path, os.O_RDONLY)
    try:
        head = os.pread(fd, HEAD_READ, 0)
        n = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
        if not 0 <= n <= MAX_HEADER:
            raise CorruptBlockError("truncated header")
        if 8 + n > len(head):
            head = os.pread(fd, 8 + n, 0)
    finally:
        os.close(fd)
    if 8 + n > len(head):
        raise CorruptBlockError("truncated header")
    return _header(head, n)[0]


def _header(data, n: int) -> tuple[dict, dict]:
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptBlockError(f"unreadable header: {e}") from e
    meta = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise CorruptBlockError("no metadata")
    return meta, header


@dataclass(frozen=True, slots=True)
class RunData:
    """A file's run with its header checked: block hashes, tensor views of the bytes read,
    and the checksum the file claims (`verify` checks it)."""

    block_hashes: tuple[bytes, ...]
    keys: np.ndarray
    values: np.ndarray
    checksum_algo: str
    checksum: str
    group: int = 0  # the layer group whose pages the run holds

    def verify(self) -> None:
        if self.checksum != checksum(self.keys, self.values, self.checksum_algo):
            raise CorruptBlockError("checksum mismatch")


def parse(data: np.ndarray) -> tuple[dict, dict[str, np.ndarray]]:
    """Metadata and zero-copy tensor views of a safetensors file's bytes.

    The safetensors package copies every tensor out of the buffer; here the
    bytes stay where they were read. Every offset is checked against the buffer.
    """
    if len(data) < 8:
        raise CorruptBlockError("truncated header")
    n = int.from_bytes(bytes(data[:8]), "little")
    if n > len(data) - 8:
        raise CorruptBlockError("truncated header")
    meta, header = _header(data, n)
    tensors = {}
    for name, info in header.items():
        try:
            dtype = _NP_DTYPES.get(info["dtype"])
            start, end = (int(x) for x in info["data_offsets"])
            shape = [int(x) for x in info["shape"]]
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptBlockError(f"tensor {name!r}: {e}") from e
        count = int(np.prod(shape, dtype=np.int64))
        size_ok = dtype is not None and min(shape, default=0) >= 0 and end - start == count * np.dtype(dtype).itemsize
        if not size_ok or not 0 <= start <= end <= len(data) - 8 - n:
            raise CorruptBlockError(f"tensor {name!r}: bad dtype, shape or offsets")
        tensors[name] = np.frombuffer(data, dtype, count, 8 + n + start).reshape(shape)
    return meta, tensors


def decode(spec: FileSpec, data: np.ndarray, name: bytes) -> RunData:
    """A file's run from its bytes, every field and shape checked; the checksum is `verify`'s job."""
    meta, tensors = parse(data)
    hashes = spec.block_hashes(meta, name)
    algo = meta.get("checksum_algo")
    if algo not in CHECKSUMS:
        raise CorruptBlockError(f"checksum_algo {algo!r}")
    if set(tensors) != {"keys", "values"}:
        raise CorruptBlockError(f"tensors {sorted(tensors)}")
    keys, values = tensors["keys"], tensors["values"]
    shape = keys.shape
    if meta.get("shape") != "x".join(map(str, shape)):
        raise CorruptBlockError(f"metadata shape={meta.get('shape')!r}, tensor shape {shape}")
    if keys.dtype != spec.np_dtype or values.dtype != spec.np_dtype:
        raise CorruptBlockError(f"stored dtype {keys.dtype}/{values.dtype}")
    if len(shape) != 5 or shape[0] != spec.num_layers or shape[1] != len(hashes) or shape[3] != spec.block_size:
        raise CorruptBlockError(f"shape {shape} for {len(hashes)} blocks")
    # K and V apart: their head counts and dims may differ, never their layers, blocks or block size.
    if len(values.shape) != 5 or values.shape[:2] != shape[:2] or values.shape[3] != shape[3]:
        raise CorruptBlockError(f"values shape {values.shape} does not match keys shape {shape}")
    if spec.page is not None and (shape[2], shape[4], values.shape[2], values.shape[4]) != spec.page:
        raise CorruptBlockError(f"pages of {shape[2]}x{shape[4]} / {values.shape[2]}x{values.shape[4]}, "
                                f"expected {spec.page}")
    group = meta.get("group", "0")  # files written before layer groups hold group 0's
    if not (isinstance(group, str) and group.isdigit()):
        raise CorruptBlockError(f"metadata group={group!r}")
    return RunData(hashes, keys, values, algo, str(meta.get("checksum")), int(group))
