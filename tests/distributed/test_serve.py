"""`mlxkv serve --distributed tensor` on two ranks started with MLX_HOSTFILE and MLX_RANK: rank 0
answers the OpenAI, Anthropic and Responses APIs as one process does and shows every rank's
numbers; SIGTERM to rank 0 stops both; a second pair of the same shape starts with the prefix, its
rank 0 from the first pair's SSD tier and its rank 1, on an empty SSD tier, from the shared Redis
tier; killing its rank 1 mid-stream ends the open stream with an error event and both processes
soon after.

Two launched pairs serve the whole module, one after the other (each start costs seconds)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest
from real_parts import require

from mlxkv.config import CacheConfig
from mlxkv.connectors.remote.local_server import LocalRedisServer, server_binary
from mlxkv.distributed.loopback import free_ports, loopback_hostfile
from mlxkv.server.server import Server, ServerOptions

pytestmark = pytest.mark.slow
MLXKV = str(Path(sys.executable).parent / "mlxkv")
CACHE = dict(block_size=8, num_blocks=512, memory_tier_bytes=0)
MESSAGES = [{"role": "user", "content": "Name three colours of the sea at dawn."}]
START_S = 90


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class RankPair:
    """Two `mlxkv serve --distributed` processes; a hang dumps their stacks (SIGABRT) when stopped."""

    def __init__(self, model: str, tmp_path: Path, disks: list[Path], redis: str):
        hostfile = loopback_hostfile(tmp_path / "hosts.json", 2)
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        command = [MLXKV, "serve", "--model", model, "--distributed", "tensor", "--distributed-backend", "ring",
                   "--distributed-check", "--port", str(self.port), "--block-size", "8", "--num-blocks", "512",
                   "--memory-tier-mb", "0", "--remote-tier", redis, "--log-level", "warning"]
        self.procs = [subprocess.Popen(command + ["--disk-tier", str(disks[rank])], env=dict(os.environ, MLX_HOSTFILE=str(hostfile), MLX_RANK=str(rank),
                                                         PYTHONFAULTHANDLER="1"),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                      for rank in range(2)]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while not _healthy(self.url):
            assert all(p.poll() is None for p in self.procs), self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.2)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    def output(self) -> str:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGABRT)
        return "\n".join(f"[rank {rank}]\n{p.communicate()[1][-3000:]}" for rank, p in enumerate(self.procs))


@pytest.fixture(scope="module")
def disks(tmp_path_factory):
    """Rank 0's SSD tier (both pairs'), the first pair's rank 1's, the second pair's rank 1's."""
    return [tmp_path_factory.mktemp(f"serve-disk{i}") for i in range(3)]


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    require("redis-server", server_binary())
    server = LocalRedisServer(tmp_path_factory.mktemp("serve-redis")).start()
    yield server.url
    server.stop()


def _served(ranks: RankPair):
    """A fixture's body: the pair once it answers, stopped after the module."""
    try:
        ranks.wait_ready()
        yield ranks
    finally:
        ranks.stop()


@pytest.fixture(scope="module")
def pair(model_dirs, tmp_path_factory, disks, redis):
    yield from _served(RankPair(model_dirs["llama"], tmp_path_factory.mktemp("serve-ranks"), disks[:2], redis))


@pytest.fixture(scope="module")
def next_pair(pair, model_dirs, tmp_path_factory, disks, redis):
    """A second set, once the first has stopped: rank 0 on the first set's SSD tier, rank 1 on
    an empty one, both on the first set's Redis."""
    assert all(p.poll() is not None for p in pair.procs), "the first pair still runs"
    yield from _served(RankPair(model_dirs["llama"], tmp_path_factory.mktemp("serve-ranks-again"),
                                [disks[0], disks[2]], redis))


@pytest.fixture(scope="module")
def one_process(model_dirs):
    server = Server.load(model_dirs["llama"], CacheConfig(**CACHE), ServerOptions(port=0)).start()
    yield server
    server.close()


def _answers(url: str) -> list:
    """Each API asked twice (the second a prefix hit): (text, cached prompt tokens) per call."""
    chat = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
    got = []
    for _ in range(2):
        r = chat.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=0)
        got.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens))
        m = claude.messages.create(model="m", messages=MESSAGES + [{"role": "assistant", "content": "Blue"}],
                                   max_tokens=8)
        got.append((m.content[0].text if m.content else "", m.usage.cache_read_input_tokens))
        s = chat.responses.create(model="m", input="Say hello to the sea.", max_output_tokens=8, store=False,
                                  temperature=0)
        got.append((s.output_text, s.usage.input_tokens_details.cached_tokens))
    return got


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _reported(url: str, ready) -> dict:
    """Rank 0's `distributed` stats once both ranks' reports are `ready(reports)` (they ride on a
    plan four times a second while the set steps, and at each idle tick)."""
    deadline = time.monotonic() + 10
    while len((ranks := json.loads(_get(url + "/v1/cache/stats"))["distributed"])["per_rank"]) < 2 \
            or not ready(ranks["per_rank"]):
        assert time.monotonic() < deadline, ranks
        time.sleep(0.2)
    return ranks


def test_rank_zero_answers_every_api_as_one_process_does_and_shows_every_rank(pair, one_process):
    got, oracle = _answers(pair.url), _answers(one_process.url)
    assert got == oracle
    assert all(cached > 0 for _, cached in got[3:])  # the second round hit the first's prefix
    ranks = _reported(pair.url, lambda reports: all(r["tiers"]["disk"]["stores"] > 0 for r in reports))
    assert (ranks["rank"], ranks["ranks"], ranks["shard"], ranks["lost"]) == (0, 2, "tp2r0", None)
    assert ranks["plan_exchanges"] >= ranks["steps"] > 0
    assert 0 <= ranks["plan_wait_s"] <= ranks["plan_s"]
    per_rank = ranks["per_rank"]
    assert [r["rank"] for r in per_rank] == [0, 1]
    assert per_rank[0]["pool"] == per_rank[1]["pool"]  # the same tables on both, each over its own shard
    assert all(r["steps"] > 0 and r["step_s"] > 0 for r in per_rank)
    metrics = _get(pair.url + "/metrics")
    assert "mlxkv_distributed_ranks 2" in metrics and "mlxkv_distributed_lost 0" in metrics
    assert re.search(r'^mlxkv_rank_steps_total\{rank="1"\} [1-9]', metrics, re.M)
    assert 'mlxkv_rank_tier_bytes{rank="1",tier="disk"}' in metrics
    assert 'mlxkv_rank_plan_wait_seconds_total{rank="0"}' in metrics


def test_sigterm_to_rank_zero_stops_both_ranks_cleanly(pair):
    pair.procs[0].send_signal(signal.SIGTERM)
    for rank, p in enumerate(pair.procs):
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {rank} still runs 30 s after SIGTERM to rank 0:\n{pair.output()}")
    assert [p.returncode for p in pair.procs] == [0, 0], pair.output()


def test_a_second_set_has_the_prefix_from_the_ssd_tier_and_from_redis(next_pair, one_process):
    def ask(url: str) -> tuple:
        chat = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = chat.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=0)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

    # The one process has served this prompt before: every full block of it cached.
    assert ask(next_pair.url) == ask(one_process.url)
    # Rank 0 read its shard back from the SSD tier the SIGTERM left; rank 1, whose SSD tier is
    # new, read its own from what the first set's rank 1 wrote to Redis.
    reports = _reported(next_pair.url, lambda reports: reports[1]["tiers"]["remote"]["hydrations"] > 0)["per_rank"]
    assert reports[0]["tiers"]["disk"]["hydrations"] > 0 and reports[1]["tiers"]["disk"]["hydrations"] == 0


def _drained(stream, timeout: float) -> str:
    """How `stream` ended within `timeout` seconds: its error, "ended", or "hung"."""
    outcome = ["hung"]

    def drain():
        try:
            for _ in stream:
                pass
            outcome[0] = "ended"
        except openai.APIError as e:
            outcome[0] = str(e)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    reader.join(timeout)
    return outcome[0]


def test_killing_rank_one_mid_stream_ends_the_stream_with_an_error_and_both_processes(next_pair):
    pair = next_pair
    chat = openai.OpenAI(base_url=pair.url + "/v1", api_key="none", max_retries=0, timeout=60)
    stream = chat.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3000, temperature=0,
                                          stream=True)  # greedy on this model: no end token for thousands
    next(iter(stream))
    pair.procs[1].kill()
    killed = time.monotonic()
    assert "peer was lost" in _drained(stream, 30)
    try:
        pair.procs[0].wait(60 - (time.monotonic() - killed))
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank 0 still runs 60 s after rank 1 died:\n{pair.output()}")
    assert pair.procs[0].returncode not in (0, None)
    assert "the distributed set stopped" in pair.procs[0].communicate()[1]
