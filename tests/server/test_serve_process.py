"""A real `mlxkv serve` process, through the official openai client: a tiny BERT
(mlx-embeddings) beside two chat models, on an SSD tier.

The encoder's vectors are the package's own, batched or not, in float or base64, cut to
`dimensions`; each kind of model refuses the other's endpoint with a 400 naming its kind.
Last (the file's tests run in order, and a process start costs seconds), SIGTERM while a
model loads: the process exits cleanly with nothing half-written (no SSD tier file in
flight, the reply-ids log whole), and the next start on the same tier serves the chat's
prefix from SSD.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from types import SimpleNamespace

import jsonschema
import mlx.core as mx
import numpy as np
import openai
import pytest

from server_support import openai_client, running_server, wait_for
from tiny_encoder import write_tiny_bert

pytestmark = pytest.mark.slow
TEXTS = ["a short one", "a somewhat longer text about harbours and boats at dawn", "x"]
CHAT = [{"role": "system", "content": "A long shared system prompt, " * 12},
        {"role": "user", "content": "What changed after the restart?"}]
LOAD_S = 2.5  # the second model's load is slowed this much: the SIGTERM comes in the middle of it
# `mlxkv serve` with the load of the model whose source is $SLOW_SOURCE slowed (Engine.load, as load_engine
# calls it), and uvicorn's grace for open requests at a stop cut to 0.5 s (5 s + the margin), shorter than
# the load: the stop cuts the load's request for certain, not after it was answered.
SLOWED_SERVE = f"""
import os, sys, time
import mlxkv.server.server as server
server.STOP_MARGIN_S = 0.5 - server.GRACEFUL_SHUTDOWN_S
from mlxkv.engine.engine import Engine
load = Engine.load.__func__
def slowed(cls, model, *args, **kwargs):
    if model == os.environ["SLOW_SOURCE"]:
        time.sleep({LOAD_S})
    return load(cls, model, *args, **kwargs)
Engine.load = classmethod(slowed)
from mlxkv.cli import run
sys.exit(run())
"""
FLAGS = ["--port", "0", "--block-size", "8", "--num-blocks", "256"]


def start(command: list[str], env: dict | None = None) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = process.stdout.readline()
    if not line.startswith("mlxkv serve: http://127.0.0.1:"):
        process.kill()
        pytest.fail(f"mlxkv serve did not start: {line}{process.communicate()[1]}")
    return process, int(line.split("http://127.0.0.1:")[1].split(" ")[0])


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)


def states(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return {m["id"]: m["state"] for m in json.loads(r.read())["data"]}


@pytest.fixture(scope="module")
def ssd(tmp_path_factory):
    return tmp_path_factory.mktemp("ssd")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return str(write_tiny_bert(tmp_path_factory.mktemp("encoder") / "bert"))


@pytest.fixture(scope="module")
def served(bert, llama_dir, model_dirs, ssd):
    env = {**os.environ, "SLOW_SOURCE": model_dirs["qwen2"]}
    process, port = start([sys.executable, "-c", SLOWED_SERVE, "serve", "--model", f"embed={bert}",
                           "--model", f"llama={llama_dir}", "--model", f"qwen={model_dirs['qwen2']}",
                           "--disk-tier", str(ssd), *FLAGS], env)
    try:
        yield SimpleNamespace(process=process, port=port, client=client(port))
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


def ask_qwen(port: int) -> None:
    """The request whose model loads: the stop cuts it."""
    try:
        client(port).chat.completions.create(model="qwen", messages=CHAT, max_tokens=2)
    except openai.OpenAIError:
        pass


def own_vectors(bert: str) -> np.ndarray:
    """mlx-embeddings' own: its loader, its tokenizer, its model's text_embeds, each text alone."""
    from mlx_embeddings import load

    model, tokenizer = load(bert)
    return np.stack([np.array(model(mx.array([tokenizer.encode(t)])).text_embeds[0]) for t in TEXTS])


def test_embeddings_of_an_encoder_model_equal_mlx_embeddings_own(served, bert):
    api = served.client
    expected = own_vectors(bert)
    batch = api.embeddings.create(model="embed", input=TEXTS)
    assert [d.index for d in batch.data] == [0, 1, 2] and batch.model == "embed"
    np.testing.assert_allclose(np.array([d.embedding for d in batch.data]), expected, atol=1e-5)
    one = api.embeddings.create(model="embed", input=TEXTS[1])
    np.testing.assert_allclose(one.data[0].embedding, expected[1], atol=1e-5)
    cut = api.embeddings.with_raw_response.create(model="embed", input=TEXTS[1], encoding_format="base64",
                                                  dimensions=8).http_response.json()
    got = np.frombuffer(base64.b64decode(cut["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(got, expected[1][:8] / np.linalg.norm(expected[1][:8]), atol=1e-5)
    with pytest.raises(openai.BadRequestError, match="dimensions: 33 is more than the model's 32"):
        api.embeddings.create(model="embed", input="x", dimensions=33)


def test_each_kind_refuses_the_others_endpoint_naming_its_kind(served):
    api = served.client
    with pytest.raises(openai.BadRequestError, match="'llama' is a chat model, not an embedding model"):
        api.embeddings.create(model="llama", input="hi")
    with pytest.raises(openai.BadRequestError, match="'embed' is an embedding model: it serves /v1/embeddings"):
        api.chat.completions.create(model="embed", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert api.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2).choices[0].message.content is not None
    # Operations see the encoder as a model with no pool: loaded, counted, healthy.
    root = str(api.base_url).removesuffix("/v1/")
    with urllib.request.urlopen(root + "/metrics", timeout=10) as r:
        assert 'mlxkv_model_loaded{model="embed"} 1' in r.read().decode()
    with urllib.request.urlopen(root + "/v1/cache/stats", timeout=10) as r:
        embed = json.loads(r.read())["models"]["embed"]
    assert embed["state"] == "loaded" and embed["pool"] is None and embed["bytes"] > 0
    with urllib.request.urlopen(root + "/health", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"


def test_the_process_enforces_a_json_schema_and_a_strict_tool_call(served):
    """Issue 44 through the real process (the structured tests run an in-process Server): the
    grammar compiler and its worker thread start with `mlxkv serve`'s own model loading."""
    from test_server_structured import RESPONSE_FORMAT, SCHEMA, WEATHER, ask

    api = served.client
    reply = api.chat.completions.create(model="llama", messages=ask("Oslo"), max_tokens=60,
                                        response_format=RESPONSE_FORMAT)
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    called = api.chat.completions.create(model="llama", messages=ask("Bergen"), max_tokens=80, tools=[WEATHER],
                                         tool_choice="required")
    [call] = called.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_a_sigterm_while_a_model_loads_leaves_nothing_half_written_and_the_next_start_serves(served, ssd, llama_dir):
    """The file's last test: it stops the process. llama answers a chat (its blocks go to the SSD
    tier as they are computed); qwen starts loading; SIGTERM."""
    first = served.client.chat.completions.create(model="llama", messages=CHAT, max_tokens=8)
    asking = threading.Thread(target=ask_qwen, args=(served.port,))
    asking.start()
    assert wait_for(lambda: states(served.port)["qwen"] == "loading", timeout=30)
    served.process.send_signal(signal.SIGTERM)
    _, err = served.process.communicate(timeout=60)
    asking.join(30)
    assert served.process.returncode == 0, err
    assert "Traceback" not in err and "model qwen: the server stopped while it loaded" in err, err
    assert list(ssd.glob("**/.*.tmp")) == []  # no write in flight was left behind
    logs = list(ssd.glob("*/reply-ids.jsonl"))
    assert logs and all(json.loads(line) for log in logs for line in log.read_text().splitlines())
    with running_server(llama_dir, disk_tier=str(ssd), num_blocks=256) as server:  # the next start
        again = openai_client(server).chat.completions.create(model="llama", messages=CHAT, max_tokens=8)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens // 8 * 8  # from SSD
