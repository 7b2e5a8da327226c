"""Operating the server: keys, load, health, metrics, dropped clients, restarts."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import warnings

import openai
import pytest

from mlxkv.errors import MlxkvError, MlxkvWarning
from mlxkv.server.server import ServerOptions, bind, warn_if_exposed
from server_support import SlowSteps, anthropic_client, raw, openai_client, running_server, wait_for

USER = [{"role": "user", "content": "Describe a long walk along the coast in the rain."}]


def open_stream(server, max_tokens: int) -> http.client.HTTPConnection:
    """A streamed chat request, left open after its first chunk arrived."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = json.dumps({"messages": USER, "max_tokens": max_tokens, "stream": True})
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    conn.response = response
    return conn


def metric(server, name: str) -> float:
    _, text, _ = raw(server, "GET", "/metrics")
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_health_stats_and_metrics(server):
    status, body, _ = raw(server, "GET", "/health")
    assert status == 200 and body == {"status": "ok", "model": server.backend.info.name}
    openai_client(server).chat.completions.create(model="x", messages=USER, max_tokens=4)
    openai_client(server).chat.completions.create(model="x", messages=USER, max_tokens=4)
    status, stats, _ = raw(server, "GET", "/v1/cache/stats")
    assert status == 200 and stats["block_size"] == 8 and stats["pool"]["budget_blocks"] == 512
    assert "connector" in stats
    status, text, head = raw(server, "GET", "/metrics")
    assert status == 200 and head["content-type"].startswith("text/plain")
    lines = text.splitlines()
    assert 'mlxkv_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert metric(server, 'mlxkv_cached_tokens_total{tier="pool"}') > 0
    assert any(line.startswith('mlxkv_time_to_first_token_seconds_bucket{le="+Inf"}') for line in lines)
    assert metric(server, "mlxkv_time_to_first_token_seconds_count") >= 2
    assert any(line.startswith('mlxkv_pool_blocks{state="in_use"}') for line in lines)
    for line in lines:  # every sample line is "name{labels} number"
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_api_key_required_when_set(llama_dir):
    with running_server(llama_dir, ServerOptions(port=0, api_key="sesame")) as server:
        with pytest.raises(openai.AuthenticationError):
            openai_client(server, "wrong").models.list()
        status, error, _ = raw(server, "GET", "/health")
        assert status == 401 and "API key" in error["error"]["message"]
        status, error, _ = raw(server, "POST", "/v1/messages", {})
        assert status == 401 and error["error"]["type"] == "authentication_error"
        assert [m.id for m in openai_client(server, "sesame").models.list()]
        assert anthropic_client(server, "sesame").messages.count_tokens(model="x", messages=USER).input_tokens > 0


def test_full_queue_gets_429_with_retry_after_and_a_dropped_stream_frees_its_blocks(llama_dir):
    with running_server(llama_dir, ServerOptions(port=0, max_open=1), load=SlowSteps(0.05)) as server:
        stream = open_stream(server, max_tokens=3000)
        status, error, head = raw(server, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2})
        assert status == 429 and head["Retry-After"] == "1" and error["error"]["type"] == "rate_limit_error"
        status, error, head = raw(server, "POST", "/v1/messages", {"messages": USER, "max_tokens": 2})
        assert status == 429 and error["error"]["type"] == "rate_limit_error" and "Retry-After" in head
        # Stats are published by the engine thread after its steps (a quarter second apart at most).
        assert wait_for(lambda: raw(server, "GET", "/v1/cache/stats")[1]["pool"]["in_use"] > 0, timeout=5)
        stream.sock.shutdown(socket.SHUT_RDWR)
        stream.close()
        # The request ends at its next step, long before its 3000 tokens, and its blocks go back.
        assert wait_for(lambda: server.engine.open_requests == 0, timeout=5)
        assert wait_for(lambda: raw(server, "GET", "/v1/cache/stats")[1]["pool"]["in_use"] == 0, timeout=5)
        assert metric(server, "mlxkv_requests_cancelled_total") == 1
        reply = openai_client(server).chat.completions.create(model="x", messages=USER, max_tokens=2)
        assert reply.usage.completion_tokens == 2


def test_body_over_the_limit_is_413(llama_dir):
    with running_server(llama_dir, ServerOptions(port=0, max_body_bytes=2048)) as server:
        big = {"messages": [{"role": "user", "content": "x" * 4096}], "max_tokens": 2}
        status, error, _ = raw(server, "POST", "/v1/chat/completions", big)
        assert status == 413 and "limit of 2048" in error["error"]["message"]
        status, error, _ = raw(server, "POST", "/v1/messages", big)
        assert status == 413 and error["error"]["type"] == "request_too_large"


def test_exposed_without_a_key_warns_and_a_taken_port_is_one_line():
    with pytest.warns(MlxkvWarning, match="without an API key"):
        warn_if_exposed("0.0.0.0", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for quiet in [("127.0.0.1", None), ("::1", None), ("localhost", None), ("0.0.0.0", "key")]:
            warn_if_exposed(*quiet)
    taken = bind("127.0.0.1", 0)
    try:
        with pytest.raises(MlxkvError, match="cannot listen on 127.0.0.1"):
            bind("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(llama_dir, disk_tier, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mlxkv.cli", "serve", "--model", llama_dir, "--port", str(port),
                             "--block-size", "8", "--num-blocks", "512", "--disk-tier", str(disk_tier)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())


@pytest.mark.slow
def test_restart_on_the_same_ssd_tier_reports_cached_tokens_on_the_first_request(llama_dir, tmp_path):
    messages = [{"role": "system", "content": "A long shared system prompt, " * 12},
                {"role": "user", "content": "What changed after the restart?"}]
    answers = []
    for run in range(2):
        port = free_port()
        process = serve_process(llama_dir, tmp_path / "ssd", port)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)

            def up():
                try:
                    return client.models.list() is not None
                except openai.APIConnectionError:
                    return process.poll() is None and False

            assert wait_for(up, timeout=120), process.stderr.read() if process.poll() is not None else "no answer"
            answers.append(client.chat.completions.create(model="x", messages=messages, max_tokens=8))
        finally:
            # Ctrl-C, then a service manager's SIGTERM: both stop it cleanly, SSD writes finished.
            process.send_signal([signal.SIGINT, signal.SIGTERM][run])
            out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        assert "Traceback" not in err, err
    first, after = answers
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert after.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens // 8 * 8
    assert after.choices[0].message.content == first.choices[0].message.content


def test_reply_ids_outlive_a_restart_beside_the_ssd_tier(llama_dir, tmp_path):
    """After a restart the replies sent back as text still carry their generated
    ids, so the SSD tier's blocks of the whole last turn are hit."""
    messages = [{"role": "user", "content": "Name three rivers and one fact about each."}]
    with running_server(llama_dir, disk_tier=str(tmp_path)) as server:
        first = openai_client(server).chat.completions.create(model="x", messages=messages, max_tokens=20)
    text = first.choices[0].message.content
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks."}]
    with running_server(llama_dir, disk_tier=str(tmp_path)) as server:
        assert server.backend.reply_ids.lookup(text) is not None
        assert (server.backend.info.reply_log.stat().st_mode & 0o777) == 0o600
        second = openai_client(server).chat.completions.create(model="x", messages=messages, max_tokens=2)
    whole_turn = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == whole_turn // 8 * 8


@pytest.mark.slow
@pytest.mark.parametrize("quiet", [False, True])
def test_serve_prints_its_real_url_logs_each_request_and_stops_streams_cleanly(llama_dir, quiet):
    """--port 0: the start-up line names the port picked. SIGTERM with a
    stream open: the stream ends with a final event, the log has one line
    for it and no traceback, the command exits 0."""
    process = subprocess.Popen([sys.executable, "-m", "mlxkv.cli", "serve", "--model", llama_dir, "--port", "0",
                                "--no-disk-tier", *(["--quiet"] if quiet else [])],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("mlxkv serve: http://127.0.0.1:") and "model llama" in line and "context 4096" in line
        port = int(line.split("http://127.0.0.1:")[1].split(" ")[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/messages", json.dumps({"messages": USER, "max_tokens": 4000, "stream": True}),
                     {"content-type": "application/json"})
        response = conn.getresponse()
        assert response.readline().startswith(b"event: message_start")
        process.send_signal(signal.SIGTERM)
        rest = response.read().decode()
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert "Traceback" not in err and "Exception in ASGI" not in err, err
    # It ended either way: by its own end, or cut at the grace period's end with Anthropic's final event.
    assert "event: message_stop" in rest or rest.rstrip().splitlines()[-2:][0] == "event: error"
    assert ("POST /v1/messages 200" in err) != quiet
