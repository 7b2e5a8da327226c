"""The Metal paged-attention kernels against the reference path and a numpy oracle.

Every kernel instantiation the engine can dispatch runs here (one query
per row and several, full-precision and quantized pools; their own rules
are tested in test_kernels_multi.py and test_kernels_quantized.py): on the
GPU where Metal is available, else through the MSL harness (tests/msl),
which compiles the exact source MLX generates and executes it on the CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import numpy as np
import pytest

from mlxkv import kv_format
from mlxkv.attention import dispatch as attention, gpu_size, kernels
from mlxkv.attention.gpu_size import GPUSize
from mlxkv.errors import MlxkvError
from mlxkv.cache.kv_pool import KVLayout, KVPool
from mlxkv.attention.paged_cache import PagedBatch, PagedKVCache
from msl.harness import generated_source
from msl.paged import (Instantiation, assert_close, check_case, decode_instantiations, launch_of, make_case, oracle,
                       run_kernels as kernel_attention)

INSTANTIATIONS = decode_instantiations()
# Each dtype, head dim, group size (or rows per simdgroup), block size and
# pool format at least once per kind, in the fast run; every combination in
# the full one.
SAMPLE = {
    Instantiation(mx.float16, 128, 4, 16), Instantiation(mx.bfloat16, 64, 8, 32), Instantiation(mx.float32, 80, 1, 16),
    Instantiation(mx.float16, 96, 2, 32), Instantiation(mx.bfloat16, 256, 1, 16),
    Instantiation(mx.float16, 128, 2, 16, True), Instantiation(mx.bfloat16, 80, 8, 32, True),
    Instantiation(mx.float32, 64, 1, 16, True), Instantiation(mx.float16, 256, 4, 32, True),
    Instantiation(mx.float16, 128, 4, 16, bits=4), Instantiation(mx.bfloat16, 96, 1, 32, bits=8),
    Instantiation(mx.float32, 256, 2, 16, bits=4), Instantiation(mx.float16, 64, 8, 32, bits=8),
    Instantiation(mx.float16, 128, 2, 16, True, 8), Instantiation(mx.bfloat16, 96, 4, 32, True, 4),
    Instantiation(mx.float32, 64, 8, 16, True, 4), Instantiation(mx.float16, 256, 1, 32, True, 8),
}


# ---- through the kernels ----------------------------------------------------------


@pytest.mark.parametrize("inst", [
    pytest.param(i, id=i.id, marks=() if i in SAMPLE else pytest.mark.slow) for i in INSTANTIATIONS])
def test_every_instantiation(request, on_device, inst):
    if inst not in SAMPLE:
        request.getfixturevalue("all_built")
    bs, queries = inst.block_size, inst.shape[1]
    # The kinds added later on one kv head, fewer partitions and (outside the sample) only the
    # second case: the harness runs a threadgroup at a time, and they are 500 of 620.
    plain = not (inst.multi or inst.bits)
    n_kv_heads, partition = (2, 16) if plain else (1, 32)
    # A partial last block and exactly one block, in one batch.
    if plain or inst in SAMPLE:
        case = inst.case(n_kv_heads=n_kv_heads, context_lens=(bs + 5, bs), seed=inst.head_dim + inst.rows)
        check_case(case, partition=0)
    # The same instantiation with sinks and a window that starts mid-block,
    # partitioned (gpt-oss's sliding layers); a row whose whole context is new.
    case = inst.case(n_kv_heads=n_kv_heads, context_lens=(3 * bs + 7, max(9, queries), queries),
                     seed=inst.head_dim + inst.rows + 1, window=bs + 3, sinks=True)
    check_case(case, partition=partition)


@pytest.mark.slow  # over a second or many params: the not-slow suite's 2 minutes
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window", [1, 5, 16, 19, 40, 300])
@pytest.mark.parametrize("partition", [0, 256])
def test_sliding_windows_and_sinks(on_device, window, sinks, partition):
    # Windows of one token, shorter than a block, exactly a block, starting
    # mid-block, several blocks, and longer than some rows (all visible);
    # rows shorter and longer than the window in one batch.
    case = make_case(mx.float16, 64, 2, n_kv_heads=2, block_size=16,
                     context_lens=(1, 7, 16, 35, 330), seed=window, window=window, sinks=sinks)
    check_case(case, partition=partition)


def test_sinks_weigh_in():
    # A kernel that ignored the sinks would still match an oracle that did.
    case = make_case(mx.float32, 64, 2, context_lens=(30,), sinks=True)
    plain = make_case(mx.float32, 64, 2, context_lens=(30,))
    assert np.abs(oracle(case) - oracle(plain)).max() > 1e-2


@pytest.mark.parametrize("block_size", kernels.BLOCK_SIZES)
@pytest.mark.parametrize("context", [1, "tile", "tile+1", "block", "block+5", 600])
def test_context_lengths(on_device, block_size, context):
    # One pass over 1 token, one tile (a token per simdgroup), a simdgroup
    # with a second token (its online softmax rescales), exactly one block,
    # a partial last block, and many tokens per simdgroup.
    tile = kernels.SIMDGROUPS
    n = {"tile": tile, "tile+1": tile + 1, "block": block_size, "block+5": block_size + 5}.get(context, context)
    case = make_case(mx.float16, 128, 4, n_kv_heads=1, block_size=block_size,
                     context_lens=(n,), seed=n)
    check_case(case, partition=0)


@pytest.mark.parametrize("dtype", kernels.DTYPES, ids=str)
@pytest.mark.parametrize("partition,head_dim", [(256, 80), (512, 96)])
def test_partitions(on_device, dtype, partition, head_dim):
    # Two passes, every reduce instantiation. The 1-token sequence leaves
    # later partitions empty; head dims 80 and 96 make the reduce's edge
    # threadgroups partial.
    case = make_case(dtype, head_dim, 2, n_kv_heads=1, block_size=16,
                     context_lens=(700, 257, 1), seed=partition)
    check_case(case, partition=partition)


@pytest.mark.parametrize("context", [255, 256, 257, 511, 512, 513])
def test_partition_boundaries(on_device, context):
    case = make_case(mx.float32, 64, 1, n_kv_heads=1, block_size=32, context_lens=(context,),
                     seed=context)
    check_case(case, partition=256)


@pytest.mark.parametrize("group", [1, 3, 4, 6, 7, 8])
def test_gqa_factors(on_device, group):
    # 3, 6 and 7 run on the instantiations for 4 and 8. 300 tokens on a
    # small grid: the automatic choice splits into partitions.
    case = make_case(mx.float16, 64, group, n_kv_heads=2, context_lens=(40, 300), seed=group)
    assert kernels.partition_size(2, 2, 300, GPUSize(32)) == 150
    check_case(case)


@pytest.mark.parametrize("partition", [0, 256])
def test_mixed_batch(on_device, partition):
    case = make_case(mx.bfloat16, 128, 4, n_kv_heads=2, block_size=32,
                     context_lens=(1, 16, 33, 300, 17), seed=7)
    check_case(case, partition=partition)


def test_block_placement_does_not_change_the_result(on_device):
    # The same sequences stored in different blocks: bit-identical outputs.
    a = make_case(mx.float32, 96, 2, context_lens=(70, 20), shuffle=False, seed=3)
    b = make_case(mx.float32, 96, 2, context_lens=(70, 20), shuffle=False, seed=3)
    rng = np.random.default_rng(0)
    order = rng.permutation(a.k_pool.shape[0])  # new block id of each old block
    inverse = np.argsort(order)
    b.k_pool, b.v_pool = a.k_pool[mx.array(inverse)], a.v_pool[mx.array(inverse)]
    b.tables = [[int(order[i]) for i in t] for t in a.tables]
    assert b.tables != a.tables
    out_a, out_b = kernel_attention(a, 0), kernel_attention(b, 0)
    assert np.array_equal(np.array(out_a), np.array(out_b))


def test_paged_attention_runs_decode_on_the_kernels(on_device):
    case = make_case(mx.float16, 64, 2, context_lens=(40, 9), seed=11)
    n_blocks, n_kv, bs, D = case.k_pool.shape
    pool = KVPool(KVLayout(1, n_kv, D, D, bs, mx.float16), n_blocks)
    pool.keys[0], pool.values[0] = case.k_pool, case.v_pool
    cache = PagedKVCache(pool, 0, case.batch("kernel"))
    keys, values = pool.gather(0, cache.batch.block_tables)
    out = attention.paged_attention(case.queries, keys, values, cache, case.scale,
                                    cache.make_mask(1))
    assert_close(out, oracle(case), mx.float16)


# ---- dispatch, without running a kernel -----------------------------------------------


def test_a_steps_layers_share_their_small_inputs(monkeypatch):
    """The lengths, window starts, scale, params and cast sinks are built by a step's first
    layer and reused by the others: no per-layer mx.array for what the step shares."""
    launches = []

    def fake(launch):
        launches.append(launch)
        return [mx.zeros(s, d) for s, d in zip(launch.output_shapes, launch.output_dtypes)]

    monkeypatch.setattr(kernels, "run_launch", fake)
    case = make_case(mx.float16, 64, 2, context_lens=(700, 9), seed=11, sinks=True)
    n_blocks, n_kv, bs, D = case.k_pool.shape
    pool = KVPool(KVLayout(2, n_kv, D, D, bs, mx.float16), n_blocks)
    batch = case.batch("kernel")
    for layer in range(2):
        pool.keys[layer], pool.values[layer] = case.k_pool, case.v_pool
        attention.paged_attention(case.queries, None, None, PagedKVCache(pool, layer, batch), case.scale, None,
                                  case.sinks)
    first, second = [x for x in launches if x.kernel is kernels.kernel("paged_decode")]
    assert all(a is b for a, b in list(zip(first.inputs, second.inputs))[4:])  # lens .. params
    reduces = [x for x in launches if x.kernel is kernels.kernel("paged_reduce")]
    assert len(reduces) == 2 and reduces[0].inputs[1] is reduces[1].inputs[1]
    # Another step (its own tables) builds its own.
    attention.paged_attention(case.queries, None, None, PagedKVCache(pool, 0, case.batch("kernel")), case.scale,
                              None, case.sinks)
    assert launches[-2].inputs[4] is not first.inputs[4]


@pytest.mark.slow  # enumerates every shape the engine could ask for: seconds of pure Python
def test_every_instantiation_the_engine_can_dispatch_is_tested():
    # A pool's format is a KVFormat, which refuses any other bits or group: the formats a
    # model can ask for are these (a bits x group sweep of 1-16 x 16-128 took 13x longer).
    formats = [()] + [(bits, group) for bits in kv_format.BITS for group in kv_format.GROUP_SIZES]
    dispatchable = {
        Instantiation(dtype, d, kernels.rows_per_simdgroup(g, n) if n > 1 else kernels.group_size_for(g), bs, n > 1,
                      fmt[0] if fmt else None)
        for dtype in (mx.float16, mx.bfloat16, mx.float32, mx.int8)
        for d in (*range(1, 300), 512)
        for g in range(1, 17)
        for bs in (8, 16, 24, 32, 64)
        for n in range(1, 10)
        for fmt in formats
        if kernels.supports(dtype, d, d, bs, g, n, *fmt)
    }
    assert dispatchable == set(INSTANTIATIONS)


def test_supported_shapes():
    assert kernels.supports(mx.float16, 128, 128, 16, 7)
    assert not kernels.supports(mx.float16, 128, 128, 16, 9)  # group over 8
    assert not kernels.supports(mx.float16, 48, 48, 16, 1)  # head dim
    assert not kernels.supports(mx.float16, 128, 64, 16, 1)  # V head dim differs
    assert not kernels.supports(mx.float16, 128, 128, 8, 1)  # block size
    assert [kernels.group_size_for(g) for g in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    assert kernels.supports(mx.float16, 128, 128, 16, 8, 8) and not kernels.supports(mx.float16, 128, 128, 16, 8, 9)
    assert [kernels.rows_per_simdgroup(4, n) for n in range(2, 9)] == [1, 2, 2, 4, 4, 4, 4]
    assert [kernels.rows_per_simdgroup(8, n) for n in range(2, 9)] == [2, 4, 4, 8, 8, 8, 8]
    assert kernels.supports(mx.float16, 96, 96, 16, 1, 1, 4, 32) and not kernels.supports(mx.float16, 96, 96, 16, 1, 1, 4, 64)
    assert not kernels.supports(mx.float16, 80, 80, 16, 1, 1, 8, 32)  # mx.quantize cannot group 80
    assert not kernels.supports(mx.float16, 128, 128, 16, 1, 1, 2, 64)  # bits


def test_partitions_fill_the_grid():
    # Llama-3-8B (8 kv heads): 64 simdgroups a partition at batch 1, so on 32 cores (1024
    # simdgroups) up to 16 partitions; 8 at batch 8 is 2; from batch 16 the grid is full.
    gpu = GPUSize(32)
    assert kernels.partition_size(1, 8, 16384, gpu) == 1024  # 16 partitions
    assert kernels.partition_size(1, 8, 512, gpu) == 128  # 4: none under 128 tokens
    assert kernels.partition_size(1, 8, 255, gpu) == 0  # not two partitions' worth: one launch
    assert kernels.partition_size(8, 8, 4096, gpu) == 2048
    assert kernels.partition_size(16, 8, 16384, gpu) == 0
    for batch, context in [(1, 200), (1, 999), (3, 5000), (2, 70000)]:
        tokens = kernels.partition_size(batch, 8, context, gpu)
        n_parts = -(-context // tokens) if tokens else 1
        assert (tokens == 0 or tokens >= kernels.MIN_PART_TOKENS) and batch * 8 * n_parts * kernels.SIMDGROUPS <= 2048


def test_the_partition_count_follows_the_gpus_size():
    # A base chip (8 cores: 256 simdgroups) splits Llama-3-8B's rows into 4, an Ultra into 16+.
    base = gpu_size.from_device_info({"architecture": "applegpu_g14g", "device_name": "Apple M2"})
    ultra = gpu_size.from_device_info({"architecture": "applegpu_g13d"})
    assert (base.cores, ultra.cores) == (8, 48)
    assert kernels.partition_size(1, 8, 16384, base) == 4096
    assert kernels.partition_size(1, 8, 16384, ultra) == -(-16384 // 24)  # 24 partitions
    # A name it does not know, or no Metal (the harness): the default.
    assert gpu_size.from_device_info({"architecture": "applegpu_g99x"}).cores == gpu_size.DEFAULT_CORES
    assert gpu_size.from_device_info({}).cores == gpu_size.DEFAULT_CORES
    with pytest.raises(ValueError, match="at least one core"):
        GPUSize(0)


def test_partitions_default_to_this_machines_gpu(monkeypatch):
    asked = []
    monkeypatch.setattr(gpu_size, "current", lambda: asked.append(1) or GPUSize(8))
    assert kernels.partition_size(1, 8, 16384) == 4096 and asked == [1]


def test_signature_is_the_same_for_every_call():
    # Small index inputs are padded: one generated source per instantiation,
    # whatever the batch, however short the block table.
    small = make_case(mx.float16, 64, 2, context_lens=(1,))
    large = make_case(mx.float16, 64, 2, context_lens=(700, 3, 90, 1, 1, 1, 1, 1, 9))
    sources = []
    for case in (small, large):
        sources.append(generated_source(launch_of(case)).text)
    assert sources[0] == sources[1]
    assert "device int32_t* params" in sources[0] and "constant float& scale" in sources[0]
    for name in ("block_tables", "context_lens", "window_starts"):
        assert f"device int32_t* {name}" in sources[0]
    assert "device float* sinks" in sources[0]


def test_sources_ship_in_the_metal_package():
    for name in ("common", "paged_decode", "paged_decode_multi", "paged_reduce"):
        assert kernels.kernel_source(name).strip()
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert re.search(r'^"mlxkv.metal" = \[.*"\*\.metal".*\]$', pyproject, re.M)


@pytest.mark.skipif(mx.metal.is_available(), reason="Metal is available here")
def test_kernels_without_metal_fail_clearly():
    case = make_case(context_lens=(5,))
    with pytest.raises(MlxkvError, match="Metal"):
        kernel_attention(case)


def test_paged_attention_keeps_long_prefill_and_unsupported_shapes_on_the_reference_path(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "paged_decode", lambda *a, **k: calls.append(a) or "kernel")

    def run(head_dim, new_tokens, mode="kernel"):
        n_kv = 2
        pool = KVPool(KVLayout(1, n_kv, head_dim, head_dim, 16, mx.float32), 8)
        batch = PagedBatch.build([[0, 1], [2, 3]], [20 - new_tokens, 9], new_tokens, 16, mode)
        cache = PagedKVCache(pool, 0, batch)
        q = mx.zeros((2, 4, new_tokens, head_dim))
        keys, values = pool.gather(0, batch.block_tables)
        return attention.paged_attention(q, keys, values, cache, 1.0, cache.make_mask(new_tokens))

    assert run(64, 1) == "kernel"
    assert run(64, 3) == "kernel" and run(64, 8) == "kernel"  # a verify step (or a short prefill chunk)
    assert isinstance(run(64, 9), mx.array)  # more queries than the kernel serves
    assert isinstance(run(32, 1), mx.array)  # head dim without a kernel
    assert isinstance(run(64, 1, "reference"), mx.array)
    assert len(calls) == 3
