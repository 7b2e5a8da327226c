"""Recurrent and linear-attention hybrids under the pool: greedy output equals
mlx-lm's cold, on prefix hits through state checkpoints, in a batch, through
preemption, and after a restart from the SSD tier."""

from __future__ import annotations

import shutil

import pytest
import safetensors

from family_support import (
    assert_a_restart_resumes_the_chat, assert_next_turn_reuses_the_first, model_with_oracle, prompt_of,
    run_in_new_process,
)
from mlxkv.cache.checkpoints import checkpoint_key
from mlxkv.cache.hashing import extend_block_hashes, root_hash
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.tiny import RECURRENT_FAMILIES, TinyModelSpec

BLOCK = 16
INTERVAL = 32  # a checkpoint every two blocks of a long prefill
SPECS = {
    "qwen3_next": TinyModelSpec(family="qwen3_next", num_layers=4, seed=41),
    "lfm2": TinyModelSpec(family="lfm2", num_layers=4, seed=42),
    "nemotron_h": TinyModelSpec(family="nemotron_h", num_layers=4, seed=43),
}
assert set(SPECS) == set(RECURRENT_FAMILIES)


@pytest.fixture(scope="module", params=list(SPECS))
def family(request, tmp_path_factory):
    return model_with_oracle(tmp_path_factory.mktemp("recurrent") / request.param, SPECS[request.param])


def engine_for(loaded, num_blocks=128, prefill_chunk=512, **cache) -> Engine:
    config = CacheConfig(block_size=BLOCK, num_blocks=num_blocks,
                         **{"memory_tier_bytes": 0, "checkpoint_interval": INTERVAL, **cache})
    return Engine(loaded, config, prefill_chunk=prefill_chunk)


def test_the_recurrent_layers_are_their_own_slots(family):
    _, loaded, _ = family
    layout = engine_for(loaded).coordinator.group_layout
    assert layout.has_recurrent and layout.groups and not layout.is_plain
    assert not set(layout.recurrent) & {s for g in layout.groups for s in g.slots}


@pytest.mark.slow  # over a second or many params: the not-slow suite's 2 minutes
@pytest.mark.parametrize("length", [1, 15, BLOCK, 2 * BLOCK + 1, 75, 130])
def test_cold_prompts_match_mlx_lm(family, length):
    _, loaded, reference = family
    prompt = prompt_of(length)
    assert engine_for(loaded).generate(prompt, max_tokens=24).tokens == reference(prompt, 24)


def test_a_second_chat_turn_reuses_the_whole_first_turn(family):
    _, loaded, reference = family
    # The reply's last full block: a checkpoint taken where the first turn left.
    assert_next_turn_reuses_the_first(engine_for(loaded), reference, BLOCK)


@pytest.mark.parametrize("extra", [1, BLOCK + 3, 3 * BLOCK])
def test_a_longer_prompt_resumes_at_the_last_checkpoint_it_shares(family, extra):
    _, loaded, reference = family
    engine = engine_for(loaded)
    base = prompt_of(90, salt=7)  # checkpoints at 32, 64 (the interval) and 80 (its last full block)
    engine.generate(base, max_tokens=1)
    longer = base[:85] + prompt_of(extra, salt=9)
    result = engine.generate(longer, max_tokens=12)
    assert result.stats.cached_tokens["pool"] == 80 if len(longer) > 81 else 64
    assert result.tokens == reference(longer, 12)


def test_a_batch_equals_solo_runs(family):
    _, loaded, reference = family
    shared = prompt_of(60, salt=1)
    prompts = [shared + prompt_of(3 * i + 1, salt=20 + i) for i in range(3)] + [prompt_of(1), prompt_of(100)]
    results = engine_for(loaded).generate_batch(prompts, max_tokens=24)
    for prompt, result in zip(prompts, results):
        assert result.tokens == reference(prompt, 24)


@pytest.mark.slow
def test_preemption_resumes_from_a_checkpoint_with_the_same_output(family):
    _, loaded, reference = family
    peak = engine_for(loaded).coordinator.peak_blocks(80 + 40, 512)
    engine = engine_for(loaded, num_blocks=peak + 3)
    prompts = [prompt_of(80, salt=s) for s in range(4)]
    results = engine.generate_batch(prompts, max_tokens=40)
    assert any(r.stats.preemptions for r in results)
    for prompt, result in zip(prompts, results):
        assert result.tokens == reference(prompt, 40)


def budget_of(loaded, checkpoints: float, **cache) -> Engine:
    """An engine whose checkpoint share of the budget holds about this many checkpoints."""
    probe = engine_for(loaded)
    probe.generate(prompt_of(40), max_tokens=1)
    one = probe.checkpoints.stats()["bytes_held"]
    budget = checkpoints * one
    pool_bytes = probe.stats()["pool_budget_bytes"]
    return engine_for(loaded, checkpoint_share=budget / (budget + pool_bytes), **cache), one


def test_checkpoints_are_budgeted_and_evicted_least_recently_used_first(family):
    _, loaded, reference = family
    engine, one = budget_of(loaded, 5.5)
    store = engine.checkpoints
    for salt in range(40):  # a checkpoint each, at its last full block
        engine.generate(prompt_of(40, salt=salt), max_tokens=1)
    stats = store.stats()
    assert stats["bytes_held"] <= stats["budget_bytes"] and stats["evictions"] == 35
    assert stats["held"] == 5 and stats["bytes_held"] == 5 * one
    # The newest prompt still resumes; the oldest recomputes; both are right.
    for salt, hit in ((39, 32), (0, 0)):
        result = engine.generate(prompt_of(40, salt=salt) + [9], max_tokens=6)
        assert result.stats.cached_tokens["pool"] == hit
        assert result.tokens == reference(prompt_of(40, salt=salt) + [9], 6)


def test_evicted_checkpoints_come_back_from_the_memory_tier(family):
    _, loaded, reference = family
    engine, _ = budget_of(loaded, 5.5, memory_tier_bytes=64 << 20)
    for salt in range(40):
        engine.generate(prompt_of(40, salt=salt), max_tokens=1)
    prompt = prompt_of(40, salt=0) + [9]
    result = engine.generate(prompt, max_tokens=6)
    assert result.stats.cached_tokens["memory"] == 32
    assert result.tokens == reference(prompt, 6)
    assert engine.stats()["connector"]["memory"]["checkpoints"] > 0


# -- the SSD tier: restart, faults --------------------------------------------------

@pytest.mark.slow  # three processes per family
def test_a_new_process_restores_a_chat_from_the_ssd_tier(family, tmp_path):
    path, _, reference = family
    second, turn2 = assert_a_restart_resumes_the_chat(path, tmp_path / "kv", reference, BLOCK)
    # Restarted again, the same prompt again: the first turn's end is still on disk
    # (only the checkpoint a request leaves is written through).
    assert run_in_new_process(path, tmp_path / "kv", second) == turn2


def checkpoint_files(directory) -> dict[bytes, object]:
    """The SSD tier's checkpoint files, by key."""
    files = {}
    for f in directory.rglob("*.safetensors"):
        meta = safetensors.safe_open(str(f), "np").metadata()
        if meta["format"] == "mlxkv-state":
            files[bytes.fromhex(meta["block_hashes"])] = f
    return files


@pytest.mark.parametrize("fault", ["corrupt", "missing"])
def test_a_bad_checkpoint_file_falls_back_to_the_longest_good_hit(family, tmp_path, fault):
    _, loaded, reference = family
    prompt = prompt_of(90, salt=5)  # checkpoints at 32, 64 and 80
    # A store that keeps one: the first two spill to disk as the next ones come;
    # the last (where the request left) is written through.
    engine, _ = budget_of(loaded, 1.5, disk_tier=str(tmp_path / "kv"), checkpoint_write_ratio=0)
    with engine:
        engine.generate(prompt, max_tokens=1)
        hashes = extend_block_hashes([], root_hash(engine.fingerprint), prompt, BLOCK)
    files = checkpoint_files(tmp_path / "kv")
    at = {boundary: files[checkpoint_key(hashes[boundary // BLOCK - 1])] for boundary in (32, 64, 80)}
    for boundary in (64, 80):  # both later ones go bad: the hit falls back to 32
        if fault == "missing":
            at[boundary].unlink()
        else:
            data = bytearray(at[boundary].read_bytes())
            data[-5] ^= 0xFF  # a flipped bit in the last tensor
            at[boundary].write_bytes(bytes(data))
    longer = prompt + prompt_of(7, salt=8)
    with engine_for(loaded, disk_tier=str(tmp_path / "kv")) as engine:  # a restart
        result = engine.generate(longer, max_tokens=12)
        disk = engine.stats()["connector"]["disk"]
    assert result.stats.cached_tokens["disk"] == 32
    assert result.tokens == reference(longer, 12)
    assert disk["corrupt"] == (2 if fault == "corrupt" else 0)


@pytest.mark.slow
def test_short_turns_write_a_checkpoint_only_once_the_kv_since_the_last_outweighs_it(family, tmp_path):
    """The SSD write policy (groups/recurrent.py): turns whose KV is small against a
    checkpoint leave theirs in memory; after a crash a restart resumes at the last
    one on disk and recomputes the rest, with the same output. A clean close writes
    the newest one, so a restart then resumes at the last turn."""
    path, loaded, reference = family
    disk = tmp_path / "kv"
    with engine_for(loaded, checkpoint_interval=4096) as probe:
        probe.generate(prompt_of(40), max_tokens=1)
        state_bytes = probe.checkpoints.stats()["bytes_held"]
        per_token = probe.kv_layout.bytes_per_block // BLOCK
    # Each turn adds 32 tokens and leaves its checkpoint on a block boundary
    # (32, 64, ...); at this ratio a checkpoint is written once 3 turns of KV
    # have gone by since the last one written: after turns 2 and 5.
    ratio = 3 * 32 * per_token / state_bytes
    chat, written = [], []
    engine = engine_for(loaded, disk_tier=str(disk), checkpoint_interval=4096, checkpoint_write_ratio=ratio)
    for turn in range(7):
        chat += prompt_of(32 if turn == 0 else 24, salt=turn)
        result = engine.generate(chat, max_tokens=8)
        chat += result.tokens
        engine.connector.flush(30)
        written.append(len(checkpoint_files(disk)))
    assert written == [0, 0, 1, 1, 1, 2, 2]
    follow = chat + prompt_of(5, salt=99)
    # As after a crash (no close): the last one written (turn 5's), not turn 6's. On a
    # copy: that process's own close writes its branch point (turn 6's end, which the
    # chat and `follow` share), and the close below is to be seen writing it here.
    crash = tmp_path / "crash"
    shutil.copytree(disk, crash)
    crashed = run_in_new_process(path, crash, follow, write_ratio=ratio)
    assert crashed["cached"]["disk"] == 6 * 32
    assert crashed["tokens"] == reference(follow, 16)
    before = len(checkpoint_files(disk))
    engine.close()  # clean: turn 6's checkpoint goes to disk, one file more
    assert len(checkpoint_files(disk)) == before + 1
    restarted = run_in_new_process(path, disk, follow, write_ratio=ratio)
    assert restarted["cached"]["disk"] == 7 * 32
    assert restarted["tokens"] == reference(follow, 16)


@pytest.mark.slow
def test_a_short_chat_survives_a_restart_though_the_ratio_writes_nothing(family, tmp_path, request):
    """Short turns write no checkpoint by the ratio (here as if the state were
    huge, as a real model's is against a short turn's KV), but a clean close (or
    a pause) writes each chat's newest: the next process resumes at its last turn."""
    path, loaded, reference = family
    # Both ways out call the same write_pending, whatever the family: one family pauses, the others close
    # (each way, each family, three restarts instead of six).
    leave = "idle" if request.node.callspec.params["family"] == "qwen3_next" else "close"
    disk, ratio = tmp_path / "kv", 1e9
    engine = engine_for(loaded, disk_tier=str(disk), checkpoint_interval=2048, checkpoint_write_ratio=ratio)
    chat = prompt_of(40, salt=11)
    chat += engine.generate(chat, max_tokens=10).tokens + prompt_of(12, salt=12)
    chat += engine.generate(chat, max_tokens=10).tokens
    engine.connector.flush(30)
    assert checkpoint_files(disk) == {}  # nothing written by the ratio
    if leave == "close":
        engine.close()
    else:
        engine.idle(engine.config.checkpoints.idle_s)
        engine.connector.flush(30)
    assert len(checkpoint_files(disk)) == 1
    follow = chat + prompt_of(6, salt=13)
    restarted = run_in_new_process(path, disk, follow, write_ratio=ratio)
    assert restarted["cached"]["disk"] == (len(chat) - 1) // BLOCK * BLOCK  # the whole chat, to its last full block
    assert restarted["tokens"] == reference(follow, 16)
    engine.close()


@pytest.mark.slow
def test_a_new_chat_on_a_shared_head_resumes_at_the_head_after_a_restart(family, tmp_path):
    """Two chats share a 3-block head, then diverge: the second takes a checkpoint at
    the branch point, and the close writes it (the ratio writes nothing). A restarted
    engine's third chat on the same head resumes at the head's end, equal to a cold run."""
    _, loaded, reference = family
    disk, head = str(tmp_path / "kv"), prompt_of(3 * BLOCK, salt=21)
    with engine_for(loaded, disk_tier=disk, checkpoint_interval=2048, checkpoint_write_ratio=1e9) as engine:
        for salt in (22, 23):
            engine.generate(head + prompt_of(20, salt=salt), max_tokens=4)
    third = head + prompt_of(20, salt=24)
    with engine_for(loaded, disk_tier=disk) as engine:  # a restart
        result = engine.generate(third, max_tokens=8)
    assert result.stats.cached_tokens["disk"] == len(head)
    assert result.tokens == reference(third, 8)
