"""Long prefills never stall the HTTP side: streams open at once and keep
alive, a client that hangs up mid-prefill frees the engine within a chunk,
and the server's own endpoints answer without waiting for a step.

The engine here computes prompts in chunks of 64 tokens, each step made to
take at least STEP_S more (tests/server/server_support.py), so a 3,000-token
prompt is a prefill of about 47 steps that the tests can watch.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from mlxkv.server.server import ServerOptions
from server_support import SlowSteps, anthropic_client, openai_client, raw, running_server, wait_for

STEP_S = 0.05
CHUNK = 64


def long_text(seed: int, words: int = 750) -> str:
    return " ".join(f"w{(seed * 7919 + i * 31) % 997}" for i in range(words))


@pytest.fixture(scope="module")
def slow(llama_dir):
    load = SlowSteps(STEP_S, CHUNK)
    with running_server(llama_dir, ServerOptions(port=0, keepalive_s=0.2), load=load) as server:
        server.load = load
        yield server


def cancelled(server) -> float:
    _, text, _ = raw(server, "GET", "/metrics")
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("mlxkv_requests_cancelled_total ")))


def send(server, path: str, body: dict) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    return conn


def stream_lines(server, path: str, body: dict):
    """The non-empty lines of a streamed response, as they arrive."""
    conn = send(server, path, {**body, "stream": True})
    response = conn.getresponse()
    assert response.status == 200
    try:
        while line := response.readline():
            if line.strip():
                yield line.decode().rstrip("\n")
    finally:
        conn.close()


def hang_up(conn: http.client.HTTPConnection) -> None:
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False])
def test_a_hang_up_mid_prefill_frees_the_engine_within_a_chunk_and_the_retry_resumes(slow, stream):
    messages = [{"role": "user", "content": long_text(1 + stream)}]
    before = cancelled(slow)
    conn = send(slow, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "stream": stream})
    start = slow.load.steps
    assert wait_for(lambda: slow.load.steps >= start + 12)  # a dozen chunks computed
    at_hang_up = slow.load.steps
    hang_up(conn)
    assert wait_for(lambda: slow.engine.open_requests == 0, timeout=10)
    # Noticed at once: the step under way, then the next one drops it.
    assert slow.load.steps - at_hang_up <= 2
    assert wait_for(lambda: cancelled(slow) == before + 1, timeout=5)
    retry = openai_client(slow).chat.completions.create(model="x", messages=messages, max_tokens=2)
    # The chunks it computed stayed cached: the retry starts from them.
    assert retry.usage.prompt_tokens_details.cached_tokens >= (at_hang_up - start - 1) * CHUNK


@pytest.mark.slow
def test_sixteen_clients_hanging_up_together_free_it_and_a_new_request_is_served_at_once(slow):
    before = cancelled(slow)
    conns = [send(slow, ["/v1/chat/completions", "/v1/messages"][i % 2],
                  {"messages": [{"role": "user", "content": long_text(100 + i, 250)}], "max_tokens": 4,
                   "stream": i % 4 < 2}) for i in range(16)]
    assert wait_for(lambda: slow.engine.open_requests == 16)
    for conn in conns:
        hang_up(conn)
    at_hang_up = slow.load.steps
    reply = openai_client(slow).chat.completions.create(
        model="x", messages=[{"role": "user", "content": "A short question."}], max_tokens=2)
    assert reply.usage.completion_tokens == 2
    # Served in a few steps, not behind sixteen prefills of some 13 chunks each.
    assert slow.load.steps - at_hang_up <= 8
    assert wait_for(lambda: slow.engine.open_requests == 0, timeout=10)
    assert wait_for(lambda: cancelled(slow) == before + 16, timeout=5)  # streamed or not


@pytest.mark.slow
def test_anthropic_message_start_comes_before_the_prefill_ends_and_pings_while_it_runs(slow):
    messages = [{"role": "user", "content": long_text(40)}]
    start = slow.load.steps
    with anthropic_client(slow).messages.stream(model="x", max_tokens=3, messages=messages) as stream:
        first = next(iter(stream))
        assert first.type == "message_start"
        assert slow.load.steps - start < 20  # of some 47 prefill chunks
        text = "".join(stream.text_stream)
    assert stream.get_final_message().usage.output_tokens == 3 and isinstance(text, str)
    lines = list(stream_lines(slow, "/v1/messages", {"model": "x", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": long_text(41)}]}))
    events = [line.split(": ", 1)[1] for line in lines if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    first_block = events.index("content_block_start")
    assert events[1:first_block].count("ping") >= 3  # every 0.2 s of a prefill of some 2.4 s


@pytest.mark.slow
@pytest.mark.parametrize("path, body, opening", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text(50)}]}, '"role": "assistant"'),
    ("/v1/responses", {"input": long_text(51)}, "event: response.created")])
def test_openai_streams_open_before_the_prefill_and_keep_alive(slow, path, body, opening):
    start = slow.load.steps
    lines = stream_lines(slow, path, {**body, "max_tokens": 2, "max_output_tokens": 2})
    first = next(lines)
    assert opening in first and slow.load.steps - start < 20
    rest = list(lines)
    assert rest.count(": keep-alive") >= 3


def answer_time(server, path: str) -> float:
    began = time.perf_counter()
    status, _, _ = raw(server, "GET", path)
    assert status == 200, path
    return time.perf_counter() - began


@pytest.mark.slow
def test_health_metrics_models_and_stats_answer_at_once_during_a_long_prefill(llama_dir):
    load = SlowSteps(1.0, CHUNK)  # a step as long as a 2k-token chunk of a real model on a Mac
    with running_server(llama_dir, load=load) as server:
        conn = send(server, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": long_text(60, 200)}], "max_tokens": 2})
        assert wait_for(lambda: server.engine.open_requests == 1 and load.steps >= 1)
        for path in ["/health", "/metrics", "/v1/models", "/v1/cache/stats", "/"]:
            # Within a tenth of a step, where waiting for the engine would take up to a whole one.
            # The best of three: a loaded machine may delay one answer, an engine wait delays all
            # three (each one after the first arrives at the start of a step).
            assert min(answer_time(server, path) for _ in range(3)) < 0.1 * load.step_s + 0.05, path
        hang_up(conn)


@pytest.mark.slow
def test_a_stop_ends_every_open_stream_with_its_api_s_final_event(llama_dir, caplog):
    load = SlowSteps(0.1, CHUNK)
    options = ServerOptions(port=0, shutdown_grace_s=0.5)
    bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 3000},
              "/v1/messages": {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 3000},
              "/v1/responses": {"input": "Go on.", "max_output_tokens": 3000}}
    lines: dict[str, list[str]] = {}

    def read(server, path):
        lines[path] = list(stream_lines(server, path, bodies[path]))

    with running_server(llama_dir, options, load=load) as server:
        readers = [threading.Thread(target=read, args=(server, p)) for p in bodies]
        for t in readers:
            t.start()
        assert wait_for(lambda: server.engine.open_requests == 3)
    for t in readers:
        t.join(30)
    chat, messages, responses = (lines[p] for p in bodies)
    assert '"error"' in chat[-2] and '"finish_reason": "length"' in chat[-2] and chat[-1] == "data: [DONE]"
    assert messages[-2:] == ["event: error", messages[-1]] and "overloaded_error" in messages[-1]
    assert responses[-2] == "event: response.failed" and "shutting down" in responses[-1]
    cuts = [r for r in caplog.records if "cut a reply" in r.getMessage()]
    assert len(cuts) == 3
    assert not [r for r in caplog.records if r.exc_info or r.levelname == "ERROR"]
