"""Rank 0's side of the lockstep core in one process, its channel echoing: what the plan carries,
and what rank 0's server says once the channel loses a rank."""

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from mlxkv.config import CacheConfig, engine_config
from mlxkv.distributed.channel import RankLost
from mlxkv.distributed.cluster import Cluster
from mlxkv.distributed.lockstep import LockstepCore
from mlxkv.distributed.sharding import ShardSpec
from mlxkv.distributed.step_plan import StepPlan
from mlxkv.engine.core import build_core
from mlxkv.engine.engine import Engine
from mlxkv.engine.records import RequestFailed
from mlxkv.errors import MlxkvError
from mlxkv.models.loader import load_model
from mlxkv.server.metrics import distributed_lines
from mlxkv.server.server import Server, ServerOptions
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


class LosingChannel(EchoChannel):
    """An echo until `lose` is set; then every exchange finds the peer gone, as the ring says it."""

    def __init__(self):
        super().__init__()
        self.lose = False

    def exchange(self, plan: bytes) -> bytes:
        if self.lose:
            raise RankLost("rank 0 of 2: a peer was lost ([ring] connection to a peer was lost)")
        return super().exchange(plan)


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


def test_every_rank_report_rides_on_a_plan_and_reaches_the_metrics(leader):
    engine, channel = leader
    engine.generate(list(range(1, 20)), max_tokens=2)
    assert any(plan.report for plan in channel.plans)
    dist = engine.stats()["distributed"]
    (mine,) = dist["per_rank"]  # a set of one here: tests/distributed/test_serve.py has two
    assert mine["rank"] == 0 and mine["steps"] > 0 and mine["pool"]["size_blocks"] > 0
    assert 'mlxkv_rank_pool_blocks{rank="0",state="size_blocks"}' in "\n".join(distributed_lines(dist))


def _health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.mark.slow
def test_health_says_why_once_a_rank_is_lost(model_dirs):
    channel = LosingChannel()

    def load(model, config, report):
        loaded, config = load_model(model), engine_config(config)
        return Engine(loaded, config, core=LockstepCore(build_core(loaded, config, lockstep=OneRank()), channel,
                                                        ShardSpec("tensor", 2, 0)))

    server = Server.load(model_dirs["llama"], CacheConfig(block_size=16, memory_tier_bytes=0), ServerOptions(port=0),
                         load=load).start()
    try:
        chat = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert _health(server.url)[0] == 200
        channel.lose = True
        with pytest.raises(openai.APIError, match="peer was lost"):
            chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        deadline = time.monotonic() + 10  # the engine thread publishes its stats at its next idle tick
        while (health := _health(server.url))[0] == 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert health[0] == 503 and "a peer was lost" in health[1]["reason"]
    finally:
        server.close()
