"""Random programs of arrivals, cancellations and steps over small pools.

Invariants after every step: the pool's reference counts are exactly the
running sequences' block tables (no leak, no double count), the free queue
holds exactly the unreferenced blocks, and every token streamed so far is a
prefix of the request's solo run. At teardown every request has finished
or was cancelled, every count is back to zero, and each uncancelled output
equals its solo run token for token.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.loader import load_model
from mlxkv.engine.records import RequestFailed, is_last
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model

BLOCK = 4
_MODEL: dict = {}

STEMS = [tuple((s * 37 + 11 * i) % 300 + 3 for i in range(n)) for s, n in ((1, 13), (2, 8), (3, 21))]
TAILS = [(), (5, 6, 7), (9,) * 6, tuple(range(40, 51))]


@pytest.fixture(scope="module", autouse=True)
def _model(tmp_path_factory):
    """The machine's model, under pytest's temp dir (one of its own in /tmp was left behind by every run)."""
    path = write_tiny_model(tmp_path_factory.mktemp("sched") / "m", TinyModelSpec(seed=23))
    _MODEL.update(loaded=load_model(str(path)), answers={})
    yield
    _MODEL.clear()


def loaded():
    return _MODEL["loaded"]


def solo_tokens(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    answers = _MODEL["answers"]
    if (prompt, max_tokens) not in answers:
        engine = Engine(loaded(), CacheConfig(block_size=BLOCK, num_blocks=64, memory_tier_bytes=0))
        answers[prompt, max_tokens] = engine.generate(list(prompt), max_tokens=max_tokens).tokens
    return answers[prompt, max_tokens]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 24), chunk=st.sampled_from([4, 8, 2048]), tier=st.booleans())
    def start(self, num_blocks, chunk, tier):
        self.engine = Engine(loaded(), CacheConfig(
            block_size=BLOCK, num_blocks=num_blocks, memory_tier_bytes=(64 << 10) if tier else 0),
            prefill_chunk=chunk)
        self.loop = self.engine.loop
        self.requests: list[dict] = []

    @rule(stem=st.integers(0, len(STEMS) - 1), tail=st.integers(0, len(TAILS) - 1),
          cut=st.integers(1, 21), max_tokens=st.integers(1, 12))
    def arrive(self, stem, tail, cut, max_tokens):
        prompt = (STEMS[stem] + TAILS[tail])[:cut] or STEMS[stem][:1]
        records, flag = [], []
        entry = dict(prompt=prompt, max_tokens=max_tokens, records=records, cancel=flag, error=None)
        try:
            self.loop.add(self.engine.make_request(list(prompt), records.append, max_tokens=max_tokens,
                                                   should_stop=lambda: bool(flag)))
        except Exception as e:  # too long for this pool: refused alone, with a message
            assert "blocks" in str(e)
            entry["error"] = str(e)
        self.requests.append(entry)

    @precondition(lambda self: any(not r["cancel"] for r in self.requests))
    @rule(pick=st.integers(0, 1000))
    def cancel(self, pick):
        open_ = [r for r in self.requests if not r["cancel"]]
        open_[pick % len(open_)]["cancel"].append(True)

    @rule(n=st.integers(1, 6))
    def step(self, n):
        for _ in range(n):
            if self.loop.has_work:
                self.loop.step()

    @invariant()
    def references_are_the_running_block_tables(self):
        if not hasattr(self, "engine"):
            return
        cache = self.engine.coordinator
        held = Counter(b.block_id for seq in self.engine.loop.running.values() for b in cache.held(seq))
        pool = self.engine.block_pool
        assert {b.block_id: b.ref_count for b in pool.blocks if b.ref_count} == dict(held)
        assert sorted(b.block_id for b in pool.free_blocks()) == [b.block_id for b in pool.blocks if b.ref_count == 0]

    @invariant()
    def streamed_tokens_are_a_prefix_of_the_solo_run(self):
        for r in getattr(self, "requests", []):
            tokens = [c.token for c in r["records"] if not isinstance(c, RequestFailed)]
            assert tokens == solo_tokens(r["prompt"], r["max_tokens"])[: len(tokens)]

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        for _ in range(10_000):
            if not self.loop.has_work:
                break
            self.loop.step()
        assert not self.loop.has_work
        assert all(b.ref_count == 0 for b in self.engine.block_pool.blocks)
        assert self.engine.block_pool.num_free == self.engine.block_pool.budget
        assert self.engine.loop.running == {}
        for r in self.requests:
            if r["error"] is not None:
                assert r["records"] == []
                continue
            records = r["records"]
            assert records and is_last(records[-1]) and sum(map(is_last, records)) == 1
            last = records[-1]
            if last.finish_reason == "cancelled":
                assert r["cancel"]
                continue
            assert not isinstance(last, RequestFailed)
            assert [c.token for c in records] == solo_tokens(r["prompt"], r["max_tokens"])


TestScheduler = pytest.mark.slow(SchedulerMachine.TestCase)
TestScheduler.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
