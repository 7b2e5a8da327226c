"""The speed gate: under `auto` the kernels serve only the (queries, batch, context) buckets
where they were timed faster than the reference path, and doctor says which (test_doctor.py). The timer and
the kernel runner are injected: a fake GPU answers canned times, the harness runs the kernels."""

from __future__ import annotations

import warnings

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import numpy as np
import pytest

from mlxkv.attention import speed_gate
from mlxkv.attention.dispatch import ATTENTION_ENV, AttentionChoice, choose_attention
from mlxkv.attention.speed_gate import AttentionShape, Bucket, SpeedGate, alternate
from msl.harness import SKIP_REASON, clang_available, remembered_run


class FakeGPU:
    """Canned milliseconds per step: the kernels' by (batch, context) (or (queries, batch,
    context)), the reference path's flat."""

    def __init__(self, kernel_ms: dict, reference_ms: float = 1.0, run_steps: bool = False):
        self.kernel_ms, self.reference_ms, self.run_steps = kernel_ms, reference_ms, run_steps
        self.timed = []

    def timer(self, kernel, reference, budget_s):
        assert (kernel.path, reference.path) == ("kernel", "reference")
        if self.run_steps:
            mx.eval(kernel.step(), reference.step())
        assert kernel.queries == reference.queries
        self.timed.append((kernel.batch, kernel.context, budget_s))
        key = (kernel.queries, kernel.batch, kernel.context)
        ms = self.kernel_ms[key] if key in self.kernel_ms else self.kernel_ms[key[1:]]
        return ms / 1e3, self.reference_ms / 1e3


# Kernels faster than the reference path at batch 8, slower at batch 1 but for 16k.
TIMES = {(1, 512): 1.5, (1, 4096): 1.2, (1, 16384): 0.9, (8, 512): 0.5, (8, 4096): 0.6, (8, 16384): 0.7}


def harness_run():
    if not clang_available():
        pytest.skip(SKIP_REASON)
    return remembered_run  # the launches of test_self_check.py's checks of this shape, once


def test_each_bucket_takes_the_faster_path():
    gpu = FakeGPU(TIMES)
    gate = speed_gate.measure(AttentionShape(mx.float16, 64, 16, 4, 2), timer=gpu.timer)
    paths = [(1, 512, "reference"), (1, 4096, "reference"), (1, 16384, "kernel"),
             (8, 512, "kernel"), (8, 4096, "kernel"), (8, 16384, "kernel")]
    assert [(b.queries, b.batch, b.context, b.path) for b in gate.buckets] == [
        (q, *p) for q in speed_gate.GATE_QUERIES for p in paths]
    # A few hundred milliseconds in all, split evenly over the buckets and both sides.
    assert 2 * sum(budget for *_, budget in gpu.timed) == pytest.approx(speed_gate.GATE_BUDGET_S)
    assert gate.buckets[0].as_dict() == {"batch": 1, "context": 512, "kernel_ms": 1.5, "reference_ms": 1.0,
                                         "queries": 1, "path": "reference"}


def test_a_verify_step_takes_the_path_timed_with_several_queries():
    # The multi-query kernel wins at batch 1, where the one-query kernel loses, and loses at 16k.
    times = {**{(1, *k): v for k, v in TIMES.items()},
             **{(4, b, c): 0.8 if c < 16384 else 1.2 for b in (1, 8) for c in (512, 4096, 16384)}}
    gate = speed_gate.measure(AttentionShape(mx.float16, 64, 16, 4, 2), timer=FakeGPU(times).timer)
    assert [gate.path_for(1, 512, n) for n in (1, 2, 5, 8)] == ["reference", "kernel", "kernel", "kernel"]
    assert gate.path_for(8, 16384, 1) == "kernel" and gate.path_for(8, 16384, 6) == "reference"
    # A gate timed on one query only (none of several) answers from those buckets.
    single = speed_gate.measure(AttentionShape(mx.float16, 64, 16, 4, 2), timer=FakeGPU(TIMES).timer, queries=(1,))
    assert single.path_for(1, 512, 4) == "reference" and single.path_for(8, 512, 4) == "kernel"


def test_a_step_goes_to_the_nearest_bucket():
    gate = SpeedGate(tuple(Bucket(b, c, TIMES[b, c], 1.0) for b, c in TIMES))
    assert gate.path_for(1, 700) == "reference"  # nearest 512
    assert gate.path_for(1, 9000) == "kernel"  # nearer 16k than 4k on a log scale
    assert gate.path_for(1, 8000) == "reference"
    assert gate.path_for(2, 100) == "reference"  # batch 2: nearer 1 than 8
    assert gate.path_for(3, 100) == "kernel"
    assert gate.path_for(64, 10**6) == "kernel"
    choice = AttentionChoice("kernel", gate=gate)
    assert (choice.path_for(1, 512), choice.path_for(8, 512)) == ("reference", "kernel")
    assert AttentionChoice("kernel").path_for(1, 512) == "kernel"  # no gate: forced
    assert AttentionChoice("kernel").path_for(1, 512, 8) == "kernel"
    assert AttentionChoice("kernel").path_for(8, 512, 9) == "reference"  # a prefill chunk: no kernel serves it
    assert AttentionChoice("reference", gate=gate).path_for(8, 512) == "reference"


@pytest.mark.slow
def test_the_steps_it_times_are_the_real_ones():
    # Small contexts, the kernels on the harness: the timed steps run and agree.
    gpu = FakeGPU({(b, c): 1.0 for b in (1, 3) for c in (20, 70)}, run_steps=True)
    shape = AttentionShape(mx.float32, 64, 16, 4, 2)
    gate = speed_gate.measure(shape, run=harness_run(), timer=gpu.timer, batches=(1, 3), contexts=(20, 70),
                              working_set_bytes=1)
    assert [(b.queries, b.batch, b.context) for b in gate.buckets] == [
        (q, b, c) for q in speed_gate.GATE_QUERIES for b in (1, 3) for c in (20, 70)]
    for queries in speed_gate.GATE_QUERIES:
        case = speed_gate.DecodeCase(shape, 70, 3, np.random.default_rng(0), distinct=False, queries=queries)
        kernel, reference = case.paged("kernel", harness_run())(), case.paged("reference")()
        assert kernel.shape == (3, 4, queries, 64) and mx.allclose(kernel, reference, atol=1e-4).item()
        alone = speed_gate.DecodeCase(shape, 70, 1, np.random.default_rng(0), queries=queries, layers=2)
        assert mx.allclose(alone.paged("kernel", harness_run())(), alone.contiguous(), atol=1e-4).item()


@pytest.mark.slow  # the quantized kernels in the harness, both kinds
def test_a_quantized_pools_steps_are_timed_on_its_own_reference_path(monkeypatch, checked_once):
    from mlxkv.cache.kv_format import KVFormat

    shape = AttentionShape(mx.float32, 64, 16, 4, 2, KVFormat(8, 32))
    for queries in speed_gate.GATE_QUERIES:
        for batch in (1, 3):
            case = speed_gate.DecodeCase(shape, 70, batch, np.random.default_rng(0), distinct=False, queries=queries)
            assert case.pool.keys[0].dtype == mx.uint32  # the pages, quantized (records)
            assert batch > 1 or isinstance(case.contiguous_kv[0][0], tuple)
            kernel = case.paged("kernel", harness_run())()
            reference = (case.contiguous if batch == 1 else case.paged("reference"))()
            assert kernel.shape == (batch, 4, queries, 64) and mx.allclose(kernel, reference, atol=1e-4).item()
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    choice = choose_attention("auto", mx.float16, 64, 64, 16, 4, 2, run=harness_run(), timer=FakeGPU(TIMES).timer,
                              metal=True, kv=KVFormat(8, 64))
    assert choice.path == "kernel" and choice.gate is not None  # auto times a quantized pool too
    assert [choice.path_for(1, c) for c in (512, 4096, 16384)] == ["reference", "reference", "kernel"]


def test_alternate_times_per_call_with_an_injected_clock():
    now = [0.0]

    def clock():
        return now[0]

    def step(cost):
        def fn():
            now[0] += cost
            return mx.array(0)
        return fn

    a, b = alternate(step(0.002), step(0.001), budget_s=0.03, clock=clock)
    assert (a, b) == (pytest.approx(0.002), pytest.approx(0.001))


@pytest.mark.slow
def test_auto_uses_the_kernels_only_where_they_are_faster(monkeypatch, checked_once):
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choice = choose_attention("auto", mx.float16, 64, 64, 16, 4, 2, run=harness_run(),
                                  timer=FakeGPU(TIMES).timer, metal=True)
    assert choice.path == "kernel" and choice.check.ok
    assert [choice.path_for(1, c) for c in (512, 4096, 16384)] == ["reference", "reference", "kernel"]
    assert [choice.path_for(8, c) for c in (512, 4096, 16384)] == ["kernel"] * 3
    # Asked for by name, the kernels serve every decode: no gate.
    forced = choose_attention("kernel", mx.float16, 64, 64, 16, 4, 2, run=harness_run(),
                              timer=FakeGPU({}).timer, metal=True)
    assert forced.gate is None and forced.path_for(1, 512) == "kernel"


@pytest.mark.slow  # over a second or many params: the not-slow suite's 2 minutes
def test_a_gate_that_fails_sends_decode_to_the_reference_path(monkeypatch, checked_once):
    monkeypatch.delenv(ATTENTION_ENV, raising=False)

    def faulting(kernel, reference, budget_s):
        raise RuntimeError("[METAL] Command buffer execution failed\nmore")

    with pytest.warns(Warning, match=r"timing the Metal attention kernels failed \(RuntimeError: \[METAL\] "
                                     r"Command buffer execution failed\); decoding on the reference path"):
        choice = choose_attention("auto", mx.float16, 64, 64, 16, 4, 2, run=harness_run(), timer=faulting,
                                  metal=True)
    assert choice.path == "reference" and choice.path_for(8, 512) == "reference"


# ---- what the engine runs: verify buckets, pipelined steps of many layers, distinct rows ----


def test_the_kernels_must_win_by_the_margin():
    """A near tie stays on the reference path: a bucket that flips between loads would not."""
    assert speed_gate.MARGIN == 0.03
    assert Bucket(1, 512, 0.98, 1.0).path == "reference"  # 2% faster: not enough
    assert Bucket(1, 512, 0.96, 1.0).path == "kernel"
    assert Bucket(1, 512, 1.0, 1.0).path == "reference"


def test_verify_steps_ask_for_the_verify_buckets(llama_dir, monkeypatch):
    """The engine passes each step's query count: a verify step of k proposals asks for k + 1
    queries (the gate's several-query buckets), a decode step for 1, a prefill chunk for more."""
    from mlxkv.config import CacheConfig
    from mlxkv.engine import core as engine_module
    from mlxkv.engine.engine import Engine
    from mlxkv.speculative.step_cost import AlwaysSpeculate

    asked = []

    class Recording(AttentionChoice):
        def path_for(self, batch, context, queries=1):
            asked.append(queries)
            return "reference"

    monkeypatch.setattr(engine_module, "choose_attention", lambda *a, **k: Recording("reference"))
    config = CacheConfig(block_size=16, num_blocks=64, memory_tier_bytes=0, speculative="lookup",
                         speculative_tokens=4)
    engine = Engine.load(llama_dir, config)
    engine.loop.speculation.cost = AlwaysSpeculate()
    prompt = [5, 6, 7, 8, 9] * 6  # prompt lookup proposes its repeats
    engine.generate(prompt, max_tokens=12)
    assert 1 in asked and max(asked) > 8  # a decode step; the prompt, a prefill chunk
    assert any(1 < q <= 5 for q in asked), asked  # verify steps: their own kind of bucket


def test_a_step_reads_distinct_rows_of_enough_layers():
    llama3 = AttentionShape(mx.float16, 128, 16, 32, 8)
    # 4 KiB of K/V per token and layer: 64 layers at 512 tokens (128 MiB, over any system-level cache),
    # 8 at 4k, one at 16k x 8.
    assert speed_gate.layers_for(llama3, 512, 1) == 64 and speed_gate.layers_for(llama3, 4096, 1) == 8
    assert speed_gate.layers_for(llama3, 16384, 8) == 1
    case = speed_gate.DecodeCase(AttentionShape(mx.float32, 64, 16, 4, 2), 70, 3, np.random.default_rng(0),
                                 layers=3)
    tables = [set(row) for row in case.paged_batch.block_tables.tolist()]
    assert all(not (a & b) for i, a in enumerate(tables) for b in tables[i + 1:])  # no row reads another's
    assert len(case.pool.keys) == 3 and not mx.array_equal(case.pool.keys[0], case.pool.keys[1]).item()


def test_pipelined_steps_are_each_evaluated(monkeypatch):
    """Each step is submitted as the engine submits it, and waited for before the loop ends."""
    submitted, waited = [], []
    real_async, real_eval = mx.async_eval, mx.eval
    monkeypatch.setattr(mx, "async_eval", lambda *xs: submitted.extend(xs) or real_async(*xs))
    monkeypatch.setattr(mx, "eval", lambda *xs: waited.extend(xs) or real_eval(*xs))
    now = [0.0]

    def step():
        now[0] += 0.001
        return mx.array(1.0) + 1

    per_call = speed_gate._per_call(step, 0.01, lambda: now[0])
    assert per_call == pytest.approx(0.001)
    assert len(submitted) == 10 and all(any(x is y for y in waited) for x in submitted)


# ---- the stored choice ----------------------------------------------------------------------


def test_a_stored_choice_is_reused_and_says_so(monkeypatch, checked_once, tmp_path):
    from mlxkv.attention import gate_store
    from mlxkv.attention.doctor import attention_lines

    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    store = gate_store.GateStore(tmp_path / "gates")
    gpu = FakeGPU(TIMES)
    first = choose_attention("auto", mx.float16, 64, 64, 16, 4, 2, run=harness_run(), timer=gpu.timer,
                             metal=True, store=store)
    assert len(gpu.timed) == 12 and first.gate.source.startswith("timed at this load")
    assert str(store.directory) in first.gate.source

    def never(kernel, reference, budget_s):
        raise AssertionError("a stored gate was timed again")

    again = choose_attention("auto", mx.float16, 64, 64, 16, 4, 2, run=harness_run(), timer=never,
                             metal=True, store=store)  # a restart
    assert again.gate.buckets == first.gate.buckets and again.gate.source.startswith("stored in ")
    report = again.as_dict()
    assert ("speed gate", f"choice {again.gate.source}") in attention_lines({**report, "why": ""})
    # Another MLX version (or chip, or kernels) is another key: timed again.
    monkeypatch.setattr(mx, "__version__", "0.0.1")
    gpu2 = FakeGPU(TIMES)
    choose_attention("auto", mx.float16, 64, 64, 16, 4, 2, run=harness_run(), timer=gpu2.timer, metal=True,
                     store=store)
    assert len(gpu2.timed) == 12 and len(list(store.directory.glob("*.json"))) == 2


def test_an_unreadable_stored_choice_is_timed_again(tmp_path, caplog):
    from mlxkv.attention import gate_store

    store = gate_store.GateStore(tmp_path)
    shape = AttentionShape(mx.float16, 64, 16, 4, 2)
    key = gate_store.gate_key(shape)
    store.path(key).write_text("{not json")
    gpu = FakeGPU(TIMES)
    gate = gate_store.stored_or_measured(shape, timer=gpu.timer, store=store)
    assert len(gpu.timed) == 12 and "unreadable" in caplog.text
    assert store.load(key).buckets == gate.buckets  # rewritten


def test_the_stored_choice_names_the_chip_mlx_reports(monkeypatch):
    from mlxkv.attention import gate_store

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)  # as on a Mac
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "Apple M3 Max"})
    assert gate_store.chip() == "Apple M3 Max"
