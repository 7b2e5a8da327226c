"""Images through `mlxkv serve`, driven by the official openai and anthropic clients."""

import base64
import io
import logging
import time

import anthropic
import openai
import pytest
from vision_cases import make_image

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.server.server import Server, ServerOptions
from mlxkv.vision import compat

pytestmark = pytest.mark.slow  # a server on a vision model
CACHE = dict(block_size=8, num_blocks=512, memory_tier_bytes=0)
N = 6


def _png(seed: int, size: tuple = (112, 84)) -> str:
    out = io.BytesIO()
    make_image(*size, seed=seed).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def server(qwen2_vl_dir):
    # URLs on here (test_image_urls_are_fetched...); the SmolVLM server's default options keep them off
    options = ServerOptions(port=0, max_image_pixels=200 * 200, max_images=2, allow_image_urls=True)
    server = Server.load(str(qwen2_vl_dir), CacheConfig(**CACHE), options).start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def oracle(qwen2_vl_dir):
    with Engine.load(str(qwen2_vl_dir), CacheConfig(**CACHE)) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _expected(oracle, seed: int, text: str = "What is it?") -> str:
    messages = [{"role": "user", "content": [{"type": "image", "image": make_image(seed=seed)},
                                             {"type": "text", "text": text}]}]
    return oracle.chat(messages, max_tokens=N).text


def _openai_messages(seed: int, text: str = "What is it?"):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                             + _png(seed)}},
                                         {"type": "text", "text": text}]}]


def test_openai_chat_with_an_image_and_the_next_request_hits_it(client, oracle, caplog):
    caplog.set_level(logging.INFO, logger="mlxkv.server.access")
    first = client.chat.completions.create(model="m", messages=_openai_messages(1), max_tokens=N, temperature=0)
    assert first.choices[0].message.content == _expected(oracle, 1)
    again = client.chat.completions.create(model="m", messages=_openai_messages(1), max_tokens=N, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (first.usage.prompt_tokens - 1) // CACHE["block_size"] * CACHE["block_size"]
    lines = []
    for _ in range(100):  # the access line is written once the response has gone out: wait for it
        lines = [r.getMessage() for r in caplog.records if "/v1/chat/completions 200" in r.getMessage()]
        if len(lines) >= 2:
            break
        time.sleep(0.05)
    assert "image_tokens=12 image_cached=0 " in lines[-2] and "image_tokens=12 image_cached=12 " in lines[-1]


def test_openai_broken_image_is_a_400_naming_the_part(client):
    bad = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(openai.BadRequestError, match=r"messages\.0\.content\.1: not an image we can read"):
        client.chat.completions.create(model="m", messages=bad, max_tokens=N)


def test_anthropic_image_blocks(server, oracle):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png(2)}}
    reply = client.messages.create(model="m", max_tokens=N, messages=[  # the server samples greedily by default
        {"role": "user", "content": [block, {"type": "text", "text": "What is it?"}]}])
    assert reply.content[0].text == _expected(oracle, 2)
    shot = [{"role": "user", "content": "Look."}, {"role": "assistant", "content": [  # an agent's screenshot
        {"type": "tool_use", "id": "t", "name": "shot", "input": {}}]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [block]}]}]
    reply = client.messages.create(model="m", max_tokens=1, messages=shot, tools=[
        {"name": "shot", "description": "a screenshot", "input_schema": {"type": "object"}}])
    assert reply.usage.model_dump()["image_tokens"] > 0
    broken = {**block, "source": {**block["source"], "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.0\.content\.0: not an image we can read"):
        client.messages.create(model="m", max_tokens=N, messages=[{"role": "user", "content": [broken]}])


def test_responses_input_image(client, oracle):
    reply = client.responses.create(model="m", max_output_tokens=N, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64," + _png(3)},
                                     {"type": "input_text", "text": "What is it?"}]}])
    assert reply.output_text == _expected(oracle, 3)


def test_the_image_limits_are_400s_naming_the_part(client):
    big = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + _png(1, (300, 300))}}]
    with pytest.raises(openai.BadRequestError, match=r"messages\.0\.content\.0: .*300x300 pixels, more than the "
                                                     r"limit of 40000"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": big}], max_tokens=N)
    three = _openai_messages(1)[0]["content"][:1] * 3
    with pytest.raises(openai.BadRequestError, match=r"messages\.0\.content\.2: more than 2 images"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": three}], max_tokens=N)


def test_an_image_processor_refusal_is_a_400_naming_the_parts(client, monkeypatch):
    """A limit of one family's processor that load_image does not know of (Qwen's aspect ratio was one)."""
    def refuse(*args, **kwargs):
        raise ValueError("Failed to process inputs with error: a limit")

    monkeypatch.setattr(compat, "prepare_inputs", refuse)
    with pytest.raises(openai.BadRequestError, match=r"messages\.0\.content\.0: the model's image processor "
                                                     r"refused these images: .*a limit"):
        client.chat.completions.create(model="m", messages=_openai_messages(1), max_tokens=N)


def test_the_encoder_cache_is_in_cache_stats_and_metrics(server, client):
    import json
    import urllib.request

    client.chat.completions.create(model="m", messages=_openai_messages(4), max_tokens=1, temperature=0)
    client.chat.completions.create(model="m", messages=_openai_messages(4, "Again?"), max_tokens=1, temperature=0)
    with urllib.request.urlopen(server.url + "/v1/cache/stats", timeout=60) as r:
        stats = json.loads(r.read())["encoder_cache"]
    assert stats["hits"] >= 1 and stats["misses"] >= 1 and stats["bytes"] > 0
    with urllib.request.urlopen(server.url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    assert "mlxkv_encoder_cache_hits_total " in text and "mlxkv_encoder_cache_bytes " in text


def test_image_urls_are_fetched_behind_allow_image_urls(client, oracle, tmp_path):
    """The module's server has --allow-image-urls; the SmolVLM test's server, without it, refuses URLs."""
    import functools
    import http.server
    import threading

    make_image(seed=5).save(tmp_path / "a.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    images = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=images.serve_forever, args=(0.02,), daemon=True).start()  # shutdown() waits a poll
    url = f"http://127.0.0.1:{images.server_address[1]}/a.png"
    try:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "What is it?"}]}]
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=N, temperature=0)
        assert reply.choices[0].message.content == _expected(oracle, 5)
        messages[0]["content"][0]["image_url"]["url"] = url.replace("a.png", "missing.png")
        with pytest.raises(openai.BadRequestError, match=r"messages\.0\.content\.0: could not fetch the image"):
            client.chat.completions.create(model="m", messages=messages, max_tokens=N)
    finally:
        images.shutdown()


def test_a_tiled_family_served_counts_image_tokens_in_every_api_and_the_cache_stats(smolvlm_dir):
    """SmolVLM (tiles plus a global view) through the server: replies equal the engine's (itself equal
    to mlx-vlm's generate, tests/vision/test_vision_engine.py); each API's usage has the image tokens
    and how many of them were cached; /v1/cache/stats and /metrics add them up."""
    import json
    import urllib.request

    with Engine.load(str(smolvlm_dir), CacheConfig(**CACHE)) as oracle:
        messages = [{"role": "user", "content": [{"type": "image", "image": make_image(seed=7)},
                                                 {"type": "text", "text": "What is it?"}]}]
        expected = oracle.chat(messages, max_tokens=N)
    images = expected.stats.image_tokens
    assert images > 4 * 4 and expected.stats.cached_image_tokens == 0  # 4 tiles and a global view, 4 tokens each
    server = Server.load(str(smolvlm_dir), CacheConfig(**CACHE), ServerOptions(port=0)).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        first, again = (client.chat.completions.create(model="m", messages=_openai_messages(7), max_tokens=N,
                                                       temperature=0) for _ in range(2))
        assert first.choices[0].message.content == again.choices[0].message.content == expected.text
        url = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
        with pytest.raises(openai.BadRequestError, match=r"messages\.0\.content\.0: image URLs are off on this server"):
            client.chat.completions.create(model="m", messages=url, max_tokens=N)  # ServerOptions' default
        details = [r.usage.prompt_tokens_details.model_dump() for r in (first, again)]
        assert [(d["image_tokens"], d["cached_image_tokens"]) for d in details] == [(images, 0), (images, images)]
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png(7)}}
        reply = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120).messages.create(
            model="m", max_tokens=N, messages=[{"role": "user", "content": [block, {"type": "text", "text": "What is it?"}]}])
        assert reply.content[0].text == expected.text
        usage = reply.usage.model_dump()
        assert (usage["image_tokens"], usage["cached_image_tokens"]) == (images, images)
        assert usage["cache_read_input_tokens"] > 0
        response = client.responses.create(model="m", max_output_tokens=N, temperature=0, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64," + _png(7)},
                                         {"type": "input_text", "text": "What is it?"}]}])
        details = response.usage.input_tokens_details.model_dump()
        assert (details["image_tokens"], details["cached_image_tokens"]) == (images, images)
        with urllib.request.urlopen(server.url + "/v1/cache/stats", timeout=60) as r:
            stats = json.loads(r.read())["encoder_cache"]
        assert (stats["image_tokens"], stats["cached_image_tokens"]) == (4 * images, 3 * images)
        with urllib.request.urlopen(server.url + "/metrics", timeout=60) as r:
            text = r.read().decode()
        assert f"mlxkv_image_tokens_total {4 * images}\n" in text
        assert f"mlxkv_cached_image_tokens_total {3 * images}\n" in text
    finally:
        server.close()


def _mlx_vlm_text(path, messages: list[dict], images: list, max_tokens: int) -> str:
    """mlx-vlm's own greedy reply, loaded by its own loader and decoded by its tokenizer."""
    from mlx_vlm.generate.dispatch import stream_generate

    from mlxkv.vision import compat

    model, processor = compat.load(str(path))
    prompt = compat.render_chat(processor, messages)
    tokens = [r.token for r in stream_generate(model, processor, prompt, image=images, max_tokens=max_tokens,
                                               temperature=0.0)][:max_tokens]
    return processor.tokenizer.decode(tokens)


@pytest.fixture(scope="module")
def gemma3_server(gemma3_dir):
    server = Server.load(str(gemma3_dir), CacheConfig(**CACHE), ServerOptions(port=0)).start()
    try:
        yield server
    finally:
        server.close()


def test_gemma3_served_equals_mlx_vlm_and_its_next_turn_hits_the_first(gemma3_dir, gemma3_server):
    """Gemma 3 (a fixed run of image tokens between <start_of_image> and <end_of_image>, sliding layers)
    through the openai client: the reply is mlx-vlm's generate's; the next turn, the same image in its
    history, has the first turn's prompt cached; an anthropic image block gets the same reply."""
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    expected = _mlx_vlm_text(gemma3_dir, question, [make_image(seed=1)], N)
    client = openai.OpenAI(base_url=gemma3_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    first = client.chat.completions.create(model="m", messages=_openai_messages(1), max_tokens=N, temperature=0)
    assert first.choices[0].message.content == expected
    turn = _openai_messages(1) + [{"role": "assistant", "content": expected},
                                  {"role": "user", "content": "And in more words?"}]
    second = client.chat.completions.create(model="m", messages=turn, max_tokens=N, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // CACHE["block_size"] * CACHE["block_size"]
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png(1)}}
    reply = anthropic.Anthropic(base_url=gemma3_server.url, api_key="none", max_retries=0, timeout=120).messages.create(
        model="m", max_tokens=N, messages=[{"role": "user", "content": [block, {"type": "text", "text": "What is it?"}]}])
    assert reply.content[0].text == expected
