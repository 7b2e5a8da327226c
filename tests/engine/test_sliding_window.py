"""Sliding-window families under the pool: greedy output equals mlx-lm's, cold,
on prefix hits, in a batch, after evictions to the tiers, with windows small
enough (32 tokens, 16-token blocks) that every test prompt wraps them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import safetensors

from family_support import model_with_oracle, prompt_of
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.tiny import WINDOWED_FAMILIES, TinyModelSpec

BLOCK = 16
WINDOW = 32
SPECS = {
    "gemma3_text": TinyModelSpec(family="gemma3_text", num_layers=4, seed=31),
    "gpt_oss": TinyModelSpec(family="gpt_oss", num_layers=4, seed=32),
    "olmo3": TinyModelSpec(family="olmo3", num_layers=4, seed=33),
}
# gemma4_text, whose two shapes share pages, has its own tests (test_new_rules.py).
assert set(SPECS) | {"gemma4_text"} == set(WINDOWED_FAMILIES) and all(s.sliding_window == WINDOW for s in SPECS.values())


@pytest.fixture(scope="module", params=list(SPECS))
def family(request, tmp_path_factory):
    return model_with_oracle(tmp_path_factory.mktemp("windowed") / request.param, SPECS[request.param])


def engine_for(loaded, num_blocks=256, prefill_chunk=512, **cache) -> Engine:
    config = CacheConfig(block_size=BLOCK, num_blocks=num_blocks, **{"memory_tier_bytes": 0, **cache})
    return Engine(loaded, config, prefill_chunk=prefill_chunk)


@pytest.mark.slow  # over a second or many params: the not-slow suite's 2 minutes
@pytest.mark.parametrize("length", [1, 20, WINDOW, WINDOW + 1, 3 * BLOCK + 5, 130])
def test_cold_prompts_match_mlx_lm(family, length):
    _, loaded, reference = family
    prompt = prompt_of(length)
    result = engine_for(loaded).generate(prompt, max_tokens=40)  # decode wraps the window too
    assert result.tokens == reference(prompt, 40)


def test_a_second_turn_hits_the_first_and_matches_mlx_lm(family):
    _, loaded, reference = family
    engine = engine_for(loaded)
    first = prompt_of(70)
    turn1 = engine.generate(first, max_tokens=20)
    second = first + turn1.tokens + prompt_of(9, salt=3)
    turn2 = engine.generate(second, max_tokens=20)
    # The whole first turn is reused, to its last full block: every group had its window cached.
    assert turn2.stats.cached_tokens["pool"] == (len(first) + len(turn1.tokens)) // BLOCK * BLOCK
    assert turn2.tokens == reference(second, 20)


@pytest.mark.parametrize("extra", [1, BLOCK, 2 * BLOCK + 3])
def test_a_prompt_that_extends_an_earlier_one_reuses_it_at_block_granularity(family, extra):
    _, loaded, reference = family
    engine = engine_for(loaded)
    base = prompt_of(90, salt=7)
    engine.generate(base, max_tokens=2)
    longer = base + prompt_of(extra, salt=9)
    result = engine.generate(longer, max_tokens=12)
    assert result.stats.cached_tokens["pool"] == min(len(base), len(longer) - 1) // BLOCK * BLOCK
    assert result.tokens == reference(longer, 12)


def held_per_step(engine: Engine, prompt: list[int], max_tokens: int) -> list[tuple[int, list[int]]]:
    """(tokens computed, blocks held per group) after every step of one request."""
    request = engine.make_request(prompt, lambda record: None, max_tokens=max_tokens)
    engine.loop.add(request)
    seen = []
    while engine.loop.has_work:
        engine.loop.step()
        seq = request.seq
        held = [len(m.tables.held(request.request_id)) for m in engine.coordinator.attention]
        if seq is not None and any(held):
            seen.append((seq.num_computed, held))
    return seen


def test_a_running_sequence_holds_only_its_window_in_a_sliding_group(family):
    _, loaded, _ = family
    engine = engine_for(loaded, prefill_chunk=BLOCK)
    seen = held_per_step(engine, prompt_of(150), max_tokens=40)
    assert seen and seen[-1][0] > 150  # it decoded past its prompt
    # The window (a partial block at each end), and the block being written:
    # independent of the context, which grows to 190 tokens (12 blocks).
    bound = -(-WINDOW // BLOCK) + 2
    for computed, held in seen:
        for group in engine.coordinator.group_layout.groups:
            if group.window is None:  # the whole prompt's blocks from admission on
                assert held[group.index] == -(-max(computed, 150) // BLOCK)
            else:
                assert held[group.index] <= bound, (computed, held)


def test_a_batch_equals_solo_runs(family):
    _, loaded, reference = family
    shared = prompt_of(60, salt=1)
    prompts = [shared + prompt_of(3 * i + 1, salt=20 + i) for i in range(3)] + [prompt_of(7, salt=2), prompt_of(100)]
    results = engine_for(loaded).generate_batch(prompts, max_tokens=24)
    for prompt, result in zip(prompts, results):
        assert result.tokens == reference(prompt, 24)


@pytest.mark.slow  # over a second or many params: the not-slow suite's 2 minutes
def test_preemption_and_evictions_through_the_memory_tier_keep_output_equal(family):
    _, loaded, reference = family
    # Room for one request and a little: the others are preempted, cached blocks evicted to the tier.
    peak = engine_for(loaded).coordinator.peak_blocks(80 + 30, 512)
    engine = engine_for(loaded, num_blocks=peak + 4, memory_tier_bytes=64 << 20)
    prompts = [prompt_of(80, salt=s) for s in range(4)]
    results = engine.generate_batch(prompts, max_tokens=30)
    assert any(r.stats.preemptions for r in results)
    for prompt, result in zip(prompts, results):
        assert result.tokens == reference(prompt, 30)
    again = engine.generate(prompts[0], max_tokens=30)
    assert again.stats.cached_tokens["memory"] > 0  # evicted, then hydrated back, every group
    assert again.tokens == reference(prompts[0], 30)
    tier = engine.stats()["connector"]["memory"]
    assert tier["spills"] > 0 and tier["hydrations"] > 0


@pytest.mark.slow  # two processes per family
def test_a_new_process_restores_the_prefix_from_the_ssd_tier(family, tmp_path):
    path, loaded, reference = family
    text = " ".join(f"the {w} ship sails on the sea at night" for w in ("old", "red", "tall", "slow", "last"))

    def run() -> dict:
        out = subprocess.run([sys.executable, "-m", "mlxkv.cli", "generate", "--model", path, "--raw", "--json",
                              "--max-tokens", "12", "--block-size", str(BLOCK), "--disk-tier", str(tmp_path / "kv"),
                              "--prompt", text], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[-1])

    first, second = run(), run()
    prompt = second["prompt_tokens"]
    assert len(prompt) > 3 * WINDOW  # the window wraps more than twice
    assert first["cached_tokens"]["disk"] == 0
    # Every group's blocks come back from disk: the full group's from the
    # first, the sliding groups' for the last window before the hit.
    assert second["cached_tokens"]["disk"] == (len(prompt) - 1) // BLOCK * BLOCK
    assert first["tokens"] == second["tokens"] == reference(prompt, 12)
    # Every group's blocks went to disk, each file saying whose they are.
    groups = {safetensors.safe_open(str(f), "np").metadata()["group"] for f in (tmp_path / "kv").rglob("*.safetensors")}
    assert groups == {str(g.index) for g in engine_for(loaded).coordinator.group_layout.groups}
