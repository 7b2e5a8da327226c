"""The unified-memory tier: evicted blocks' K/V kept outside the pool.

LRU under a byte budget. Optionally 8-bit quantized (`mx.quantize` along the
head dim) to hold about twice as many blocks, at a small cost in accuracy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import mlx.core as mx

from mlxkv.connectors.base import BlockKV, LoadedBlock, TierStats
from mlxkv.errors import MlxkvError
from mlxkv.hashing import BlockHash

QUANT_GROUP = 32


class _Quantized:
    """A K or V tensor stored as 8-bit groups along its last axis."""

    def __init__(self, x: mx.array, bits: int):
        self.shape, self.dtype, self.bits = x.shape, x.dtype, bits
        self.parts = mx.quantize(x.reshape(-1, x.shape[-1]), group_size=QUANT_GROUP, bits=bits)
        mx.eval(self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def restore(self) -> mx.array:
        x = mx.dequantize(*self.parts, group_size=QUANT_GROUP, bits=self.bits)
        return x.reshape(self.shape).astype(self.dtype)


class InMemoryKvCacheConnector:
    def __init__(
        self,
        budget_bytes: int,
        block_size: int,
        quantize_bits: int | None = None,
        on_evict: Callable[[BlockHash, BlockKV], None] | None = None,
        tier_name: str = "memory",
    ):
        if quantize_bits not in (None, 4, 8):
            raise MlxkvError(f"memory tier quantization must be 4 or 8 bits, got {quantize_bits}")
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.quantize_bits = quantize_bits
        self.on_evict = on_evict  # where blocks pushed out of this tier go
        self.tier_name = tier_name
        self._blocks: OrderedDict[BlockHash, tuple] = OrderedDict()
        self._stats = TierStats()

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        self._stats.lookups += 1
        n = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            n += 1
        self._stats.hit_blocks += n
        self._stats.hit_tokens += n * self.block_size
        return n

    def load_blocks(self, block_hashes: Sequence[BlockHash]) -> list[LoadedBlock]:
        loaded = []
        for h in block_hashes:
            stored = self._blocks.get(h)
            if stored is None:
                break
            self._blocks.move_to_end(h)
            loaded.append(LoadedBlock(h, self._restore(stored), self.tier_name))
        self._stats.hydrations += len(loaded)
        return loaded

    def cache_blocks(self, block_hashes, read) -> None:
        pass  # the pool holds registered blocks; this tier takes them on eviction

    def evict_block(self, block_hash: BlockHash, read) -> None:
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)  # still here from an earlier spill
            return
        if self.store(block_hash, read()[0]):
            self._stats.spills += 1

    def store(self, block_hash: BlockHash, kv: BlockKV) -> bool:
        """Keep a copy of `kv`; push least recently used blocks out past the budget."""
        stored = self._pack(kv)
        size = self._nbytes(stored)
        if size > self.budget_bytes:
            return False
        if block_hash in self._blocks:
            self._drop(block_hash)
        self._blocks[block_hash] = stored
        self._stats.stores += 1
        self._stats.bytes_held += size
        self._stats.blocks_held += 1
        while self._stats.bytes_held > self.budget_bytes:
            old_hash = next(iter(self._blocks))
            old = self._drop(old_hash)
            self._stats.evictions += 1
            if self.on_evict is not None:
                self.on_evict(old_hash, self._restore(old))
        return True

    def _drop(self, block_hash: BlockHash):
        stored = self._blocks.pop(block_hash)
        self._stats.bytes_held -= self._nbytes(stored)
        self._stats.blocks_held -= 1
        return stored

    def _pack(self, kv: BlockKV) -> tuple:
        if self.quantize_bits is None:
            return (kv.keys, kv.values)
        if kv.keys.shape[-1] % QUANT_GROUP or kv.values.shape[-1] % QUANT_GROUP:
            raise MlxkvError(f"memory tier quantization needs a head dim divisible by {QUANT_GROUP}")
        return (_Quantized(kv.keys, self.quantize_bits), _Quantized(kv.values, self.quantize_bits))

    def _restore(self, stored: tuple) -> BlockKV:
        k, v = stored
        if self.quantize_bits is None:
            return BlockKV(k, v)
        return BlockKV(k.restore(), v.restore())

    @staticmethod
    def _nbytes(stored: tuple) -> int:
        return sum(part.nbytes for part in stored)

    def stats(self) -> dict[str, dict[str, int]]:
        return {self.tier_name: self._stats.as_dict()}

    def close(self) -> None:
        pass
