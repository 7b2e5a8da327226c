"""The engine's greedy-equality tests, with decode attention on the Metal kernel.

The tests of greedy_cases.py run again here on a model whose head
dim the kernels serve (64, 4 query heads per kv head), with attention forced
to "kernel" and every kernel launch executed by the MSL harness on the CPU
(the GPU where Metal is available). Greedy tokens must still equal mlx-lm's.
"""

from __future__ import annotations

import dataclasses

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import mlx_lm
import pytest

from mlx_lm.generate import stream_generate

from mlxkv.attention import kernels, self_check
from mlxkv.attention.dispatch import ATTENTION_ENV
from mlxkv.cache.kv_format import FULL
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model
from msl.harness import SKIP_REASON, clang_available, shared_harness
from greedy_cases import (  # noqa: F401  (collected here again)
    test_cold_prompts_match_mlx_lm,
    test_prefix_hits_match_mlx_lm,
    test_prompt_of_whole_cached_blocks,
)

pytestmark = pytest.mark.slow  # each decode step runs the kernel in the MSL harness

SPEC = TinyModelSpec(family="llama", hidden_size=64, num_heads=4, num_kv_heads=1, head_dim=64,
                     seed=21)

if not mx.metal.is_available() and not clang_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    path = str(write_tiny_model(tmp_path_factory.mktemp("kernel-model") / "llama-hd64", SPEC))
    model, tokenizer = mlx_lm.load(path)
    return "llama-hd64", path, model, tokenizer


@pytest.fixture(scope="module")
def checks():
    """The engines' self-checks by (shape, pool format), answered once per module: every
    Engine.load checks its shape, and in the harness a check costs more than a test's
    decode. The check itself is test_self_check.py's."""
    return {}


@pytest.fixture(autouse=True)
def kernel_attention(monkeypatch, checks):
    """Attention on the kernel, launches counted; each test must decode through it."""
    launches = []
    run = kernels.run_launch if mx.metal.is_available() else shared_harness().run

    def counted(launch):
        launches.append(launch)
        return run(launch)

    monkeypatch.setenv(ATTENTION_ENV, "kernel")
    monkeypatch.setattr(kernels, "run_launch", counted)
    # The engine's self-check runs uncounted (only decode steps count), in the pool's format.
    check = self_check.check_kernels

    def check_once(dtype, head_dim, block_size, n_heads, n_kv_heads, _run=None, kv=FULL):
        key = (dtype, head_dim, block_size, n_heads, n_kv_heads, kv)
        if key not in checks:
            checks[key] = check(*key[:5], run, kv)
        return checks[key]

    monkeypatch.setattr(self_check, "check_kernels", check_once)
    yield launches
    assert launches, "no decode step ran on the kernel"


def test_a_batch_decodes_on_the_kernel_and_each_row_equals_mlx_lm(family, kernel_attention):
    """Batched decode: one launch serves batch x heads, with per-row block tables and lengths."""
    _, path, model, tokenizer = family
    shared = [(5 * i + 2) % 200 + 3 for i in range(35)]
    prompts = [shared + [40 + i] * (3 * i) for i in range(4)] + [[9, 8, 7]]
    engine = Engine.load(path, CacheConfig(block_size=16, num_blocks=64, memory_tier_bytes=0))
    results = engine.generate_batch(prompts, max_tokens=5)
    for prompt, result in zip(prompts, results):
        assert result.tokens == [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=5)]
    assert max(launch.grid[2] for launch in kernel_attention) == len(prompts)
    # The 3-token prompt prefills on the multi-query kernel (query j sees up to its own position).
    assert any(launch.kernel is kernels.kernel("paged_decode_multi") for launch in kernel_attention)


@pytest.mark.parametrize("family_name", ["gpt_oss", "gemma3_text"])
def test_sliding_window_layers_decode_on_the_kernel(tmp_path, kernel_attention, family_name):
    """Windowed layers (with sinks, for gpt-oss) decode on the kernel past their window: greedy
    tokens equal mlx-lm's, cold and on a prefix hit."""
    spec = TinyModelSpec(family=family_name, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1,
                         head_dim=64, seed=23, sliding_window=24)
    path = str(write_tiny_model(tmp_path / family_name, spec))
    model, tokenizer = mlx_lm.load(path)
    engine = Engine.load(path, CacheConfig(block_size=16, num_blocks=64, memory_tier_bytes=0))
    prompt = [(7 * i + 3) % 300 + 3 for i in range(40)]
    for _ in range(2):  # cold, then a prefix hit
        result = engine.generate(prompt, max_tokens=12)
        assert result.tokens == [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=12)]
    assert result.stats.cached_tokens["pool"] == 32
    windowed = [launch for launch in kernel_attention if any(int(s) for s in launch.inputs[5].tolist())]
    assert windowed, "no decode step ran with a window start"
    if family_name == "gpt_oss":
        assert all(int(launch.inputs[-1].tolist()[6]) == 1 for launch in kernel_attention)  # has_sinks


def test_under_the_speed_gate_each_step_takes_its_buckets_path(family, kernel_attention, monkeypatch):
    """A gate that found the kernels slower at batch 1 and faster at batch 8: a lone request decodes on
    the reference path (its mirror), a batch of four on the kernels; tokens equal mlx-lm's either way."""
    from mlxkv.attention.speed_gate import Bucket, SpeedGate
    from mlxkv.engine import core as core_module  # where build_core chooses the attention path

    gate = SpeedGate(tuple(Bucket(b, c, 2.0 if b == 1 else 0.5, 1.0) for b in (1, 8) for c in (512, 4096, 16384)))
    checked = core_module.choose_attention
    monkeypatch.setattr(core_module, "choose_attention",
                        lambda *shape, **fmt: dataclasses.replace(checked(*shape, **fmt), gate=gate))
    _, path, model, tokenizer = family
    engine = Engine.load(path, CacheConfig(block_size=16, num_blocks=64, memory_tier_bytes=0))
    prompt = [(3 * i + 1) % 200 + 3 for i in range(30)]
    alone = engine.generate(prompt, max_tokens=5)
    assert alone.tokens == [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=5)]
    assert kernel_attention == []  # batch 1: the reference path
    prompts = [prompt[: 20 + 3 * i] for i in range(4)]
    for p, result in zip(prompts, engine.generate_batch(prompts, max_tokens=5)):
        assert result.tokens == [r.token for r in stream_generate(model, tokenizer, p, max_tokens=5)]
    assert {launch.grid[2] for launch in kernel_attention} >= {4}


def test_a_quantized_pool_decodes_on_the_kernel_as_on_its_reference_path(family, kernel_attention, monkeypatch):
    """--kv-bits: the kernels read the pool's own quantized pages; greedy tokens equal the
    reference path's over the same pool (its quantized matmuls), batched and alone."""
    _, path, _, _ = family
    prompts = [[(5 * i + 2) % 200 + 3 for i in range(20 + 9 * j)] for j in range(3)]

    def run():
        config = CacheConfig(block_size=16, num_blocks=64, memory_tier_bytes=0, kv_bits=8, kv_group_size=32)
        engine = Engine.load(path, config)
        return [r.tokens for r in engine.generate_batch(prompts, max_tokens=5)] + [
            engine.generate(prompts[0], max_tokens=5).tokens]

    on_kernels = run()
    quantized = {kernels.kernel("paged_decode", quantized=True), kernels.kernel("paged_decode_multi", quantized=True)}
    assert all(launch.kernel in quantized | {kernels.kernel("paged_reduce")} for launch in kernel_attention)
    assert any(launch.kernel in quantized for launch in kernel_attention)
    monkeypatch.setenv(ATTENTION_ENV, "reference")
    assert run() == on_kernels


class _Scripted:
    """Proposes mlx-lm's continuation, every third proposal spoiled: verify steps of every length."""

    def __init__(self, answers: dict[tuple, list[int]]):
        self.answers, self.count = answers, 0

    def propose(self, requests, lengths):
        from mlxkv.speculative.proposer import Proposal

        out = []
        for request, k in zip(requests, lengths):
            tokens = self.answers[tuple(request.prompt)][len(request.output):len(request.output) + k]
            self.count += len(tokens)
            out.append(Proposal([t if (self.count + i) % 3 else (t + 1) % 500 + 3 for i, t in enumerate(tokens)]))
        return out

    def forget(self, request):
        pass


def test_llama4_verify_steps_across_chunk_boundaries_equal_mlx_lm(tmp_path, kernel_attention):
    """Llama 4's chunked layers (chunks of 32) on the kernels, with speculative verify steps of up
    to 4 proposals: steps that cross a chunk's end keep greedy tokens equal to mlx-lm's."""
    from mlxkv.engine.speculation import Speculation
    from mlxkv.speculative.step_cost import AlwaysSpeculate

    spec = TinyModelSpec(family="llama4", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=1,
                         head_dim=64, seed=27, sliding_window=32)
    path = str(write_tiny_model(tmp_path / "llama4", spec))
    model, tokenizer = mlx_lm.load(path)
    prompts = [[(7 * i + 3) % 300 + 3 for i in range(n)] for n in (27, 58)]
    answers = {tuple(p): [r.token for r in stream_generate(model, tokenizer, p, max_tokens=24)] for p in prompts}
    config = CacheConfig(block_size=16, num_blocks=64, memory_tier_bytes=0, speculative="lookup",
                         speculative_tokens=4)
    engine = Engine.load(path, config)
    engine.loop.speculation = Speculation(_Scripted(answers), 4, AlwaysSpeculate())
    for prompt in prompts:
        assert engine.generate(prompt, max_tokens=24).tokens == answers[tuple(prompt)]
    crossing = []
    for launch in kernel_attention:
        if launch.kernel is kernels.kernel("paged_decode_multi") and launch.inputs[-1].tolist()[9]:
            n_queries, chunk = launch.inputs[-1].tolist()[7], launch.inputs[-1].tolist()[9]
            ctx, start = launch.inputs[4].tolist()[0], launch.inputs[5].tolist()[0]
            crossing.append(ctx - 1 >= start + chunk and ctx - n_queries < start + chunk)
    assert any(crossing), "no verify step crossed a chunk boundary on the kernels"
