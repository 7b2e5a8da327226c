"""Several models in one real server, through the official clients: names and aliases reach
their models with a single model's output, models load on demand and unload for room or
when idle, an unloaded model's cache comes back from the SSD tier, two models serve side by
side, and a model that fails to load leaves the others serving."""

from __future__ import annotations

import base64
import json
import shutil
import logging
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.host.engine_thread import load_engine
from mlxkv.server.model_specs import NEVER, ModelSpec
from mlxkv.server.server import ModelsOptions, Server, ServerOptions
from server_support import CACHE, anthropic_client, openai_client, raw, wait_for

pytestmark = pytest.mark.slow
STEP_S = 0.05  # the llama's steps are slowed this much, so its streams overlap the qwen's requests
LOAD_S = 0.6  # the qwen's loads are slowed this much
KEEPALIVE_S = 0.2


def ask(topic: str) -> list[dict]:
    return [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": f"Tell me about {topic}, and why it matters to people who live there."}]


def slowed(llama_dir: str, qwen_dir: str, qwen_load_s: float = 0.0):
    """The llama's steps slowed; the qwen's load slowed, so a stream sees keep-alives while it loads."""

    def load(model, cache, report):
        if model == qwen_dir:
            time.sleep(qwen_load_s)
        engine = load_engine(model, cache, report)
        if model == llama_dir:
            step = engine.loop.step

            def slow_step():
                time.sleep(STEP_S)
                return step()

            engine.loop.step = slow_step
        return engine

    return load


@pytest.fixture(scope="module")
def dirs(model_dirs, tmp_path_factory):
    broken = tmp_path_factory.mktemp("broken")
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-family"}))
    embed = tmp_path_factory.mktemp("models") / "embed"  # the tiny qwen2 as a bare model: an embedding model's config
    shutil.copytree(model_dirs["qwen2"], embed)
    config = json.loads((embed / "config.json").read_text())
    (embed / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2Model"]}))
    return {"llama": model_dirs["llama"], "qwen": model_dirs["qwen2"], "broken": str(broken), "embed": str(embed)}


@pytest.fixture(scope="module")
def oracles(dirs):
    with Engine.load(dirs["llama"], CacheConfig(**CACHE)) as llama, Engine.load(dirs["qwen"], CacheConfig(**CACHE)) as qwen:
        yield {"llama": llama, "qwen": qwen}


@pytest.fixture(scope="module")
def fleet(dirs):
    """llama, qwen and a broken model; aliases for Claude Code's two names; idle models unload after 2 s."""
    specs = [ModelSpec("llama", dirs["llama"]), ModelSpec("qwen", dirs["qwen"]), ModelSpec("broken", dirs["broken"]),
             ModelSpec("embed", dirs["embed"])]
    models = ModelsOptions(aliases=[("claude-haiku-*", "qwen"), ("claude-*", "llama")], keep_alive_s=2.0)
    with Server.load_models(specs, CacheConfig(**CACHE), ServerOptions(port=0, keepalive_s=KEEPALIVE_S), models,
                            load=slowed(dirs["llama"], dirs["qwen"], LOAD_S)).start() as server:
        yield server


@pytest.fixture(scope="module")
def one_at_a_time(dirs, tmp_path_factory):
    """--max-loaded 1 with an SSD tier: each switch unloads the other model."""
    specs = [ModelSpec("llama", dirs["llama"]), ModelSpec("qwen", dirs["qwen"])]
    cache = CacheConfig(**CACHE, disk_tier=str(tmp_path_factory.mktemp("ssd")))
    with Server.load_models(specs, cache, ServerOptions(port=0), ModelsOptions(max_loaded=1, keep_alive_s=NEVER),
                            load=slowed(dirs["llama"], dirs["qwen"])).start() as server:
        yield server


def loaded(server) -> dict[str, bool]:
    return {m["id"]: m["loaded"] for m in raw(server, "GET", "/v1/models")[1]["data"]}


def test_each_name_and_alias_reaches_its_model_with_a_single_models_output(fleet, oracles, server):
    assert loaded(fleet) == {"llama": False, "qwen": False, "broken": False, "embed": False}  # loaded on demand
    assert "  model llama: unloaded (" in fleet.startup_line()
    messages = ask("harbours")
    expected = {name: oracles[name].chat(messages, max_tokens=8).text for name in oracles}
    single = openai_client(server).chat.completions.create(model="any", messages=messages, max_tokens=8)
    assert single.choices[0].message.content == expected["llama"]  # a single-model server's, on the same llama
    # A stream opens while its model loads (pings first, then message_start): the client takes it.
    with anthropic_client(fleet).messages.stream(model="claude-haiku-4-5", max_tokens=8, system=messages[0]["content"],
                                                 messages=messages[1:]) as stream:
        assert "".join(stream.text_stream) == expected["qwen"]
    client = openai_client(fleet)
    for requested, name in (("llama", "llama"), ("qwen", "qwen")):
        reply = client.chat.completions.create(model=requested, messages=messages, max_tokens=8)
        assert (reply.model, reply.choices[0].message.content) == (name, expected[name])
        response = client.responses.create(model=requested, input=messages[1]["content"],
                                           instructions=messages[0]["content"], max_output_tokens=8)
        assert (response.model, response.output_text) == (name, expected[name])
    for requested, name in (("claude-haiku-4-5", "qwen"), ("claude-sonnet-4-5", "llama")):
        message = anthropic_client(fleet).messages.create(model=requested, max_tokens=8, system=messages[0]["content"],
                                                          messages=messages[1:])
        assert (message.model, message.content[0].text) == (name, expected[name])
    status, body, _ = raw(fleet, "POST", "/v1/chat/completions", {"model": "gpt-4o", "messages": messages})
    assert status == 404 and "'llama', 'qwen', 'broken', 'embed'" in body["error"]["message"]
    status, body, _ = raw(fleet, "POST", "/v1/messages", {"model": "gpt-4o", "max_tokens": 4, "messages": messages[1:]})
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_two_loaded_models_serve_side_by_side_and_a_broken_one_fails_alone(fleet):
    client = openai_client(fleet)
    client.chat.completions.create(model="qwen", messages=ask("rivers"), max_tokens=1)  # loaded before the race
    done = {}

    def long_llama():
        stream = client.chat.completions.create(model="llama", messages=ask("rivers"), max_tokens=40, stream=True)
        done["llama_text"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        done["llama"] = time.monotonic()

    thread = threading.Thread(target=long_llama)
    thread.start()
    llama = fleet.registry.slot("llama")
    assert wait_for(lambda: llama.state == "loaded" and llama.backend.thread.open_requests == 1)
    client.chat.completions.create(model="qwen", messages=ask("rivers"), max_tokens=4)
    done["qwen"] = time.monotonic()
    status, body, _ = raw(fleet, "POST", "/v1/chat/completions", {"model": "broken", "messages": ask("x")})
    assert status == 500 and "could not be loaded" in body["error"]["message"]
    assert llama.backend.thread.open_requests == 1  # the llama's stream is still going
    thread.join(30)
    assert done["qwen"] < done["llama"] and done["llama_text"]
    assert loaded(fleet)["broken"] is False
    stats = raw(fleet, "GET", "/v1/cache/stats")[1]["models"]
    assert stats["broken"]["state"] == "failed" and "No safetensors" in stats["broken"]["error"]


def test_an_idle_model_unloads_after_its_keep_alive_and_models_shows_it(fleet):
    openai_client(fleet).chat.completions.create(model="qwen", messages=ask("bridges"), max_tokens=2)
    assert loaded(fleet)["qwen"] is True
    assert wait_for(lambda: loaded(fleet)["qwen"] is False, timeout=10)
    stats = raw(fleet, "GET", "/v1/cache/stats")[1]["models"]["qwen"]
    assert stats["unloads"] >= 1 and stats["idle_s"] >= 2
    metrics = raw(fleet, "GET", "/metrics")[1]
    assert 'mlxkv_model_loaded{model="qwen"} 0' in metrics and 'mlxkv_model_unloads_total{model="qwen"}' in metrics
    # Its next stream opens at once: keep-alives while it loads, then the reply.
    status, text, _ = raw(fleet, "POST", "/v1/chat/completions",
                          {"model": "qwen", "messages": ask("bridges"), "max_tokens": 2, "stream": True})
    assert status == 200 and text.startswith(": keep-alive\n\n") and text.endswith("data: [DONE]\n\n")


def test_alternating_under_max_loaded_one_reloads_and_the_cache_comes_back_from_ssd(one_at_a_time, caplog):
    client = openai_client(one_at_a_time)
    messages = ask("the tides") + [{"role": "assistant", "content": "They rise and fall."},
                                   {"role": "user", "content": "Why twice a day?"}]
    first = client.chat.completions.create(model="llama", messages=messages, max_tokens=4)
    client.chat.completions.create(model="qwen", messages=messages, max_tokens=4)
    assert loaded(one_at_a_time) == {"llama": False, "qwen": True}
    with caplog.at_level(logging.INFO, logger="mlxkv.server"):
        again = client.chat.completions.create(model="llama", messages=messages, max_tokens=4)
    assert "model qwen: unloading (to make room for llama)" in caplog.text and "model llama: loaded in" in caplog.text
    assert loaded(one_at_a_time) == {"llama": True, "qwen": False}
    assert again.choices[0].message.content == first.choices[0].message.content
    block = CACHE["block_size"]
    assert again.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // block * block
    assert "from SSD" in caplog.text
    stats = raw(one_at_a_time, "GET", "/v1/cache/stats")[1]["models"]["llama"]
    assert (stats["loads"], stats["unloads"]) == (2, 1) and stats["cached_tokens"]["disk"] > 0


def test_a_model_with_an_open_stream_is_never_unloaded_the_other_model_waits(one_at_a_time):
    client = openai_client(one_at_a_time)
    client.chat.completions.create(model="llama", messages=ask("glaciers"), max_tokens=1)
    llama, done = one_at_a_time.registry.slot("llama"), {}

    def long_llama():
        stream = client.chat.completions.create(model="llama", messages=ask("glaciers"), max_tokens=30, stream=True)
        chunks = [c for c in stream if c.choices]
        done["finish"] = chunks[-1].choices[0].finish_reason
        done["llama"] = time.monotonic()

    thread = threading.Thread(target=long_llama)
    thread.start()
    assert wait_for(lambda: llama.state == "loaded" and llama.backend.thread.open_requests == 1)
    client.chat.completions.create(model="qwen", messages=ask("glaciers"), max_tokens=2)  # waits for the stream
    done["qwen"] = time.monotonic()
    thread.join(30)
    assert done["finish"] == "length" and done["llama"] < done["qwen"]
    assert loaded(one_at_a_time) == {"llama": False, "qwen": True}


def test_embeddings_equal_mlx_lms_last_hidden_state_batched_or_not(fleet, dirs):
    texts = ["a short one", "a somewhat longer text about harbours and boats at dawn", "x"]
    model, tokenizer = mlx_lm_load(dirs["embed"])
    expected = []
    for text in texts:  # each alone, straight through mlx-lm's model class
        last = model.model(mx.array([tokenizer.encode(text)]))[0, -1].astype(mx.float32)
        expected.append(np.array(last / mx.linalg.norm(last)))
    client = openai_client(fleet)
    batch = client.embeddings.create(model="embed", input=texts)
    assert [d.index for d in batch.data] == [0, 1, 2] and batch.model == "embed"
    np.testing.assert_allclose(np.array([d.embedding for d in batch.data]), np.stack(expected), atol=1e-5)
    one = client.embeddings.create(model="embed", input=texts[1], encoding_format="base64", dimensions=8)
    got = np.frombuffer(base64.b64decode(one.data[0].embedding), dtype="<f4") if isinstance(one.data[0].embedding, str) \
        else np.array(one.data[0].embedding)
    np.testing.assert_allclose(got, expected[1][:8] / np.linalg.norm(expected[1][:8]), atol=1e-5)
    status, body, _ = raw(fleet, "POST", "/v1/embeddings", {"model": "llama", "input": "hi"})
    assert status == 400 and "is a chat model" in body["error"]["message"]
    status, body, _ = raw(fleet, "POST", "/v1/messages", {"model": "embed", "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "is an embedding model" in body["error"]["message"]
