"""How well a kernel reads the KV pools: coalescing and bytes read, from a load trace.

Decode attention is bound by memory, so what decides its speed on a GPU
is how each simdgroup-wide load maps onto memory transactions. The
harness runs the exact generated source with one OS thread per Metal
thread and records every load from the pools (Harness.trace); this module
puts the 32 lanes' loads back together:

- A lane's *access* is its run of consecutive loads, each starting where
  the last ended, up to 16 bytes (the Metal compiler merges a lane's
  contiguous loads into one vector load; MLX's `sdpa_vector` relies on it).
- A *simdgroup load* is the accesses of one simdgroup's lanes at the same
  point of the program: the same count of barriers and simd operations
  passed (lanes meet at each), the same source line (return address of
  the access's first load) and the same occurrence of it since that point.
- coalescing = bytes the lanes use / bytes of the 64-byte segments they
  touch, summed over the simdgroup loads of a pass (K or V);
- bytes_ratio = bytes read / the minimum, every visible K (or V) byte once
  per KV head. Above 1: something is read twice, or read and not needed.

It models transactions, not caches: a segment touched again by the next
load counts again, as it costs an L1 transaction on the GPU.
"""

from __future__ import annotations

import numpy as np

SIMD_WIDTH = 32
SEGMENT = 64  # bytes per memory transaction
MAX_ACCESS = 16  # bytes a lane loads at once


def efficiency(records: np.ndarray, minimum_bytes: int, max_access: int = MAX_ACCESS) -> dict:
    """{coalescing, bytes_ratio, bytes_read, bytes_minimum, segments} of one buffer's loads;
    `max_access`: the widest access a lane's contiguous loads merge into."""
    if records.size == 0:
        raise ValueError("no loads were traced from the buffer")
    access = _accesses(records, max_access)
    load = _simdgroup_loads(access)
    # Every byte of every access, tagged with its simdgroup load.
    sizes = access["size"].astype(np.int64)
    starts = np.repeat(access["offset"].astype(np.int64), sizes)
    within = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    tagged = (np.repeat(load, sizes) << 40) | (starts + within)
    used = np.unique(tagged)
    segments = np.unique((used >> 40 << 40) | ((used & ((1 << 40) - 1)) // SEGMENT)).size
    return {
        "coalescing": used.size / (segments * SEGMENT),
        "bytes_ratio": used.size / minimum_bytes,
        "bytes_read": int(used.size),
        "bytes_minimum": int(minimum_bytes),
        "segments": int(segments),
    }


def _accesses(records: np.ndarray, max_access: int) -> np.ndarray:
    """Each lane's loads merged into accesses (see the module docstring), in lane order."""
    # Each thread's records are contiguous and in program order; keep that order.
    r = records[np.lexsort((records["thread"], records["group"]))]
    size = r["size"].astype(np.int64)
    offset = r["offset"].astype(np.int64)
    same_lane = np.zeros(r.size, bool)
    same_lane[1:] = ((r["group"][1:] == r["group"][:-1]) & (r["thread"][1:] == r["thread"][:-1])
                     & (r["epoch"][1:] == r["epoch"][:-1]))
    chained = same_lane.copy()
    chained[1:] &= offset[1:] == offset[:-1] + size[:-1]
    # Byte position of each load in its chain of contiguous loads; a chain
    # is cut into accesses of max_access bytes.
    chain = np.cumsum(~chained)
    before = np.cumsum(size) - size
    chain_start = before[np.flatnonzero(~chained)][chain - 1]
    piece = (before - chain_start) // max_access
    new = ~chained
    new[1:] |= piece[1:] != piece[:-1]
    first = np.flatnonzero(new)
    out = r[first].copy()
    out["size"] = np.add.reduceat(size, first)  # fits: at most max_access + one load
    return out


def _simdgroup_loads(access: np.ndarray) -> np.ndarray:
    """An id per access: the simdgroup load it belongs to."""
    lane_key = np.stack([access["group"], access["thread"], access["epoch"], access["site"]]).astype(np.int64)
    order = np.lexsort(lane_key[::-1])  # stable: a lane's accesses at one site keep their order
    k = lane_key[:, order]
    starts = np.ones(order.size, bool)
    starts[1:] = (k[:, 1:] != k[:, :-1]).any(axis=0)
    run_start = np.maximum.accumulate(np.where(starts, np.arange(order.size), 0))
    occurrence = np.empty(order.size, np.int64)
    occurrence[order] = np.arange(order.size) - run_start
    key = np.stack([access["group"].astype(np.int64), access["thread"].astype(np.int64) // SIMD_WIDTH,
                    access["epoch"].astype(np.int64), access["site"].astype(np.int64), occurrence])
    _, ids = np.unique(key, axis=1, return_inverse=True)
    return ids.reshape(-1).astype(np.int64)


# ---- one instantiation -----------------------------------------------------------------

CONTEXTS = (1000, 333)  # two rows, both ending mid-block; many tokens per simdgroup
N_KV_HEADS = 2
# decode_launch's inputs: each pass's buffer (a quantized pool's: its records).
PASSES = (("k", 1), ("v", 2))


def _launch(inst, contexts=CONTEXTS, decode_kernel=None):
    """A case of this instantiation and its launch, partitioned as the engine would."""
    from mlxkv.attention import kernels
    from mlxkv.attention.gpu_size import DEFAULT_CORES, GPUSize
    from msl.paged import launch_of

    case = inst.case(n_kv_heads=N_KV_HEADS, context_lens=contexts, seed=inst.head_dim + inst.rows)
    # A fixed GPU, so that the figures do not depend on the machine.
    partition = kernels.partition_size(len(contexts), N_KV_HEADS, max(contexts), GPUSize(DEFAULT_CORES))
    return case, launch_of(case, partition, decode_kernel)


def build(harness, inst) -> None:
    """Compile the traced binary of one instantiation (to do it in parallel beforehand)."""
    _, launch = _launch(inst, contexts=(8,))
    harness.build(harness.translation_unit(launch), traced=True)


def _minimum_row_bytes(case, inst) -> int:
    """Bytes of one K (or V) row: the least a pass reads per visible token and kv head (a
    quantized row's record: its packed words, scales and biases)."""
    return case.k_pool.shape[-1] * case.k_pool.dtype.size


def instantiation_rows(harness, inst, contexts=CONTEXTS, decode_kernel=None) -> list[dict]:
    """Rows {instantiation, head_dim, pass, coalescing, bytes_ratio, ...} for the K and V
    passes of one decode instantiation (`decode_kernel`: a replacement kernel object).
    A quantized pass reads its records: words, scales and biases all count."""
    case, launch = _launch(inst, contexts, decode_kernel)
    _, records = harness.trace(launch, tuple(b for _, b in PASSES))
    minimum = sum(contexts) * N_KV_HEADS * _minimum_row_bytes(case, inst)
    rows = []
    for pass_, buffer in PASSES:
        found = efficiency(records[records["buffer"] == buffer], minimum)
        rows.append({"instantiation": inst.id, "head_dim": inst.head_dim, "pass": pass_, **found,
                     "dtype": str(inst.dtype).removeprefix("mlx.core."), "rows": inst.rows,
                     "block_size": inst.block_size, "multi": inst.multi, "bits": inst.bits,
                     "queries": inst.shape[1], "contexts": list(contexts)})
    return rows
