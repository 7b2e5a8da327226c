"""The kernels check themselves before serving a model: a kernel that fails to build,
fails to run or disagrees with the float64 oracle on any path sends decode to the
reference path with one warning line, and no request fails. The check's runner is
injected here: the MSL harness runs the real kernels on the CPU, and stand-ins fail or
lie, each about one path only."""

from __future__ import annotations

import dataclasses
import warnings

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import numpy as np
import pytest

from mlxkv.attention import kernels, oracle, self_check
from mlxkv.attention.dispatch import ATTENTION_ENV, KernelCheckWarning, choose_attention
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.kv_format import KVFormat
from mlxkv.models.loader import load_model
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model
from msl.harness import SKIP_REASON, clang_available, remembered_run


def harness_run():
    """The real kernels, each launch run once in the session: the stand-ins below each run most
    of a check on them before their one wrong path, and the same launches recur across them."""
    if not clang_available():
        pytest.skip(SKIP_REASON)
    return remembered_run


def broken_compiler(launch):
    raise RuntimeError("Unable to build metal library from source\nerror: use of undeclared identifier")


def lying(launch):
    """The real kernel's outputs, off by a little: as a miscompiled kernel would be."""
    return [out + 0.05 if out.ndim > 1 else out for out in harness_run()(launch)]


def is_decode(launch) -> bool:
    return launch.kernel is kernels.kernel("paged_decode")


def wrong_second_tile(launch):
    """The real kernels, except that each threadgroup reads its second tile's V wrong: a
    kernel that is right only while a threadgroup has one tile (a token per simdgroup)."""
    if not is_decode(launch):
        return harness_run()(launch)
    _, _, v_pool, tables, lens, starts, _, _, params = launch.inputs
    part_tokens, n_parts = params.tolist()[4:6]
    block_size, tile = v_pool.shape[2], kernels.SIMDGROUPS
    v = np.array(v_pool.astype(mx.float32))
    for row, (table, n, start) in enumerate(zip(tables.tolist(), lens.tolist(), starts.tolist())):
        if row >= launch.grid[2]:
            break  # the padding of the small inputs
        for part in range(n_parts):
            first = start + part * part_tokens
            for t in range(first + tile, min(first + 2 * tile, first + part_tokens, n)):
                v[table[t // block_size], :, t % block_size] += 1.0
    inputs = list(launch.inputs)
    inputs[2] = mx.array(v).astype(v_pool.dtype)
    return harness_run()(dataclasses.replace(launch, inputs=tuple(inputs)))


def wrong_single_pass(launch):
    """Right when partitioned, off when one pass writes the output."""
    out, partials = harness_run()(launch) if is_decode(launch) else (None, None)
    if out is None:
        return harness_run()(launch)
    return [out + 0.05, partials] if partials.ndim == 1 else [out, partials]


def wrong_reduce(launch):
    """Right in one pass, off when the reduce merges the partitions."""
    outs = harness_run()(launch)
    return outs if is_decode(launch) or is_multi(launch) else [outs[0] * 1.01]


def is_multi(launch) -> bool:
    return launch.kernel is kernels.kernel("paged_decode_multi")


def wrong_multi(launch):
    """Right for one query per row, off for several (a verify step)."""
    outs = harness_run()(launch)
    return [outs[0] + 0.05, outs[1]] if is_multi(launch) and outs[1].ndim == 1 else outs


def wrong_multi_partitioned(launch):
    """Right but for several queries per row split into partitions."""
    outs = harness_run()(launch)
    return [outs[0], outs[1] * 1.01] if is_multi(launch) and outs[1].ndim > 1 else outs


def forgets_chunks(launch):
    """Right but for chunked attention over several queries: every query sees from the first
    one's chunk start, as the kernels did before issue 47."""
    if not is_multi(launch):
        return harness_run()(launch)
    inputs = list(launch.inputs)
    params = inputs[-1].tolist()
    inputs[-1] = mx.array(params[:9] + [0] + params[10:], dtype=mx.int32)
    return harness_run()(dataclasses.replace(launch, inputs=tuple(inputs)))


def fp32_tolerance(queries, k_pool, v_pool, table, n: int, start: int, scale: float, want: float) -> float:
    """What the check allows output element (row 0, head 0, dim 0) of an fp32 one-query call,
    written out here so that a looser self_check.tolerance or oracle slack fails the test:
    2 roundoffs of the output, plus fp32 accumulation (4 roundoffs per visible token and per
    head-dim term of the largest |score|, times max |V|)."""
    u = 2.0 ** -24
    tokens = [table[t // k_pool.shape[2]] * k_pool.shape[2] + t % k_pool.shape[2] for t in range(start, n)]
    keys = np.array(k_pool[:, 0].reshape(-1, k_pool.shape[-1]), np.float64)[tokens]
    values = np.array(v_pool[:, 0].reshape(-1, v_pool.shape[-1]), np.float64)[tokens]
    q = np.array(queries[0, 0], np.float64) * scale
    largest = (np.abs(q) * np.abs(keys)).sum(-1).max()
    return 2 * u * abs(want) + u * np.abs(values).max() * 4 * (len(tokens) + q.size * largest)


def just_outside_tolerance(launch):
    """The real kernels, except one element of the fp32 one-query single pass, off the float64
    oracle by 1.2x what the check allows there: a looser tolerance would let it through."""
    outs = harness_run()(launch)
    if not is_decode(launch) or outs[1].ndim > 1:
        return outs
    queries, k_pool, v_pool, tables, lens, starts, sinks, scale, params = launch.inputs
    n, start, table = lens.tolist()[0], starts.tolist()[0], tables.tolist()[0]
    sinks = sinks if params.tolist()[6] else None
    want, _ = oracle.attention(queries[:1, :, None], k_pool, v_pool, [table], [n], scale.item(),
                               (n - start) or None, sinks)
    allowed = fp32_tolerance(queries, k_pool, v_pool, table, n, start, scale.item(), want[0, 0, 0, 0])
    out = np.array(outs[0].astype(mx.float32))
    out[0, 0, 0] = want[0, 0, 0, 0] + 1.2 * allowed
    return [mx.array(out).astype(outs[0].dtype), outs[1]]


class Fault:
    """What a failed command buffer looks like: MLX raises it at the next wait."""

    ndim = 1

    def reshape(self, *shape):
        return self

    def astype(self, dtype):
        raise RuntimeError("[METAL] Command buffer execution failed: Caused GPU Timeout Error")


def faulting(launch):
    return [Fault(), Fault()]


@pytest.mark.parametrize(("dtype", "head_dim", "block_size", "heads", "pool"), [
    (mx.float32, 64, 16, (4, 2), ()),
    pytest.param(mx.float16, 128, 32, (8, 2), (), marks=pytest.mark.slow),
    pytest.param(mx.bfloat16, 64, 16, (6, 1), (), marks=pytest.mark.slow),
    (mx.float16, 64, 16, (2, 2), (4, 32)),
    pytest.param(mx.bfloat16, 128, 32, (8, 2), (8, 64), marks=pytest.mark.slow),
], ids=["float32-d64", "float16-d128", "bfloat16-d64", "q4-float16-d64", "q8-bfloat16-d128"])
@pytest.mark.slow
def test_the_real_kernels_pass_their_check(dtype, head_dim, block_size, heads, pool, checked_once):
    check = self_check.check_kernels(dtype, head_dim, block_size, *heads, harness_run(), KVFormat(*pool))
    assert check.ok, check.reason
    assert check.instantiation.endswith(", 4-bit pool in groups of 32" if pool == (4, 32) else "")


def test_every_multi_query_instantiation_a_model_uses_is_checked():
    # Its fewest queries each: the most simdgroups sharing a tile.
    assert self_check.query_counts(1) == [1, 2]
    assert self_check.query_counts(2) == [1, 2, 5]
    assert self_check.query_counts(4) == [1, 2, 3, 5]
    assert self_check.query_counts(8) == [1, 2, 3, 5]
    for group in range(1, 9):
        used = {kernels.rows_per_simdgroup(group, n) for n in range(2, kernels.MAX_QUERIES + 1)}
        assert {kernels.rows_per_simdgroup(group, n) for n in self_check.query_counts(group)[1:]} == used


@pytest.mark.parametrize(("run", "says"), [
    (broken_compiler, "RuntimeError: Unable to build metal library from source"),
    (faulting, "RuntimeError: [METAL] Command buffer execution failed"),
    (lying, "single pass: differs from the float64 oracle"),
    (wrong_second_tile, "single pass: differs from the float64 oracle"),
    (wrong_single_pass, "single pass: differs from the float64 oracle"),
    (wrong_reduce, "partitioned: differs from the float64 oracle"),
    (wrong_multi, "2 queries per row, single pass: differs from the float64 oracle"),
    (wrong_multi_partitioned, "2 queries per row, partitioned: differs from the float64 oracle"),
    (forgets_chunks, "2 queries per row, chunk boundary: differs from the float64 oracle"),
], ids=["compile", "gpu-fault", "lying", "second-tile", "single-pass", "reduce", "multi", "multi-partitioned",
        "forgets-chunks"])
@pytest.mark.slow
def test_a_kernel_that_fails_its_check_sends_decode_to_the_reference_path(run, says):
    with pytest.warns(KernelCheckWarning) as caught:
        choice = choose_attention("kernel", mx.float16, 64, 64, 16, 4, 2, run=run)
    assert choice.path == "reference" and not choice.check.ok and says in choice.check.reason
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert "float16, head dim 64, block 16, group 2" in str(caught[0].message)


def test_a_kernel_just_outside_the_tolerance_fails_its_check():
    """Off by 1.2x what rounding allows, at one element: loosening the tolerance (x1.2, or by
    0.01 absolute) would pass a kernel that is wrong."""
    check = self_check.check_kernels(mx.float32, 64, 16, 4, 2, just_outside_tolerance)
    assert not check.ok and "single pass: differs from the float64 oracle" in check.reason
    assert "at row 0, head 0" in check.reason


@pytest.mark.slow  # over a second or many params: the not-slow suite's 2 minutes
def test_a_passing_check_keeps_the_kernels(checked_once):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choice = choose_attention("kernel", mx.float32, 64, 64, 16, 4, 2, run=harness_run())
    assert choice.path == "kernel" and choice.check.ok


@pytest.mark.slow
def test_a_quantized_pool_is_checked_in_its_format_and_auto_times_it():
    timed = []

    def timer(kernel, reference, budget_s):  # the gate times the quantized pool's own steps
        timed.append(kernel.queries)
        return 1e-3, 2e-3

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forced = choose_attention("kernel", mx.float16, 64, 64, 16, 2, 2, run=harness_run(), kv=KVFormat(8, 64))
        auto = choose_attention("auto", mx.float16, 64, 64, 16, 2, 2, run=harness_run(), metal=True,
                                kv=KVFormat(8, 64), timer=timer)
    assert forced.path == "kernel" and forced.check.instantiation.endswith("8-bit pool in groups of 64")
    assert auto.path == "kernel" and auto.check.ok and auto.gate is not None and timed
    unsupported = choose_attention("kernel", mx.float16, 96, 96, 16, 2, 2, run=broken_compiler, kv=KVFormat(4, 64))
    assert unsupported.path == "reference" and unsupported.check.reason == "no kernel serves this shape"


def test_a_shape_no_kernel_serves_is_the_reference_path_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choice = choose_attention("kernel", mx.float16, 48, 48, 16, 4, 2, run=broken_compiler)
    assert choice.path == "reference" and choice.check.reason == "no kernel serves this shape"


def test_without_metal_auto_is_the_reference_path_and_runs_no_check():
    if mx.metal.is_available():
        pytest.skip("Metal is available here")
    choice = choose_attention("auto", mx.float16, 64, 64, 16, 4, 2, run=broken_compiler)
    assert choice.path == "reference" and choice.check is None


def test_an_engine_whose_kernels_fail_their_check_still_serves_every_request(tmp_path, monkeypatch):
    spec = TinyModelSpec(family="llama", hidden_size=64, num_heads=4, num_kv_heads=1, head_dim=64, seed=21)
    loaded = load_model(str(write_tiny_model(tmp_path / "m", spec)))
    monkeypatch.setenv(ATTENTION_ENV, "kernel")
    monkeypatch.setattr(kernels, "run_launch", broken_compiler)  # the GPU's compiler says no
    with pytest.warns(KernelCheckWarning):
        engine = Engine(loaded, CacheConfig(num_blocks=32, memory_tier_bytes=0))
    result = engine.generate([3, 4, 5, 6], max_tokens=6)
    assert result.finish_reason in ("stop", "length") and result.tokens
    attention = engine.stats()["attention"]
    assert attention["path"] == "reference" and "Unable to build" in attention["check"]["reason"]
