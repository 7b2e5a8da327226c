"""Servers for the tests: a real one on a tiny model, on a free loopback
port, and a scripted engine thread for replies a random model cannot write."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import anthropic
import openai

from faults import wait_until as wait_for  # noqa: F401  (the server tests' name for it)
from mlxkv.config import CacheConfig, EngineConfig, TierConfig
from mlxkv.engine.engine import Engine
from mlxkv.engine.limits import RequestLimits
from mlxkv.engine.records import GenerationChunk, RequestStats
from mlxkv.host.request_handle import RequestHandle
from mlxkv.models.loader import load_model
from mlxkv.server.server import Server, ServerOptions

CACHE = dict(block_size=8, num_blocks=512, memory_tier_bytes=0)




class SlowSteps:
    """A `load` for Server.load: the real engine, in chunks of `prefill_chunk`
    tokens, each step taking at least `step_s` more (sleeping, as a long
    prefill's matmuls do, without the GIL). `steps` counts the engine's steps."""

    def __init__(self, step_s: float, prefill_chunk: int = 64):
        self.step_s, self.prefill_chunk, self.steps = step_s, prefill_chunk, 0

    def __call__(self, model: str, cache: CacheConfig, report) -> Engine:
        engine = Engine(load_model(model), cache, prefill_chunk=self.prefill_chunk)
        step = engine.loop.step

        def slow_step():
            time.sleep(self.step_s)
            self.steps += 1
            return step()

        engine.loop.step = slow_step
        return engine


@contextlib.contextmanager
def running_server(model: str, options: ServerOptions | None = None, load=None, **cache):
    server = Server.load(model, CacheConfig(**{**CACHE, **cache}), options or ServerOptions(port=0),
                         **({} if load is None else {"load": load})).start()
    try:
        yield server
    finally:
        server.close()


def openai_client(server, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def anthropic_client(server, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=120)


def raw(server, method: str, path: str, body=None, headers: dict | None = None):
    """(status, parsed JSON or text, headers: case-blind) of one raw request."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method,
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            status, text, head = r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        status, text, head = e.code, e.read().decode(), e.headers
    try:
        return status, json.loads(text), head
    except json.JSONDecodeError:
        return status, text, head


class ScriptedThread:
    """Stands in for EngineThread: every request's reply is `script` (text pieces, one per token)."""

    def __init__(self, model_dir: str, script: list[str]):
        from mlx_lm.tokenizer_utils import load

        self.script = script
        tokenizer = load(Path(model_dir))
        limits = RequestLimits(tokenizer.vocab_size, 4096, 1024, 16)
        pool = SimpleNamespace(budget=1024, usage=lambda: {"in_use": 0, "num_blocks": 16, "budget_blocks": 1024})
        core = SimpleNamespace(tokenizer=tokenizer, limits=limits, block_pool=pool,
                               loaded=SimpleNamespace(max_context=4096), kv_layout=SimpleNamespace(block_size=16),
                               config=EngineConfig(tiers=TierConfig(memory_tier_bytes=0)), fingerprint=bytes(32),
                               hybrid=False)
        self.engine = SimpleNamespace(core=core, tokenizer=tokenizer, limits=limits, stats=lambda: {"scripted": True})
        self.published = {"scripted": True, "pool": pool.usage()}
        self.submitted: list[tuple[list[int], dict]] = []
        self.alive = True
        self.open_requests = 0

    def wait_ready(self, timeout=None):
        pass

    def call(self, fn) -> Future:
        future: Future = Future()
        future.set_result(fn(self.engine))
        return future

    def submit(self, tokens, **options) -> RequestHandle:
        self.submitted.append((tokens, options))
        handle = RequestHandle(len(self.submitted))
        for i, text in enumerate(self.script):
            last = i == len(self.script) - 1
            stats = RequestStats(len(tokens), {"pool": 0, "memory": 0, "disk": 0}, len(tokens), len(self.script))
            handle._put(GenerationChunk(text, 7, "stop" if last else None, stats if last else None))
        return handle

    def close(self):
        self.alive = False
