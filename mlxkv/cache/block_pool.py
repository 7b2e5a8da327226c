"""The block pool: ids, reference counts, LRU free queue and prefix lookup.

Pure bookkeeping, no MLX: the KV bytes live in kv_pool.py at the same block
ids. A block is free when no sequence references it. A free block may still
hold cached KV (it has a hash); such blocks are evicted least recently used
first when a new block is needed.

The pool starts small and grows on demand up to its budget (`num_blocks`):
an allocation that would otherwise evict a cached block, or find none,
first adds blocks (`on_grow` makes their bytes), so memory is taken as
sequences need it, not all before the first token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mlxkv.errors import PoolExhaustedError
from mlxkv.cache.hashing import BlockHash


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    group: int = 0  # the layer group whose key block_hash is (cache/layer_groups.py)
    # Links of the free queue; None when the block is not in it.
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """A doubly linked list of free blocks, least recently used at the head.

    vLLM-style: removing a block from the middle (a prefix hit on a cached
    free block) is O(1), which a deque cannot do.
    """

    def __init__(self, blocks: Iterable[Block]):
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


# Growth: at least this many blocks at a time, or half the pool's size.
GROW_MIN_BLOCKS = 16
GROW_FACTOR = 1.5


class BlockPool:
    """Owns every local block. Connectors are told of evictions, never own blocks."""

    def __init__(self, num_blocks: int, on_evict: EvictHook | None = None, initial: int | None = None,
                 on_grow: Callable[[int], None] | None = None):
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.budget = num_blocks
        self.blocks = [Block(i) for i in range(min(initial or num_blocks, num_blocks))]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, Block] = {}
        self.on_evict = on_evict
        self.on_grow = on_grow  # makes the bytes of blocks up to a new size (KVPool.grow)
        self.evictions = 0

    @property
    def num_blocks(self) -> int:
        """The budget: the most blocks the pool will hold."""
        return self.budget

    @property
    def size(self) -> int:
        """Blocks made so far."""
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have: free ones, and ones the pool can still make."""
        return len(self.free_queue) + self.budget - self.size

    def _grow(self, wanted: int) -> None:
        """Make at least `wanted` more blocks (a chunk), at the head of the free queue: used first."""
        size = self.size
        new_size = min(self.budget, max(size + wanted, size + GROW_MIN_BLOCKS, int(size * GROW_FACTOR)))
        if self.on_grow is not None:
            self.on_grow(new_size)  # may fail (no memory): nothing has changed here then
        fresh = [Block(i) for i in range(size, new_size)]
        self.blocks += fresh
        for block in reversed(fresh):
            self.free_queue.appendleft(block)

    def get_computed_blocks(self, block_hashes: Iterable[BlockHash]) -> list[Block]:
        """The cached blocks for the longest run of leading hashes."""
        hits = []
        for block_hash in block_hashes:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference to each block, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def allocate(self, n: int) -> list[Block]:
        """Take n free blocks, evicting the least recently used cached ones."""
        if n > self.num_free:
            raise PoolExhaustedError(
                f"KV pool exhausted: need {n} free blocks, {self.num_free} of "
                f"{self.num_blocks} are free; raise --num-blocks or shorten the prompt"
            )
        taken = []
        try:
            while len(taken) < n:
                head = self.free_queue.head
                if (head is None or head.block_hash is not None) and self.size < self.budget:
                    self._grow(n - len(taken))  # grow rather than evict
                    continue
                taken.append(self.free_queue.popleft())
            evicted = [b for b in taken if b.block_hash is not None]
            if evicted and self.on_evict is not None:
                self.on_evict(evicted)  # all at once: one read of the pool
        except BaseException:
            # A growth or the hook failed: hand nothing out and put every
            # taken block back where it was, so no block is lost.
            for block in reversed(taken):
                self.free_queue.appendleft(block)
            raise
        for block in evicted:
            del self.cached[block.block_hash]
            block.block_hash = None
        self.evictions += len(evicted)
        for block in taken:
            block.ref_count = 1
        return taken

    def cache_blocks(self, blocks: Iterable[Block], block_hashes: Iterable[BlockHash], group: int = 0) -> list[Block]:
        """Register full blocks of one layer group under their hashes; returns the newly cached ones.

        If a hash is already cached by another block (two sequences computed
        the same prefix), the first block keeps it and this one stays private.
        """
        newly = []
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None or block_hash in self.cached:
                continue
            block.block_hash, block.group = block_hash, group
            self.cached[block_hash] = block
            newly.append(block)
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
            if block.ref_count == 0:
                self.free_queue.append(block)

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
        cached_free = sum(1 for b in self.free_queue if b.block_hash is not None)
        in_use = self.size - len(self.free_queue)
        shared = sum(1 for b in self.blocks if b.ref_count > 1)
        return {
            "num_blocks": self.size,
            "budget_blocks": self.budget,
            "free": len(self.free_queue) - cached_free,
            "cached_free": cached_free,
            "in_use": in_use,
            "shared": shared,
            "cached": len(self.cached),
            "evictions": self.evictions,
        }
