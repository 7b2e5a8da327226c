"""The engine thread: one thread owns the model, serves queued requests, cancels, reports."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.host.engine_thread import EngineThread, RequestFailed, RequestHandle, load_engine
from mlxkv.errors import MlxkvError
from mlxkv.host.pool_view import MARK_MEMORY, MARK_NEW, MARK_POOL_HIT, MARK_SPILL, PoolWatcher
from mlxkv.engine.records import GenerationChunk

CONFIG = dict(block_size=8, num_blocks=64, memory_tier_bytes=0)
QUESTION = [{"role": "user", "content": "Tell me about the sea and the ships that sail on it."}]


def tokens(n, start=5):
    return [(start + 13 * i) % 400 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def engine(llama_dir):
    """One engine thread for the module, recording the thread that loaded it."""
    events, loaded_on = [], []

    def load(model, cache, report):
        loaded_on.append(threading.current_thread().name)
        return load_engine(model, cache, report)

    thread = EngineThread(llama_dir, CacheConfig(**CONFIG), on_event=events.append, load=load).start()
    thread.wait_ready(timeout=120)
    thread.events, thread.loaded_on = events, loaded_on
    yield thread
    thread.close()


def run(thread, *args, **kwargs) -> list:
    return list(thread.submit(*args, **kwargs))


def test_model_loads_and_runs_on_the_engine_thread(engine):
    assert engine.loaded_on == ["mlxkv-engine"]
    assert engine.call(lambda e: threading.current_thread().name).result(10) == "mlxkv-engine"
    kinds = [e.kind for e in engine.events]
    assert kinds[0] == "progress" and "ready" in kinds
    ready = next(e for e in engine.events if e.kind == "ready")
    # The pool starts small (it grows on demand) toward its budget of 64 blocks.
    assert ready.snapshot.usage["budget_blocks"] == 64 and ready.info["block_size"] == 8
    assert ready.snapshot.num_blocks == ready.snapshot.usage["size_blocks"] <= 64


def test_records_equal_the_engine_on_the_calling_thread(engine, llama_dir):
    here = Engine.load(llama_dir, CacheConfig(**CONFIG)).generate(tokens(20), max_tokens=12)
    records = run(engine, tokens(20), max_tokens=12)
    assert all(isinstance(r, GenerationChunk) for r in records)
    assert [r.token for r in records] == here.tokens
    assert records[-1].finish_reason == "length" and records[-1].stats.generation_tokens == 12


def test_second_chat_turn_reuses_the_first(engine):
    first = run(engine, messages=QUESTION, max_tokens=8)
    reply = "".join(r.text for r in first)
    second = run(engine, messages=QUESTION + [{"role": "assistant", "content": reply},
                                              {"role": "user", "content": "And then?"}], max_tokens=8)
    assert second[-1].stats.cached_tokens["pool"] >= 8


def test_a_chat_is_templated_on_the_submitting_thread_and_counted_open_until_it_ends(engine, monkeypatch):
    from mlxkv.chat import prompting

    templated_on = []
    chat_prompt = prompting.chat_prompt

    def recorded(*args, **kwargs):
        templated_on.append(threading.current_thread().name)
        return chat_prompt(*args, **kwargs)

    monkeypatch.setattr(prompting, "chat_prompt", recorded)
    handle = engine.submit(messages=QUESTION, max_tokens=4)
    assert engine.open_requests == 1
    assert list(handle)[-1].finish_reason == "length"
    assert templated_on == [threading.current_thread().name] != ["mlxkv-engine"]
    assert engine.open_requests == 0


def test_cancel_keeps_the_reply_so_far_and_releases_blocks(engine):
    handle = engine.submit(tokens(30, start=11), max_tokens=400)
    records = []
    for record in handle:
        records.append(record)
        if len(records) == 3:
            handle.cancel()
    assert records[-1].finish_reason == "cancelled"
    assert 3 <= len(records) < 400
    assert records[-1].stats.generation_tokens == len(records)
    pool = engine.call(lambda e: e.stats()["pool"]).result(10)
    assert pool["in_use"] == 0


def test_cancel_before_start_and_a_bad_request_leave_the_thread_serving(engine):
    busy = engine.submit(tokens(10, start=3), max_tokens=60)
    queued = engine.submit(tokens(10, start=4), max_tokens=5)
    queued.cancel()
    too_long = engine.submit(tokens(10), max_tokens=10_000)
    assert list(busy)[-1].finish_reason == "length"
    assert list(queued) == [RequestFailed("cancelled before it started", "cancelled")]
    failed = list(too_long)
    assert isinstance(failed[-1], RequestFailed) and "blocks" in failed[-1].message
    assert run(engine, tokens(10), max_tokens=2)[-1].finish_reason == "length"


def test_snapshots_mark_pool_hits_and_new_blocks(engine):
    prompt = tokens(40, start=21)
    run(engine, prompt, max_tokens=4)
    del engine.events[:]
    run(engine, prompt + tokens(16, start=2), max_tokens=4)
    snaps = [e.snapshot for e in engine.events if e.kind == "snapshot"]
    during = snaps[0]  # the first token's snapshot: the prompt's blocks are held
    assert during.mark_counts[MARK_POOL_HIT] == 40 // 8  # the first prompt's full blocks
    assert during.mark_counts[MARK_NEW] >= 1
    assert "u" in during.states
    after = snaps[-1]
    assert set(after.states) <= {".", "c"} and after.usage["in_use"] == 0
    assert after.mark_counts[MARK_POOL_HIT] == 40 // 8  # marks last for the turn


def test_load_failure_is_reported_not_raised_on_the_thread(tmp_path):
    events = []
    thread = EngineThread(str(tmp_path / "nothing"), on_event=events.append).start()
    with pytest.raises(MlxkvError, match="model not found"):
        thread.wait_ready(timeout=60)
    assert [e.kind for e in events][-1] == "failed"
    assert isinstance(list(thread.submit("hi"))[-1], RequestFailed)
    thread.close()
    assert not thread.alive and events[-1].kind == "closed"


def test_warnings_while_loading_ride_on_the_ready_event(llama_dir, tmp_path, recwarn):
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    events = []
    thread = EngineThread(llama_dir, CacheConfig(**CONFIG, disk_tier=str(not_a_dir)), on_event=events.append).start()
    thread.wait_ready(timeout=120)
    thread.close()
    [ready] = [e for e in events if e.kind == "ready"]
    [warning] = ready.warnings
    assert warning == f"SSD tier disabled: Not a directory: {not_a_dir}"
    assert "disk" not in ready.info["connector"]
    assert not [w for w in recwarn if "SSD tier" in str(w.message)]  # reported, not also printed


def test_close_cancels_open_requests_and_refuses_new_ones(llama_dir):
    thread = EngineThread(llama_dir, CacheConfig(**CONFIG)).start()
    handle = thread.submit(tokens(12), max_tokens=500)
    next(iter(handle))
    thread.close()
    assert not thread.alive
    assert list(handle)[-1].finish_reason == "cancelled"
    with pytest.raises(MlxkvError, match="closed"):
        thread.submit("hi")


def test_batches_come_at_most_once_per_interval_and_the_first_at_once():
    # Bounds with room for a loaded machine: the interval is long next to the feeder's
    # sleeps, and "at once" means well inside one interval, not a speed.
    interval = 0.2
    handle = RequestHandle(0)
    for i in range(5):
        handle._put(GenerationChunk(str(i), i))
    got, times = [], []
    start = time.monotonic()

    def feed():
        for i in range(5, 30):
            time.sleep(0.01)
            handle._put(GenerationChunk(str(i), i))
        handle._put(GenerationChunk("!", 30, "length"))

    threading.Thread(target=feed).start()
    for batch in handle.batches(interval):
        got.append(batch)
        times.append(time.monotonic() - start)
    assert [r.token for r in got[0]] == [0, 1, 2, 3, 4] and times[0] < interval / 2
    assert [r.token for b in got for r in b] == list(range(31))
    spaced = times[:-1]  # the last record is passed on at once
    assert all(b - a >= interval * 0.9 for a, b in zip(spaced, spaced[1:]))
    assert len(got) < len(range(31))  # records were merged, not passed one by one


def test_pool_watcher_marks_hydration_from_memory_and_spills(llama_dir):
    engine = Engine.load(llama_dir, CacheConfig(block_size=8, num_blocks=12, memory_tier_bytes=1 << 20))
    watcher = PoolWatcher.of(engine)
    prompt = tokens(40, start=31)
    engine.generate(prompt, max_tokens=2)
    engine.generate(tokens(80, start=7), max_tokens=2)  # evicts the first prompt's blocks to memory
    watcher.begin()
    stream = engine.stream(prompt, max_tokens=2)
    next(stream)
    snap = watcher.snapshot()
    stream.close()
    assert snap.mark_counts[MARK_MEMORY] + snap.mark_counts[MARK_SPILL] >= 39 // 8
    assert snap.mark_counts[MARK_MEMORY] > 0
    assert snap.tiers["memory"]["hydrations"] > 0



def test_a_snapshot_after_the_pool_shrank_is_the_pool_s_size(llama_dir):
    engine = Engine.load(llama_dir, CacheConfig(block_size=8, num_blocks=512, idle_shrink_s=0))
    watcher = PoolWatcher.of(engine)
    for start in (3, 4, 5):
        engine.generate(tokens(120, start=start), max_tokens=2)
    watcher.snapshot()
    engine.idle(1)  # shrinks while the watcher's marks are of the bigger pool
    snap = watcher.snapshot()
    assert len(snap.marks) == len(snap.states) == engine.block_pool.size < 512

EXITER = """
import sys
import mlxkv
from mlxkv.config import CacheConfig
from mlxkv.host.engine_thread import EngineThread
thread = EngineThread(sys.argv[1], CacheConfig(), on_event=lambda event: None).start()
for _ in thread.submit(prompt=[5, 6, 7, 8], max_tokens=4).batches(0.01):
    pass
thread.close()
"""


@pytest.mark.slow
def test_a_process_that_used_the_engine_thread_exits_cleanly(llama_dir):
    # Its MLX stream outlived the thread and the exit aborted (code 134) in
    # about half the runs; four runs all pass only 1 time in 16 without the fix.
    for _ in range(4):
        out = subprocess.run([sys.executable, "-c", EXITER, llama_dir], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-500:]


def long_chat(turns: int) -> list[dict]:
    words = "the ships sail on the sea and the wind is strong tonight".split()
    return [{"role": "system", "content": "You are brief."}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": " ".join(words[i % 5:] + [str(i)])}
        for i in range(turns)
    ]


def test_a_chat_longer_than_the_context_leaves_out_its_oldest_turns_and_keeps_its_prefix(engine):
    messages = long_chat(41)  # about 900 tokens; the pool holds 512, less 8 for the reply
    refused = run(engine, messages=messages, max_tokens=8)
    assert isinstance(refused[-1], RequestFailed) and "blocks" in refused[-1].message

    first = engine.submit(messages=messages, fit_context=True, max_tokens=8)
    first_stats = list(first)[-1].stats
    assert first.left_out > 0 and first_stats.prompt_tokens <= 504
    # The next turn keeps the same start, so this prompt is the next one's cached prefix.
    following = messages + [{"role": "assistant", "content": "a fixed reply"}, {"role": "user", "content": "more?"}]
    second = engine.submit(messages=following, fit_context=True, max_tokens=8)
    second_stats = list(second)[-1].stats
    assert second.left_out == first.left_out
    assert second_stats.cached_tokens["pool"] >= first_stats.prompt_tokens - CONFIG["block_size"]
    short = engine.submit(messages=QUESTION, fit_context=True, max_tokens=2)
    assert list(short)[-1].finish_reason == "length" and short.left_out == 0  # fits: nothing left out


def test_a_prefill_with_reply_room_loads_the_window_its_replies_use(engine):
    stored = long_chat(41) + [{"role": "assistant", "content": "a stored reply"}]
    nearer = engine.submit(messages=stored, fit_context=True, max_tokens=1)  # fitted for a 1-token reply
    list(nearer)
    prefill = engine.submit(messages=stored, fit_context=True, max_tokens=1, reply_room=64)
    prefill_stats = list(prefill)[-1].stats
    reply = engine.submit(messages=stored + [{"role": "user", "content": "and then?"}], fit_context=True, max_tokens=64)
    reply_stats = list(reply)[-1].stats
    assert nearer.left_out < prefill.left_out == reply.left_out
    # All but the prefill's last blocks: its prompt ends in the generation prompt, not the user turn.
    assert reply_stats.cached_tokens["pool"] >= prefill_stats.prompt_tokens - 2 * CONFIG["block_size"]
    with pytest.raises(MlxkvError, match="reply_room must be a whole number, at least 1, got 0"):
        engine.submit(messages=stored, fit_context=True, reply_room=0)


def test_an_idle_thread_lets_the_engine_give_memory_back(llama_dir):
    cache = CacheConfig(block_size=8, num_blocks=512, memory_tier_bytes=16 << 20, idle_shrink_s=0.3)
    thread = EngineThread(llama_dir, cache, idle_tick=0.05).start()
    thread.wait_ready(120)
    try:
        first = [run(thread, tokens(120, start=s), max_tokens=4) for s in (3, 4, 5)]
        grown = thread.call(lambda e: e.stats()["pool"]["size_blocks"]).result()
        size = grown
        deadline = time.monotonic() + 30
        while size == grown and time.monotonic() < deadline:
            time.sleep(0.05)
            size = thread.call(lambda e: e.stats()["pool"]["size_blocks"]).result()
        assert size < grown  # the pool shrank by itself, the thread idle
        again = [run(thread, tokens(120, start=s), max_tokens=4) for s in (3, 4, 5)]
        assert [[r.token for r in reply] for reply in again] == [[r.token for r in reply] for reply in first]
    finally:
        thread.close()


def test_a_call_after_the_close_is_an_error_not_a_wait_forever():
    def load(model, cache, report):
        raise MlxkvError("no such model")

    thread = EngineThread("nowhere", CacheConfig(**CONFIG), on_event=lambda e: None, load=load).start()
    thread.close()
    with pytest.raises(MlxkvError, match="closed"):
        thread.call(lambda e: 1).result(5)
