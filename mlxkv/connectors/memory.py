"""The unified-memory tier: evicted blocks' K/V kept outside the pool.

LRU per block under a byte budget. Optionally 8-bit quantized (`mx.quantize`
along the head dim, groups of 32) to hold 1.78x as many fp16 blocks (3.2x
fp32; 4 bits: 3.2x and 5.3x), at a small cost in accuracy.

Exact blocks live in layer-major `KVRun`s, so a hydrate copies a stretch of
blocks into the pool with one slice per layer. The blocks one allocation
evicts arrive as one run, read from the pool at once, and are kept as it
(cut to at most MAX_RUN_BLOCKS); so are runs that arrive whole (an SSD hit
being promoted). Blocks that arrive alone wait as one-block runs until
enough of them are packed into one. The budget counts the bytes runs
really hold: a run stays in memory until its last block is dropped.
A hybrid model's state checkpoints share the one LRU and budget, exact.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
import mlx.core as mx

from mlxkv.cache.block_kv import BlockKV, KVRun
from mlxkv.cache.checkpoints import Checkpoint
from mlxkv.cache.connector import LoadedBlock, LoadedCheckpoint, TierStats
from mlxkv.errors import MlxkvError
from mlxkv.cache.hashing import BlockHash
from mlxkv.cache.tiers import MEMORY
from mlxkv.connectors.health import OK

QUANT_GROUP = 32
# Evicted blocks packed per run. Each run costs one slice update per layer
# and side on a hydrate (~15 us each on CPU), so longer is faster; but a run
# leaves memory whole, so it stays a small share of the budget.
MAX_RUN_BLOCKS = 64
RUN_BYTES = 8 << 20
RUN_SHARE = 16  # a run is at most 1/RUN_SHARE of the budget


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


class InMemoryKVCacheConnector:
    def __init__(
        self,
        budget_bytes: int,
        block_size: int,
        quantize_bits: int | None = None,
        on_evict: Callable[[BlockHash, BlockKV], None] | None = None,
        tier_name: str = MEMORY,
        on_evict_checkpoint: Callable[[Checkpoint], None] | None = None,
    ):
        if quantize_bits not in (None, 4, 8):
            raise MlxkvError(f"memory tier quantization must be 4 or 8 bits, got {quantize_bits}")
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.quantize_bits = quantize_bits
        self.on_evict = on_evict  # where blocks pushed out of this tier go
        self.on_evict_checkpoint = on_evict_checkpoint  # and checkpoints
        self.tier_name = tier_name
        # LRU first. Exact blocks are views of KVRuns; quantized ones (K, V) pairs.
        self._blocks: OrderedDict[BlockHash, BlockKV | tuple] = OrderedDict()
        self._live: dict[int, list] = {}  # id(run) -> [run, blocks held in it]
        self._loose: list[BlockHash] = []  # held in one-block runs, waiting to be packed
        self._stats = TierStats()

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def leading(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks this tier holds, without counting a lookup."""
        n = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        self._stats.lookups += 1
        n = self.leading(block_hashes)
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

    def has_checkpoint(self, key: BlockHash) -> bool:
        return isinstance(self._blocks.get(key), Checkpoint)

    def load_checkpoint(self, key: BlockHash) -> LoadedCheckpoint | None:
        held = self._blocks.get(key)
        if not isinstance(held, Checkpoint):
            return None
        self._blocks.move_to_end(key)
        self._stats.hydrations += 1
        return LoadedCheckpoint(key, held.states, self.tier_name)

    def cache_checkpoint(self, checkpoint: Checkpoint) -> None:
        pass  # as with blocks: the pool's store holds it; this tier takes it on eviction

    def evict_checkpoint(self, checkpoint: Checkpoint) -> None:
        if checkpoint.key in self._blocks:
            self._blocks.move_to_end(checkpoint.key)
        elif self._keep(checkpoint.key, checkpoint):
            self._stats.spills += 1

    def checkpoint_refs(self):
        return []  # it holds only what this process's store let go of

    def wants_spill(self, block_hash: BlockHash) -> bool:
        """An evicted block's bytes are wanted unless held already (then it is touched, as a spill would)."""
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return False
        return True

    def evict_blocks(self, block_hashes: Sequence[BlockHash], read) -> None:
        wanted = []
        for i, h in enumerate(block_hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)  # still here from an earlier spill
            else:
                wanted.append(i)
        if not wanted:
            return
        everything = read()
        blocks = self._in_runs([everything[i] for i in wanted])
        for i, kv in zip(wanted, blocks):
            if self.store(block_hashes[i], kv):
                self._stats.spills += 1

    def _in_runs(self, blocks: list[BlockKV]) -> list[BlockKV]:
        """The evicted blocks as views of runs no longer than this tier keeps whole.

        One read of the pool is one run; a run leaves memory only with its
        last block, so a long one is cut into copies of at most a run's length.
        """
        limit = self._run_blocks(blocks[0].nbytes)
        run = blocks[0].run
        if limit < 1 or run is None or len(run) <= limit:
            return blocks
        # Cut in the read's order (the prefix's), whatever order they came in.
        order = sorted(range(len(blocks)), key=lambda i: blocks[i].index)
        cut: list[BlockKV | None] = [None] * len(blocks)
        runs = []
        for start in range(0, len(order), limit):
            chunk = order[start : start + limit]
            runs.append(KVRun.stack([blocks[i] for i in chunk]))
            for j, i in enumerate(chunk):
                cut[i] = runs[-1].block(j, blocks[i].group)
        mx.eval([(r.keys, r.values) for r in runs])
        return cut

    def store(self, block_hash: BlockHash, kv: BlockKV) -> bool:
        """Keep `kv` (its run, when it is a view of one that fits); push LRU blocks out past the budget."""
        if not self._keep(block_hash, self._pack(kv)):
            return False
        run_blocks = self._run_blocks(kv.nbytes)
        if run_blocks > 1 and len(self._loose) >= run_blocks:
            self._pack_loose()
        return True

    def _keep(self, key: BlockHash, stored) -> bool:
        """Hold a packed block or a checkpoint, pushing the least recently used out past the budget."""
        if self._nbytes(stored) > self.budget_bytes:
            return False
        if key in self._blocks:
            self._drop(key)
        self._blocks[key] = stored
        self._hold(key, stored)
        self._stats.stores += 1
        while self._stats.bytes_held > self.budget_bytes:
            old_key = next(iter(self._blocks))
            old = self._drop(old_key)
            self._stats.evictions += 1
            if isinstance(old, Checkpoint):
                if self.on_evict_checkpoint is not None:
                    self.on_evict_checkpoint(old)
            elif self.on_evict is not None:
                self.on_evict(old_key, self._restore(old))
        return True

    def _pack(self, kv: BlockKV):
        if self.quantize_bits is not None:
            if kv.keys.shape[-1] % QUANT_GROUP or kv.values.shape[-1] % QUANT_GROUP:
                raise MlxkvError(f"memory tier quantization needs a head dim divisible by {QUANT_GROUP}")
            return (_Quantized(kv.keys, self.quantize_bits), _Quantized(kv.values, self.quantize_bits), kv.group)
        if kv.run is not None and kv.run.nbytes <= self.budget_bytes:
            return kv  # share the run: no copy
        run = KVRun(kv.keys[:, None], kv.values[:, None])
        if kv.run is not None:  # a view of a run too big to keep: copy the block out
            run = KVRun(mx.contiguous(run.keys), mx.contiguous(run.values))
            mx.eval(run.keys, run.values)
        return run.block(0, kv.group)

    def _hold(self, block_hash: BlockHash, stored) -> None:
        if isinstance(stored, Checkpoint):
            self._stats.bytes_held += stored.nbytes
            self._stats.checkpoints += 1
            return
        self._stats.blocks_held += 1
        if isinstance(stored, tuple):
            self._stats.bytes_held += self._nbytes(stored)
            return
        entry = self._live.setdefault(id(stored.run), [stored.run, 0])
        entry[1] += 1
        if entry[1] == 1:
            self._stats.bytes_held += stored.run.nbytes
        if len(stored.run) == 1:
            self._loose.append(block_hash)

    def _drop(self, block_hash: BlockHash):
        stored = self._blocks.pop(block_hash)
        if isinstance(stored, Checkpoint):
            self._stats.bytes_held -= stored.nbytes
            self._stats.checkpoints -= 1
            return stored
        self._stats.blocks_held -= 1
        if isinstance(stored, tuple):
            self._stats.bytes_held -= self._nbytes(stored)
            return stored
        entry = self._live[id(stored.run)]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[id(stored.run)]
            self._stats.bytes_held -= stored.run.nbytes
        if len(stored.run) == 1:
            self._loose.remove(block_hash)
        return stored

    def _run_blocks(self, block_nbytes: int) -> int:
        block_nbytes = max(block_nbytes, 1)
        return min(MAX_RUN_BLOCKS, RUN_BYTES // block_nbytes, self.budget_bytes // (RUN_SHARE * block_nbytes))

    def _pack_loose(self) -> None:
        """Copy the one-block runs into one run, in reverse arrival order.

        The pool evicts a freed sequence's blocks last first, so reversed they
        are in prompt order, the order a hydrate asks for them.
        """
        hashes = self._loose[::-1]
        run = KVRun.stack([self._blocks[h] for h in hashes])
        mx.eval(run.keys, run.values)
        for i, h in enumerate(hashes):
            old = self._live.pop(id(self._blocks[h].run), None)
            if old is not None:
                self._stats.bytes_held -= old[0].nbytes
            self._blocks[h] = run.block(i, self._blocks[h].group)  # same key: the LRU order stays
        self._live[id(run)] = [run, len(hashes)]
        self._stats.bytes_held += run.nbytes
        self._loose = []

    def _restore(self, stored) -> BlockKV:
        if isinstance(stored, BlockKV):
            return stored
        k, v, group = stored
        return BlockKV(k.restore(), v.restore(), group=group)

    @staticmethod
    def _nbytes(stored) -> int:
        if isinstance(stored, Checkpoint):
            return stored.nbytes
        if isinstance(stored, BlockKV):
            return stored.run.nbytes
        k, v, _ = stored
        return k.nbytes + v.nbytes

    def stats(self) -> dict[str, dict]:
        return {self.tier_name: {**self._stats.as_dict(), "state": OK, "reason": None}}  # never degrades

    def close(self) -> None:
        pass
