"""Rank 0's side of the lockstep core in one process, its channel echoing: what the plan carries."""

import pytest

from mlxkv.config import CacheConfig, engine_config
from mlxkv.distributed.cluster import Cluster
from mlxkv.distributed.lockstep import LockstepCore
from mlxkv.distributed.sharding import ShardSpec
from mlxkv.distributed.step_plan import StepPlan
from mlxkv.engine.core import build_core
from mlxkv.engine.engine import Engine
from mlxkv.engine.records import RequestFailed
from mlxkv.errors import MlxkvError
from mlxkv.models.loader import load_model
from mlxkv.structured.grammar import Grammar


class EchoChannel:
    """A set of one: every plan comes back as sent, and is kept for the test to read."""

    def __init__(self):
        self.cluster = Cluster(rank=0, size=2)
        self.plans: list[StepPlan] = []
        self.collectives = self.bytes_moved = self.exchanges = 0
        self.seconds = self.wait_seconds = 0.0
        self.reports: list[bytes] = []
        self._report: bytes | None = None

    def attach(self, report: bytes) -> None:
        self._report = report

    def exchange(self, plan: bytes) -> bytes:
        self.plans.append(StepPlan.decode(plan))
        if self._report is not None:
            self.reports, self._report = [self._report], None
        return plan

    def agree(self, what: str, data: bytes) -> None:
        pass


class OneRank:
    def identity(self, fingerprint: bytes) -> tuple[bytes, bytes]:
        return fingerprint, fingerprint

    def agree(self, n: int) -> list[int]:
        return [n]


@pytest.fixture(scope="module")
def leader(model_dirs):
    loaded = load_model(model_dirs["llama"])
    config = CacheConfig(block_size=16, memory_tier_bytes=0)
    channel = EchoChannel()
    core = LockstepCore(build_core(loaded, engine_config(config), lockstep=OneRank()), channel,
                        ShardSpec("tensor", 2, 0), check=True)
    return Engine(loaded, config, core=core), channel


def test_the_plan_carries_a_seed_for_a_sampled_request_and_its_clients_stop(leader):
    engine, channel = leader
    stop = [False]
    records = []
    engine.core.add(engine.make_request(list(range(1, 30)), records.append, lambda: stop[0], max_tokens=50,
                                        temperature=0.8))
    engine.core.step()
    (new,) = channel.plans[-1].new
    assert new.sampling[:1] == (0.8,) and new.sampling[4] is not None  # every rank draws from one key
    stop[0] = True
    while engine.core.has_work:
        engine.core.step()
    assert any(plan.cancel == [new.request_id] for plan in channel.plans)
    assert records[-1].finish_reason == "cancelled" and len(records) < 50


def test_a_closed_stream_reaches_every_rank_as_an_abort(leader):
    engine, channel = leader
    stream = engine.stream(list(range(1, 30)), max_tokens=50)
    next(stream)
    stream.close()
    engine.core.step()
    assert channel.plans[-1].abort and not engine.core.has_work


def test_a_grammar_is_refused_on_a_set_as_its_request_failing(leader):
    engine, _ = leader
    records = []
    engine.core.add(engine.make_request([1, 2, 3], records.append, grammar=Grammar.regex("[ab]+")))
    assert [type(r) for r in records] == [RequestFailed] and "not served by a distributed set" in records[0].message
    with pytest.raises(MlxkvError, match="not served by a distributed set"):
        list(engine.stream([1, 2, 3], grammar=Grammar.regex("[ab]+")))
