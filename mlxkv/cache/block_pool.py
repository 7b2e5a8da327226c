"""The block pool: ids, reference counts, free blocks and the hash -> block map.

Pure bookkeeping, no MLX: the KV bytes live in kv_pool.py at the same block
ids. A block is free when no sequence references it. A free block is
either empty (it holds nothing anyone can find) or cached (it still holds
KV under its hash, and a prefix hit takes it back). Allocation takes empty
blocks first; only then is a cached block evicted, least recently used
first, or the pool grown.

The pool starts small and grows on demand up to its budget. When an
allocation has no empty block left, it grows only if the cached block it
would evict was freed less than a pool's size of block frees ago: its
reuse distance is under the pool's size, so in LRU terms it is part of a
working set the pool cannot hold, and evicting it means recomputing it
soon. A block older than a whole turnover of the pool is the cheap loss
(and it spills to the tiers). So a working set that fits keeps its pool,
one that does not grows it, and `shrink` gives memory back when idle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mlxkv.cache.hashing import BlockHash
from mlxkv.errors import PoolExhaustedError


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    group: int = 0  # the layer group whose key block_hash is (cache/layer_groups.py)
    last_freed: int = 0  # the pool's free count when it was last freed (its recency)
    # Links of the cached free queue; None when the block is not in it.
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """A doubly linked list of free blocks, least recently used at the head.

    vLLM-style: removing a block from the middle (a prefix hit on a cached
    free block) is O(1), which a deque cannot do.
    """

    def __init__(self, blocks: Iterable[Block] = ()):
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.size = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.size += 1

    def appendleft(self, block: Block) -> None:
        first = self._head.next_free
        first.prev_free = block
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.size += 1

    @property
    def head(self) -> Block | None:
        """The least recently used free block (the next one taken), or None."""
        return self._head.next_free if self.size else None

    def remove(self, block: Block) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.size -= 1

    def popleft(self) -> Block:
        if self.size == 0:
            raise IndexError("no free block")
        block = self._head.next_free
        self.remove(block)
        return block

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.size


# Called with the cached blocks an allocation is about to reuse, least
# recently used first, before their bytes are overwritten.
EvictHook = Callable[[list[Block]], None]
# Called with (old id, new id) moves and the new size when the pool shrinks.
ShrinkHook = Callable[[list[tuple[int, int]], int], None]

# Growth: at least this many blocks at a time, or half the pool's size.
GROW_MIN_BLOCKS = 16
GROW_FACTOR = 1.5
# Grow rather than evict a cached block freed within this share of the pool's size ago (in block frees).
GROW_IF_RECENT = 1.0


class BlockPool:
    """Owns every local block. Connectors are told of evictions, never own blocks."""

    def __init__(self, budget: int, *, initial: int | None = None, on_evict: EvictHook | None = None,
                 on_grow: Callable[[int], None] | None = None, on_shrink: ShrinkHook | None = None):
        if budget < 1:
            raise ValueError("a block pool needs at least one block")
        self.budget = budget  # the most blocks the pool will hold
        self.blocks = [Block(i) for i in range(min(initial or budget, budget))]
        self._empty: list[Block] = self.blocks[::-1]  # a stack: the lowest id is taken first
        self._cached_free = FreeBlockQueue()
        self.cached: dict[BlockHash, Block] = {}
        self.on_evict = on_evict
        self.on_grow = on_grow  # makes the bytes of blocks up to a new size (KVPool.grow)
        self.on_shrink = on_shrink  # moves kept blocks' bytes and cuts the arrays (KVPool.shrink)
        self.evictions = 0
        self.frees = 0  # blocks freed so far: the clock of `Block.last_freed`
        # Bumped whenever the hash map changes: a prefix lookup stays valid while it does not.
        self.generation = 0
        self.peak_in_use = 0  # since the last shrink

    @property
    def size(self) -> int:
        """Blocks made so far."""
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have: free ones, and ones the pool can still make."""
        return len(self._empty) + len(self._cached_free) + self.budget - self.size

    @property
    def in_use(self) -> int:
        return self.size - len(self._empty) - len(self._cached_free)

    def free_blocks(self) -> list[Block]:
        """Every free block: the empty ones, then the cached ones least recently used first."""
        return self._empty[::-1] + list(self._cached_free)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference to each block, pulling free ones out of the cached queue."""
        for block in blocks:
            if block.ref_count == 0:
                self._cached_free.remove(block)
            block.ref_count += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)

    def allocate(self, n: int) -> list[Block]:
        """Take n free blocks: empty ones, then grown or evicted ones (see the module's doc)."""
        if n > self.num_free:
            raise PoolExhaustedError(
                f"KV pool exhausted: need {n} free blocks, {self.num_free} of "
                f"{self.budget} are free; raise --num-blocks or shorten the prompt"
            )
        taken = self._take_empty(n)
        victims: list[Block] = []
        try:
            short = n - len(taken)
            if short and self.size < self.budget and (short > len(self._cached_free) or self._victim_is_recent()):
                self._grow(short)
                taken += self._take_empty(short)
            victims = [self._cached_free.popleft() for _ in range(n - len(taken))]
            if victims and self.on_evict is not None:
                self.on_evict(victims)  # all at once: one read of the pool
        except BaseException:
            # A growth or the hook failed: hand nothing out and put every block back.
            self._empty += taken[::-1]
            for block in reversed(victims):
                self._cached_free.appendleft(block)
            raise
        self._forget(victims)
        taken += victims
        for block in taken:
            block.ref_count = 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return taken

    def _take_empty(self, n: int) -> list[Block]:
        return [self._empty.pop() for _ in range(min(n, len(self._empty)))]

    def _victim_is_recent(self) -> bool:
        """Whether the next cached block to evict was freed within GROW_IF_RECENT of the pool's size ago."""
        return self.frees - self._cached_free.head.last_freed < GROW_IF_RECENT * self.size

    def _grow(self, wanted: int) -> None:
        """Make at least `wanted` more blocks (a chunk): empty, so taken first."""
        size = self.size
        new_size = min(self.budget, max(size + wanted, size + GROW_MIN_BLOCKS, int(size * GROW_FACTOR)))
        if self.on_grow is not None:
            self.on_grow(new_size)  # may fail (no memory): nothing has changed here then
        fresh = [Block(i) for i in range(size, new_size)]
        self.blocks += fresh
        self._empty += fresh[::-1]

    def _forget(self, victims: list[Block]) -> None:
        for block in victims:
            del self.cached[block.block_hash]
            block.block_hash = None
        if victims:
            self.evictions += len(victims)
            self.generation += 1

    def register(self, blocks: Iterable[Block], block_hashes: Iterable[BlockHash], group: int = 0) -> list[Block]:
        """Register full blocks of one layer group under their hashes; returns the newly registered ones.

        If a hash is already registered to another block (two sequences computed
        the same prefix), the first block keeps it and this one stays private.
        """
        newly = []
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None or block_hash in self.cached:
                continue
            block.block_hash, block.group = block_hash, group
            self.cached[block_hash] = block
            newly.append(block)
        if newly:
            self.generation += 1
        return newly

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in the order given.

        Callers pass a sequence's blocks tail first, so its last blocks (the
        least likely to be a prefix of anything) are evicted first.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_count -= 1
            if block.ref_count:
                continue
            self.frees += 1
            block.last_freed = self.frees
            if block.block_hash is None:
                self._empty.append(block)
            else:
                self._cached_free.append(block)

    def shrink(self, keep_cached: int, min_size: int = GROW_MIN_BLOCKS) -> int:
        """Give memory back while no block is in use: keep the `keep_cached` most recently
        used cached blocks (moved to the lowest ids), evict the others (they spill),
        and cut the pool to what is kept, at least `min_size`. Returns the new size."""
        if self.in_use:
            raise ValueError("the pool shrinks only while no block is in use")
        cached = list(self._cached_free)
        keep = cached[len(cached) - min(keep_cached, len(cached)):]
        new_size = min(self.size, max(len(keep), min_size))
        if new_size >= self.size:
            return self.size
        gone = cached[: len(cached) - len(keep)]
        if gone and self.on_evict is not None:
            self.on_evict(gone)
        self._forget(gone)
        moves = [(block.block_id, new_id) for new_id, block in enumerate(keep)]
        if self.on_shrink is not None:
            self.on_shrink([m for m in moves if m[0] != m[1]], new_size)
        for block, (_, new_id) in zip(keep, moves):
            block.block_id = new_id
        self.blocks = keep + [Block(i) for i in range(len(keep), new_size)]
        self._empty = self.blocks[len(keep):][::-1]
        self._cached_free = FreeBlockQueue(keep)
        self.peak_in_use = 0
        return new_size

    def block_states(self) -> str:
        """One character per block id: '.' free, 'c' cached and free, 'u' in use, 's' shared."""
        def state(b: Block) -> str:
            if b.ref_count > 1:
                return "s"
            if b.ref_count == 1:
                return "u"
            return "c" if b.block_hash is not None else "."

        return "".join(state(b) for b in self.blocks)

    def usage(self) -> dict[str, int]:
        return {
            "size_blocks": self.size,
            "budget_blocks": self.budget,
            "free": len(self._empty),
            "cached_free": len(self._cached_free),
            "in_use": self.in_use,
            "shared": sum(1 for b in self.blocks if b.ref_count > 1),
            "cached": len(self.cached),
            "evictions": self.evictions,
        }
