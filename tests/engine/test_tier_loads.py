"""Tier reads off the step path: the loading state, its installs, its failures and aborts,
eviction writes outside `allocate`, and restore-or-recompute on injected speeds.

Every output is compared with a cold run on a fresh engine (itself equal to
mlx-lm's, test_engine_equality.py). Nothing here asserts on time: order is
read from the requests' states and the records each step hands out.
"""

from __future__ import annotations

import threading

import pytest

from mlxkv.cache.coordinator import HYDRATE_ATTEMPTS
from mlxkv.cache.connector import CheckpointLoad, LoadedBlock, NoopKVCacheConnector
from mlxkv.cache.tier_loads import LoadState
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.engine.records import GenerationChunk
from mlxkv.engine.request import RequestState
from mlxkv.models.loader import load_model
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model

BLOCK = 4
PROMPT = [(5 * i + 7) % 300 + 3 for i in range(41)]  # 10 full blocks of prefix
OTHER = [(3 * i + 1) % 300 + 3 for i in range(6)]
MAX = 5


@pytest.fixture(scope="module")
def loaded(llama_dir):
    return load_model(llama_dir)


@pytest.fixture(scope="module")
def cold(loaded):
    engine = Engine(loaded, CacheConfig(block_size=BLOCK, num_blocks=64, memory_tier_bytes=0))
    return engine.generate(PROMPT, max_tokens=MAX).tokens


def engine_with(loaded, **tiers) -> Engine:
    return Engine(loaded, CacheConfig(block_size=BLOCK, num_blocks=64, memory_tier_bytes=0, **tiers))


class GatedJob:
    """A load whose read waits for the test's gate, then hands its blocks out two at a time."""

    def __init__(self, tier: Gated, hashes):
        self.tier, self.hashes, self.reads, self.blocks = tier, list(hashes), [], []

    def run(self):
        self.tier.run_threads.append(threading.current_thread().name)
        self.tier.gate.wait(30)
        if self.tier.fail == "raise":
            raise OSError("the disk went away")
        found = [LoadedBlock(h, self.tier.kept[h], "disk") for h in self.hashes if h in self.tier.kept]
        self.blocks = found[:2] if self.tier.fail == "short" else found

    def take(self, max_bytes):
        self.tier.take_threads.append(threading.current_thread().name)
        out, self.blocks = self.blocks[:2], self.blocks[2:]
        return out


class Gated(NoopKVCacheConnector):
    """A tier that keeps what it is given and loads through GatedJob."""

    tier_name = "disk"

    def __init__(self, fail=None):
        self.kept, self.gate, self.fail = {}, threading.Event(), fail
        self.run_threads, self.take_threads = [], []

    def get_computed_blocks(self, hashes):
        n = 0
        while n < len(hashes) and hashes[n] in self.kept:
            n += 1
        return n

    def cache_blocks(self, hashes, read):
        self.kept.update(zip(hashes, read()))

    def begin_load(self, hashes):
        return GatedJob(self, hashes)


def warmed(loaded, connector) -> Engine:
    """A fresh engine whose tier (not its pool) holds PROMPT's prefix."""
    engine_with(loaded, connector=connector).generate(PROMPT, max_tokens=1)
    return engine_with(loaded, connector=connector)


def tokens_of(records) -> list[int]:
    return [r.token for r in records if isinstance(r, GenerationChunk)]


def test_a_loading_request_gets_no_work_while_the_batch_decodes(loaded, cold):
    tier = Gated()
    engine = warmed(loaded, tier)
    core, scheduler = engine.core, engine.loop.scheduler
    planned = []
    schedule = scheduler.schedule

    def recorded(*args):
        plan = schedule(*args)
        planned.append({r.request_id for r in plan.decode} | {r.request_id for r, _ in plan.prefill})
        return plan

    scheduler.schedule = recorded
    stream_records, hit_records = [], []
    stream = engine.make_request(OTHER, stream_records.append, max_tokens=40)
    core.add(stream)
    core.step()
    hit = engine.make_request(PROMPT, hit_records.append, max_tokens=MAX)
    core.add(hit)
    states = []
    for _ in range(6):
        core.step()
        states.append((hit.state, len(stream_records)))
    assert all(state is RequestState.LOADING for state, _ in states)
    assert states[-1][1] - states[0][1] >= 4  # the stream kept decoding meanwhile
    assert not any(hit.request_id in ids for ids in planned)
    tier.gate.set()
    while core.has_work:
        core.step()
    assert tokens_of(hit_records) == cold
    assert tier.run_threads and all(name.startswith("mlxkv-tier-load") for name in tier.run_threads)
    assert set(tier.take_threads) == {threading.current_thread().name}  # installs: the engine thread's
    stats = hit_records[-1].stats
    assert stats.cached_tokens["disk"] == 40 and stats.restore == "restore" and stats.loading_s > 0


def test_aborting_a_loading_request_gives_everything_back(loaded, cold):
    tier = Gated()
    engine = warmed(loaded, tier)
    records = []
    request = engine.make_request(PROMPT, records.append, max_tokens=MAX)
    engine.core.add(request)
    engine.core.step()
    assert request.state is RequestState.LOADING and engine.block_pool.in_use > 0
    engine.core.abort(request)
    assert request.state is RequestState.FINISHED and engine.block_pool.in_use == 0
    assert not engine.core.has_work and not engine.loop.scheduler.loading
    tier.gate.set()  # the read finishes after the abort: dropped
    assert engine.generate(PROMPT, max_tokens=MAX).tokens == cold
    assert engine.block_pool.in_use == 0


@pytest.mark.parametrize("fail", ["raise", "short"])
def test_a_failed_read_is_recomputed(loaded, cold, fail):
    tier = Gated(fail=fail)
    tier.gate.set()
    engine = warmed(loaded, tier)
    result = engine.generate(PROMPT, max_tokens=MAX)
    assert result.tokens == cold
    # "short": each load installs the two blocks it read, which the next look hits in the pool,
    # until the request settles for the pool alone.
    assert result.stats.cached_tokens["disk"] == 0
    assert result.stats.cached_tokens["pool"] == (2 * BLOCK * HYDRATE_ATTEMPTS if fail == "short" else 0)
    assert engine.block_pool.in_use == 0


@pytest.mark.slow
def test_a_stream_decodes_while_an_ssd_restore_is_in_flight(loaded, cold, tmp_path):
    first = engine_with(loaded, disk_tier=str(tmp_path))
    first.generate(PROMPT, max_tokens=1)
    first.close()
    engine = engine_with(loaded, disk_tier=str(tmp_path))  # a fresh pool on the same files
    reader, gate = engine.connector.reader, threading.Event()
    stage = reader.stage
    reader.stage = lambda hashes: (gate.wait(30), stage(hashes))[1]  # the real read, once let through
    core = engine.core
    stream_records, hit_records = [], []
    core.add(engine.make_request(OTHER, stream_records.append, max_tokens=40))
    core.step()
    hit = engine.make_request(PROMPT, hit_records.append, max_tokens=MAX)
    core.add(hit)
    events = []
    while core.has_work:
        core.step()
        events.append((hit.state, len(stream_records)))
        if len(events) == 6:
            gate.set()
    loading = [n for state, n in events if state is RequestState.LOADING]
    assert len(loading) >= 6 and loading[-1] - loading[0] >= 5  # tokens handed out while it loaded
    assert tokens_of(hit_records) == cold
    assert hit_records[-1].stats.cached_tokens["disk"] == 40


def test_eviction_writes_run_after_allocate_not_inside_it(loaded):
    inside, seen = [False], []

    class Watching(NoopKVCacheConnector):
        def evict_blocks(self, hashes, read):
            seen.append(inside[0])
            read()

    engine = Engine(loaded, CacheConfig(block_size=BLOCK, num_blocks=12, memory_tier_bytes=0,
                                        connector=Watching()))
    pool = engine.block_pool
    allocate = pool.allocate

    def watched(n):
        inside[0] = True
        try:
            return allocate(n)
        finally:
            inside[0] = False

    pool.allocate = watched
    for salt in range(3):
        engine.generate([(salt * 31 + 7 * i) % 300 + 3 for i in range(30)], max_tokens=2)
    assert pool.evictions > 0 and seen and not any(seen)


def test_restore_or_recompute_follows_the_injected_speeds(loaded, cold, tmp_path):
    first = engine_with(loaded, disk_tier=str(tmp_path))
    writer, handed = first.connector.writer, []
    submit = writer.submit

    def watched(job):
        handed.append([a.flags.owndata or a.flags.writeable for a in (job.keys, job.values)])
        return submit(job)

    writer.submit = watched
    first.generate(PROMPT, max_tokens=1)
    first.close()
    # The writer thread got read-only views of the pool read: no copy of the blocks on the step path.
    assert handed and not any(copied for job in handed for copied in job)
    bytes_per_token = first.kv_layout.bytes_per_token
    results = {}
    for name, disk_rate in (("slow", bytes_per_token * 10.0), ("fast", bytes_per_token * 1e9)):
        engine = engine_with(loaded, disk_tier=str(tmp_path))
        engine.coordinator.costs.known(prefill_tokens_per_s=1000.0, read_bytes_per_s={"disk": disk_rate})
        results[name] = engine.generate(PROMPT, max_tokens=MAX)
        engine.close()
    slow, fast = results["slow"], results["fast"]
    assert slow.tokens == fast.tokens == cold
    assert slow.stats.restore == "recompute" and slow.stats.cached_tokens["disk"] == 0
    assert slow.stats.recomputed_hit_tokens == 40 and slow.stats.computed_tokens == len(PROMPT)
    assert fast.stats.restore == "restore" and fast.stats.cached_tokens["disk"] == 40


def test_install_is_bounded_per_step(loaded, monkeypatch):
    """A load installs at most the step's byte budget, so it spreads over steps."""
    import mlxkv.engine.scheduler as scheduler_module

    tier = Gated()
    tier.gate.set()
    engine = warmed(loaded, tier)
    block_bytes = engine.kv_layout.bytes_per_token * BLOCK
    monkeypatch.setattr(scheduler_module, "INSTALL_BYTES_PER_STEP", 3 * block_bytes)
    states = []
    progress = engine.coordinator.loads.progress

    def recorded(seq, budget):
        state, used = progress(seq, budget)
        states.append((state, used))
        return state, used

    engine.coordinator.loads.progress = recorded
    engine.generate(PROMPT, max_tokens=1)
    assert all(used <= 4 * block_bytes for _, used in states)  # GatedJob gives 2 blocks a take
    assert sum(1 for s, _ in states if s is LoadState.INSTALLING) >= 2 and states[-1][0] is LoadState.DONE


def test_the_request_log_names_the_restore_choice():
    from types import SimpleNamespace

    from mlxkv.cache.tiers import no_reuse
    from mlxkv.engine.records import RequestStats
    from mlxkv.server.http_app import _reply_fields

    def line(**fields):
        stats = RequestStats(41, no_reuse(), 41, generation_tokens=3, **fields)
        return _reply_fields(SimpleNamespace(stats=stats, prompt=None))

    assert line(restore="recompute", recomputed_hit_tokens=40).endswith(" out=3 restore=recompute recomputed=40")
    assert "restore=" not in line()  # no tier hit, no field


# -- a hybrid's checkpoint ------------------------------------------------------

GATE_S = 3  # how long a gated read waits at most: a read on the engine thread stalls the test this long


class GatedStates(NoopKVCacheConnector):
    """A tier that keeps blocks and checkpoints; a checkpoint's read waits for the test's gate."""

    tier_name = "disk"

    def __init__(self):
        self.blocks, self.states, self.refs, self.gate, self.read_threads = {}, {}, [], threading.Event(), []

    def get_computed_blocks(self, hashes):
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n

    def load_blocks(self, hashes):
        return [LoadedBlock(h, self.blocks[h], "disk") for h in hashes[: self.get_computed_blocks(hashes)]]

    def cache_blocks(self, hashes, read):
        self.blocks.update(zip(hashes, read()))

    def has_checkpoint(self, key):
        return key in self.states

    def cache_checkpoint(self, checkpoint):
        self.states[checkpoint.key] = checkpoint.states
        self.refs.append(checkpoint.ref)

    def checkpoint_refs(self):
        refs, self.refs = self.refs, []
        return refs

    def _read(self, key):
        self.read_threads.append(threading.current_thread().name)
        self.gate.wait(GATE_S)
        return self.states.get(key)

    def begin_checkpoint_load(self, key):
        return CheckpointLoad(key, self.tier_name, lambda: self._read(key), lambda states: states)

    def load_checkpoint(self, key):
        job = self.begin_checkpoint_load(key)
        job.run()
        return job.take()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    spec = TinyModelSpec(family="qwen3_next", num_layers=4, seed=41)
    return load_model(str(write_tiny_model(tmp_path_factory.mktemp("hybrid"), spec)))


def hybrid_engine(loaded, connector=None) -> Engine:
    return Engine(loaded, CacheConfig(block_size=16, num_blocks=64, memory_tier_bytes=0, connector=connector,
                                      checkpoint_write_ratio=0))


@pytest.mark.slow
def test_a_hybrids_checkpoint_is_read_off_the_step_path_while_the_batch_decodes(hybrid):
    prompt, other = [(7 * i + 3) % 300 + 3 for i in range(70)], OTHER
    cold = hybrid_engine(hybrid).generate(prompt, max_tokens=MAX).tokens
    tier = GatedStates()
    hybrid_engine(hybrid, tier).generate(prompt, max_tokens=1)  # leaves blocks and a checkpoint in the tier
    assert tier.states
    engine = hybrid_engine(hybrid, tier)
    core, stream_records, hit_records = engine.core, [], []
    core.add(engine.make_request(other, stream_records.append, max_tokens=40))
    core.step()
    hit = engine.make_request(prompt, hit_records.append, max_tokens=MAX)
    core.add(hit)
    states = []
    for _ in range(6):
        core.step()  # a read on the engine thread would hold this step GATE_S and fail the next line
        states.append((hit.state, len(stream_records)))
    assert all(state is RequestState.LOADING for state, _ in states)
    assert states[-1][1] - states[0][1] >= 4  # the stream kept decoding meanwhile
    tier.gate.set()
    while core.has_work:
        core.step()
    assert tokens_of(hit_records) == cold
    assert tier.read_threads and all(name.startswith("mlxkv-tier-load") for name in tier.read_threads)
    assert hit_records[-1].stats.cached_tokens["disk"] == 64
