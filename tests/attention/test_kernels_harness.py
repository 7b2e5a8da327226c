"""The MSL harness itself: it runs kernels as Metal would, and it can fail.

A harness that always passes proves nothing, so bugs are planted here: an
out-of-range block id (AddressSanitizer), the paged kernel without one of its
barriers (ThreadSanitizer), barriers skipped or split by part of a
threadgroup (the runtime's own checks), and an arithmetic slip that the
comparison must reject.
"""

from __future__ import annotations

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import numpy as np
import pytest

from mlxkv.attention import kernels
from msl.harness import SKIP_REASON, HarnessError, clang_available, shared_harness
from msl.paged import assert_close, make_case, oracle

pytestmark = pytest.mark.skipif(not clang_available(), reason=SKIP_REASON)


@pytest.fixture(scope="module")
def harness():
    return shared_harness()


def decode(case, partition=0, decode_kernel=None):
    B, H, _, D = case.queries.shape
    return kernels.decode_launch(case.queries.reshape(B, H, D), case.k_pool, case.v_pool,
                                 case.block_tables, case.context_lens, case.scale, partition,
                                 decode_kernel, case.window_starts, case.sinks)


def planted(old: str, new: str = "") -> object:
    """The shipped decode kernel with one line changed."""
    body = kernels.kernel_source("paged_decode")
    assert body.count(old) == 1, old
    return kernels.make_kernel("paged_decode", body=body.replace(old, new))


def tiny(source: str, grid, threadgroup, outputs: int, dtype=mx.uint32, header: str = ""):
    kernel = mx.fast.metal_kernel(name="harness_probe", input_names=["probe_in"],
                                  output_names=["out"], source=source, header=header)
    return kernels.Launch(kernel, (mx.zeros((8,), mx.float32),), (("T", mx.float32),), grid,
                          threadgroup, ((outputs,),), (dtype,))


# ---- sanitizers -------------------------------------------------------------------


def test_out_of_range_block_id_is_caught_by_address_sanitizer(harness):
    case = make_case(mx.float32, 64, 1, n_kv_heads=1, context_lens=(40,), spare_blocks=0)
    harness.run(decode(case), sanitizer="address")  # clean as shipped
    case.tables[0][1] = case.k_pool.shape[0]  # one past the last block
    with pytest.raises(HarnessError, match="AddressSanitizer: heap-buffer-overflow"):
        harness.run(decode(case), sanitizer="address")


@pytest.mark.parametrize("barrier", [
    "  threadgroup_barrier(mem_flags::mem_threadgroup);  // maxima visible\n",
    "      threadgroup_barrier(mem_flags::mem_threadgroup);  // this head's rows visible\n",
    "      threadgroup_barrier(mem_flags::mem_threadgroup);  // o_s free for the next head\n",
], ids=["maxima", "rows", "next-head"])
def test_missing_barrier_is_caught_by_thread_sanitizer(harness, barrier):
    case = make_case(mx.float32, 64, 2, n_kv_heads=1, context_lens=(40,))
    launch = decode(case)
    harness.run(launch, sanitizer="thread")  # no race as shipped
    with pytest.raises(HarnessError, match="ThreadSanitizer: data race"):
        harness.run(decode(case, decode_kernel=planted(barrier)), sanitizer="thread")


# ---- the runtime's own checks -------------------------------------------------------


def test_barrier_skipped_by_part_of_a_threadgroup_is_caught(harness):
    source = """
    if (thread_index_in_threadgroup < 32) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    out[thread_position_in_grid.x] = 1;
    """
    with pytest.raises(HarnessError, match="left the kernel"):
        harness.run(tiny(source, (64, 1, 1), (64, 1, 1), 64))


def test_threads_at_different_barriers_are_caught(harness):
    source = """
    if (thread_index_in_threadgroup < 32) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
    } else {
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    out[thread_position_in_grid.x] = 1;
    """
    with pytest.raises(HarnessError, match="different barriers"):
        harness.run(tiny(source, (64, 1, 1), (64, 1, 1), 64))


def test_threadgroup_memory_over_32_kb_is_caught(harness):
    source = """
    threadgroup float big[9000];
    big[thread_index_in_threadgroup] = 1.0f;
    out[thread_position_in_grid.x] = 1;
    """
    with pytest.raises(HarnessError, match="threadgroup memory"):
        harness.run(tiny(source, (32, 1, 1), (32, 1, 1), 32))


# ---- the comparison can fail ----------------------------------------------------------


def test_arithmetic_bug_fails_the_comparison(harness):
    # Forget to rescale the accumulators when the running maximum grows:
    # right on a simdgroup's first token, wrong from its second.
    case = make_case(mx.float32, 64, 2, n_kv_heads=1, context_lens=(600,), seed=5)
    expected = oracle(case).reshape(1, 2, 64)
    (good, _) = harness.run(decode(case))
    assert_close(good, expected, mx.float32)
    forgot = planted("          o[g][e] *= correction;\n", "")
    (bad, _) = harness.run(decode(case, decode_kernel=forgot))
    with pytest.raises(AssertionError):
        assert_close(bad, expected, mx.float32)


@pytest.mark.parametrize(("old", "new"), [
    ("window_starts[seq] + part * part_tokens", "part * part_tokens"),  # the window ignored
    ("sinks[head0 + g]", "0.0f"),  # sinks read as zero
    ("has_sinks && part == 0 && sg == 0", "has_sinks && sg == 0"),  # a sink counted once per partition
    ("has_sinks && part == 0 && sg == 0", "has_sinks && part == 0"),  # ... once per simdgroup
], ids=["window", "sinks", "sink-per-partition", "sink-per-simdgroup"])
def test_window_and_sink_bugs_fail_the_comparison(harness, old, new):
    case = make_case(mx.float32, 64, 2, n_kv_heads=1, context_lens=(600,), seed=6, window=300, sinks=True)
    expected = oracle(case).reshape(1, 2, 64)
    (_, partials) = harness.run(decode(case, partition=256))
    (good,) = harness.run(kernels.reduce_launch(partials, mx.float32))
    assert_close(good, expected, mx.float32)
    (_, partials) = harness.run(decode(case, partition=256, decode_kernel=planted(old, new)))
    (bad,) = harness.run(kernels.reduce_launch(partials, mx.float32))
    with pytest.raises(AssertionError):
        assert_close(bad, expected, mx.float32)


# ---- Metal's execution model ------------------------------------------------------------


def test_builtins_and_partial_edge_threadgroups(harness):
    # A 70 x 3 grid of 32 x 2 groups: the last column and row are partial.
    source = """
    uint i = (thread_position_in_grid.y * threads_per_grid.x + thread_position_in_grid.x) * 8;
    out[i + 0] = thread_position_in_threadgroup.x;
    out[i + 1] = thread_position_in_threadgroup.y;
    out[i + 2] = threadgroup_position_in_grid.x;
    out[i + 3] = threadgroup_position_in_grid.y;
    out[i + 4] = threads_per_threadgroup.x * threads_per_threadgroup.y;
    out[i + 5] = thread_index_in_threadgroup;
    out[i + 6] = simdgroup_index_in_threadgroup * 100 + thread_index_in_simdgroup;
    out[i + 7] = threadgroups_per_grid.x * 10 + threadgroups_per_grid.y;
    """
    (out,) = harness.run(tiny(source, (70, 3, 1), (32, 2, 1), 70 * 3 * 8))
    got = np.array(out).reshape(3, 70, 8)
    y, x = np.mgrid[0:3, 0:70]
    lx, ly, gx, gy = x % 32, y % 2, x // 32, y // 2
    width = np.minimum(32, 70 - gx * 32)
    size = width * np.minimum(2, 3 - gy * 2)
    index = ly * width + lx
    expected = np.stack([lx, ly, gx, gy, size, index, index // 32 * 100 + index % 32,
                         np.full_like(x, 32)], axis=-1)
    assert np.array_equal(got, expected)


def test_threadgroup_memory_is_shared_within_a_group_only(harness):
    source = """
    threadgroup uint group_id[1];
    if (thread_index_in_threadgroup == 0) {
      group_id[0] = threadgroup_position_in_grid.x;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = group_id[0];
    """
    (out,) = harness.run(tiny(source, (96, 1, 1), (32, 1, 1), 96))
    assert np.array_equal(np.array(out), np.repeat(np.arange(3), 32))


def test_simd_operations_over_a_partial_simdgroup(harness):
    # 40 threads: lanes 0-31 and a second simdgroup of 8.
    source = """
    uint t = thread_index_in_threadgroup;
    float x = float((t * 7) % 11);
    out[t * 5 + 0] = simd_sum(x);
    out[t * 5 + 1] = simd_max(x);
    out[t * 5 + 2] = simd_shuffle_xor(x, ushort(1));
    out[t * 5 + 3] = simd_prefix_exclusive_sum(x);
    out[t * 5 + 4] = simd_broadcast(x, ushort(2));
    """
    (out,) = harness.run(tiny(source, (40, 1, 1), (40, 1, 1), 200, mx.float32))
    x = (np.arange(40) * 7 % 11).astype(np.float32)
    expected = []
    for lanes in (x[:32], x[32:]):
        for i, v in enumerate(lanes):
            expected.append([lanes.sum(), lanes.max(), lanes[i ^ 1], lanes[:i].sum(), lanes[2]])
    assert np.array_equal(np.array(out).reshape(40, 5), np.array(expected, np.float32))


def test_vector_constructors_conversions_and_maths(harness):
    # MSL spellings that ext_vector_type alone cannot express.
    source = """
    uint t = thread_position_in_grid.x;
    float4 a = float4(1.0f, 2.0f, 3.0f, float(t));
    half4 h = half4(a);
    float4 b = float4(h) * 2.0f + float4(float2(0.5f, 0.25f), 0.0f, 1.0f);
    bfloat16_t x = bfloat16_t(b.w);
    out[t * 4 + 0] = b.x;
    out[t * 4 + 1] = dot(a, b);
    out[t * 4 + 2] = float(x);
    out[t * 4 + 3] = metal::fast::exp(0.0f) + precise::max(b.y, b.z);
    """
    (out,) = harness.run(tiny(source, (4, 1, 1), (4, 1, 1), 16, mx.float32))
    t = np.arange(4, dtype=np.float32)
    expected = np.stack([np.full(4, 2.5), 2.5 + 8.5 + 18 + t * (2 * t + 1), 2 * t + 1,
                         np.full(4, 7.0)], axis=-1)
    assert np.array_equal(np.array(out).reshape(4, 4), expected.astype(np.float32))


@pytest.mark.parametrize(("old", "new"), [
    ("seen[j] = t0 + j >= first && t0 + j < last;", "seen[j] = t0 + j < last;"),  # a group's tokens before first
    ("seen[j] = t0 + j >= first && t0 + j < last;", "seen[j] = t0 + j >= first;"),  # ... past last
], ids=["before-first", "past-last"])
def test_token_groups_that_straddle_a_partition_or_window_bound(harness, old, new):
    # Four tokens an iteration from a multiple of 4: a window starting at 45 and partitions of
    # 67 tokens start and end inside groups, so each group's edges are masked.
    case = make_case(mx.float32, 64, 2, n_kv_heads=1, context_lens=(300,), seed=7, window=255)
    expected = oracle(case).reshape(1, 2, 64)
    (_, partials) = harness.run(decode(case, partition=67))
    (good,) = harness.run(kernels.reduce_launch(partials, mx.float32))
    assert_close(good, expected, mx.float32)
    (_, partials) = harness.run(decode(case, partition=67, decode_kernel=planted(old, new)))
    (bad,) = harness.run(kernels.reduce_launch(partials, mx.float32))
    with pytest.raises(AssertionError):
        assert_close(bad, expected, mx.float32)


def _unroll_failures(harness, launch, tmp_path) -> list[str]:
    """clang's -Wpass-failed warnings for the launch's kernel at the harness's -O1: a loop that
    asks to be unrolled in full (MLXKV_UNROLL) and was left rolled."""
    import subprocess

    from msl import harness as msl_harness

    path = tmp_path / "kernel.cpp"
    path.write_text(harness.translation_unit(launch))
    done = subprocess.run([msl_harness.CLANG, *msl_harness._FLAGS, f"-I{msl_harness.HERE}", "-c", str(path),
                           "-o", str(tmp_path / "kernel.o")], capture_output=True, text=True, check=True)
    return [line for line in done.stderr.splitlines() if "Wpass-failed" in line]


@pytest.mark.slow  # two compiles
@pytest.mark.parametrize("quantized", [False, True])
def test_every_loop_asked_to_unroll_unrolls(harness, tmp_path, quantized):
    # A loop that leaves early (a break) has no constant trip count, and clang leaves it rolled:
    # its arrays then live in memory rather than registers.
    case = make_case(mx.float16, 128, 4, context_lens=(20,), kv_bits=4 if quantized else None)
    assert _unroll_failures(harness, decode(case), tmp_path) == []
    body = kernels.kernel_source("paged_decode")
    assert body.count("continue;  // G rounds") == 1
    broken = kernels.make_kernel("paged_decode", body=body.replace("continue;  // G rounds", "break;  // G rounds"),
                                 quantized=quantized)
    assert _unroll_failures(harness, decode(case, decode_kernel=broken), tmp_path)
