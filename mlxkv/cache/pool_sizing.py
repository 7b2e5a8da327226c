"""How many blocks the pool gets: asked for, from a byte budget, or a share of memory."""

from __future__ import annotations

from mlxkv.cache.block_pool import GROW_MIN_BLOCKS
from mlxkv.cache.kv_pool import KVLayout
from mlxkv.cache.groups.base import blocks_for
from mlxkv.config import DEFAULT_MEMORY_SHARE, EngineConfig, PoolConfig
from mlxkv.errors import MlxkvError
from mlxkv.system.machine import physical_memory
from mlxkv.system.wired import MLXDevice

# Without a size from the user, never hold more than this many full contexts.
MAX_DEFAULT_CONTEXTS = 16
DEFAULT_CONTEXT = 8192  # for a model that does not say
# The budget of a pool whose blocks hold no bytes (a model of state slots
# alone): nothing allocates them, and the scheduler's room is never short.
STATELESS_BLOCKS = 1 << 20


def checkpoint_budget(cfg: EngineConfig, layout: KVLayout, num_blocks: int) -> int:
    """Bytes for a hybrid model's state checkpoints: their share of the pool's budget.

    The blocks got the rest of that budget (size_pool), so the checkpoints
    are `share / (1 - share)` of what the blocks take.
    """
    share = cfg.checkpoints.share
    if not layout.bytes_per_block:  # state slots alone (Mamba): the checkpoints are the whole cache
        return cfg.pool.memory_budget_bytes or int(_usable_memory(physical_memory(), None) * DEFAULT_MEMORY_SHARE)
    return int(num_blocks * layout.bytes_per_block * share / (1 - share))


def size_pool(cfg: EngineConfig, layout: KVLayout, max_context: int | None, device=None) -> int:
    """The pool's budget in blocks (it grows to it on demand); never more than the machine's memory holds.

    On a Mac the default share is of the GPU's recommended working set when
    that is less than the memory. A hybrid model's blocks take the budget
    less its checkpoints' share; --num-blocks is taken as asked.
    """
    if not layout.bytes_per_block:
        return STATELESS_BLOCKS  # no attention slots: blocks hold nothing, only hashes name prefixes
    memory = physical_memory()
    blocks = _pool_blocks(cfg.pool, layout, max_context, _usable_memory(memory, device))
    if layout.group_layout.has_recurrent and cfg.pool.num_blocks is None:
        blocks = max(1, int(blocks * (1 - cfg.checkpoints.share)))
    need = blocks * layout.bytes_per_block
    if need > memory:
        # (machine.py: an allocation MLX cannot make is a segmentation fault)
        raise MlxkvError(
            f"a KV pool of {blocks:,} block{'s' * (blocks != 1)} of {layout.block_size:,} tokens needs "
            f"{need / 2**30:,.1f} GiB, "
            f"more than this machine's {memory / 2**30:,.1f} GiB; lower --num-blocks or --block-size"
        )
    return blocks


def _pool_blocks(cfg: PoolConfig, layout: KVLayout, max_context: int | None, memory: int) -> int:
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    if cfg.memory_budget_bytes is not None:
        blocks = cfg.memory_budget_bytes // layout.bytes_per_block
        if blocks < 1:
            raise MlxkvError(
                f"memory budget of {cfg.memory_budget_bytes} bytes holds no block "
                f"({layout.bytes_per_block} bytes each)"
            )
        return blocks
    share = int(memory * DEFAULT_MEMORY_SHARE) // layout.bytes_per_block
    contexts = MAX_DEFAULT_CONTEXTS * blocks_for(max_context or DEFAULT_CONTEXT, layout.block_size)
    return max(1, min(share, contexts))


def _usable_memory(memory: int, device) -> int:
    """Physical memory, or the Metal device's recommended working set where that is less."""
    device = device or MLXDevice()
    if not device.is_metal():
        return memory
    return min(memory, device.recommended_bytes())


def initial_blocks(budget: int) -> int:
    """Blocks the pool starts with: a growth step's worth, not the budget."""
    return min(budget, GROW_MIN_BLOCKS)
