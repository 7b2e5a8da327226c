"""The OpenAI API, driven by the official `openai` client against a real server."""

from __future__ import annotations

import threading

import openai
import pytest

from server_support import ScriptedThread, anthropic_client, raw, openai_client
from mlxkv.server.server import Server, ServerOptions


def ask(topic: str) -> list[dict]:
    return [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": f"Tell me about {topic}, and why it matters to people."}]


def test_chat_greedy_answer_equals_engine_chat(server, oracle):
    messages = ask("lighthouses")
    reply = openai_client(server).chat.completions.create(model="anything", messages=messages, max_tokens=24)
    expected = oracle.chat(messages, max_tokens=24)
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == {"length": "length", "stop": "stop"}[expected.finish_reason]
    assert reply.usage.prompt_tokens == len(expected.prompt_tokens)
    assert reply.usage.completion_tokens == len(expected.tokens)
    # Another model's name is served by the loaded model, which says so.
    assert reply.model == server.backend.info.name


def test_completion_greedy_answer_equals_engine_generate(server, oracle):
    prompt = "The harbour at dawn was quiet, and the boats"
    reply = openai_client(server).completions.create(model="x", prompt=prompt, max_tokens=16)
    assert reply.choices[0].text == oracle.generate(prompt, max_tokens=16).text
    ids = oracle.encode(prompt)
    by_ids = openai_client(server).completions.create(model="x", prompt=ids, max_tokens=16)
    assert by_ids.choices[0].text == reply.choices[0].text


def test_streaming_equals_non_streaming(server):
    client = openai_client(server)
    messages = ask("tides")
    whole = client.chat.completions.create(model="x", messages=messages, max_tokens=20)
    chunks = list(client.chat.completions.create(model="x", messages=messages, max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="x", prompt="Ropes and sails", max_tokens=12, stream=True))
    assert streamed == client.completions.create(model="x", prompt="Ropes and sails", max_tokens=12).choices[0].text


def test_follow_up_turn_reuses_the_whole_first_turn(server):
    client = openai_client(server)
    messages = ask("glaciers")
    first = client.chat.completions.create(model="x", messages=messages, max_tokens=20)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 8
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Say more."}]
    second = client.chat.completions.create(model="x", messages=messages, max_tokens=8)
    # The reply came back as text; the server put its generated ids back, so
    # the cache holds through it: every full block of prompt + reply (the
    # last reply token's KV is never computed).
    whole_turn = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == whole_turn // 8 * 8


def test_system_reminder_before_the_newest_turn_keeps_everything_before_it(server):
    client = openai_client(server)
    messages = ask("rivers")
    first = client.chat.completions.create(model="x", messages=messages, max_tokens=16)
    history = messages + [{"role": "assistant", "content": first.choices[0].message.content}]
    reminder = [{"role": "system", "content": "Reminder: the user prefers short answers."}]
    second = client.chat.completions.create(
        model="x", messages=history + reminder + [{"role": "user", "content": "And lakes?"}], max_tokens=4)
    before = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == before // 8 * 8


def test_eight_concurrent_clients_each_get_their_solo_answer(server, oracle):
    topics = ["owls", "bridges", "volcanoes", "bread", "comets", "violins", "deserts", "trains"]
    solo = {t: oracle.chat(ask(t), max_tokens=16).text for t in topics}
    got, errors = {}, []

    def client(topic):
        try:
            reply = openai_client(server).chat.completions.create(model="x", messages=ask(topic), max_tokens=16)
            got[topic] = reply.choices[0].message.content
        except Exception as e:  # reported below, with the topic
            errors.append((topic, e))

    threads = [threading.Thread(target=client, args=(t,)) for t in topics]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and got == solo


def test_stop_strings_cut_the_reply(server, oracle):
    messages = ask("clocks")
    full = oracle.chat(messages, max_tokens=24).text
    stop = full[5:8]
    cut = openai_client(server).chat.completions.create(model="x", messages=messages, max_tokens=24, stop=[stop])
    assert cut.choices[0].message.content == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = openai_client(server).chat.completions.create(model="x", messages=messages, max_tokens=24,
                                                             stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[:full.index(stop)]


def test_a_tool_call_is_parsed_with_mlx_lm_s_parser(llama_dir):
    script = ["Let me check.", "<tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}',
              "</tool_call>", ""]
    thread = ScriptedThread(llama_dir, script)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    with Server(thread, "scripted", ServerOptions(port=0)).start() as server:
        client = openai_client(server)
        reply = client.chat.completions.create(model="x", messages=messages, tools=tools, max_tokens=50)
        stream = list(client.chat.completions.create(model="x", messages=messages, tools=tools, max_tokens=50,
                                                     stream=True))
        plain = client.chat.completions.create(model="x", messages=messages, max_tokens=50)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Oslo"}'
    deltas = [c.choices[0].delta for c in stream if c.choices]
    [streamed_call] = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert streamed_call.function.name == "get_weather" and streamed_call.index == 0
    assert stream[-1].choices[0].finish_reason == "tool_calls"
    # The tools reached the chat template; without tools the text is just text.
    assert b"get_weather" in bytes(thread.engine.tokenizer.decode(thread.submitted[0][0]), "utf-8")
    assert plain.choices[0].message.tool_calls is None and "<tool_call>" in plain.choices[0].message.content


@pytest.mark.slow  # a server and five replies: ~0.8 s
def test_kimi_call_ids_are_unique_per_call_across_turns_and_apis(llama_dir):
    """Kimi's parser gives `functions.name:i` as a call's id, the same every turn: a client that
    keys tool results by id would mix them up. Each call gets its own id, in every API shape."""
    from mlx_lm.tool_parsers import kimi_k2

    call = ('<|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>{"q": "tides"}<|tool_call_end|>'
            '<|tool_call_begin|>functions.lookup:1<|tool_call_argument_begin|>{"q": "moon"}<|tool_call_end|>')
    thread = ScriptedThread(llama_dir, ["<|tool_calls_section_begin|>", call, "<|tool_calls_section_end|>", ""])
    tokenizer = thread.engine.tokenizer  # the llama tokenizer, speaking Kimi's tool calls
    tokenizer._tool_parser, tokenizer._tool_call_start, tokenizer._tool_call_end = (
        kimi_k2.parse_tool_call, kimi_k2.tool_call_start, kimi_k2.tool_call_end)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Tides?"}]
    ids = []
    with Server(thread, "scripted", ServerOptions(port=0)).start() as server:
        client = openai_client(server)
        for _ in range(2):  # two turns
            calls = client.chat.completions.create(model="x", messages=messages, tools=tools,
                                                   max_tokens=9).choices[0].message.tool_calls
            assert [c.function.arguments for c in calls] == ['{"q": "tides"}', '{"q": "moon"}']
            ids += [c.id for c in calls]
        stream = client.chat.completions.create(model="x", messages=messages, tools=tools, max_tokens=9, stream=True)
        ids += [d.id for c in stream if c.choices for d in c.choices[0].delta.tool_calls or [] if d.id]
        message = anthropic_client(server).messages.create(
            model="x", max_tokens=9, messages=messages,
            tools=[{"name": "lookup", "input_schema": {"type": "object"}}])
        ids += [b.id for b in message.content if b.type == "tool_use"]
        response = client.responses.create(model="x", input="Tides?", max_output_tokens=9, tools=[
            {"type": "function", "name": "lookup", "parameters": {"type": "object"}}])
        ids += [item.call_id for item in response.output if item.type == "function_call"]
    assert len(ids) == 10 and len(set(ids)) == 10, ids


def test_models_lists_the_loaded_model(server):
    assert [m.id for m in openai_client(server).models.list()] == [server.backend.info.name]


# A 1x1 PNG: a valid image, for a model without a vision tower.
PNG = {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="}


def test_bad_requests_get_openai_errors(server):
    user = [{"role": "user", "content": "hi"}]
    cases = {
        b"{": "not valid JSON",
        b"[1]": "must be a JSON object",
        b'{"messages": []}': "messages",
        b'{"messages": [{"role": "wizard", "content": "hi"}]}': "messages.0.role",
        b'{"messages": [{"content": "hi"}]}': "messages.0.role",
        b'{"messages": [{"role": "user", "content": 5}]}': "messages.0.content",
        b'{"messages": "hi"}': "messages",
    }
    for body, words in cases.items():
        status, error, _ = raw(server, "POST", "/v1/chat/completions", body)
        assert status == 400 and words in error["error"]["message"], (body, error)
        assert error["error"]["type"] == "invalid_request_error"
    for extra, words in [({"max_tokens": 0}, "max_tokens"),
                         ({"messages": [{"role": "user", "content": "word " * 5000}]}, "the prompt is too long"),
                         ({"temperature": "hot"}, "temperature"), ({"n": 3}, "n"),
                         ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                          "messages.0.content.0: an image part needs a url"),
                         ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": PNG}]}]},
                          "messages.0.content.0: llama takes text only"),
                         # base64 wrapped at 76 (base64.encodebytes) is read: the part gets as far as the model
                         ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
                             "url": PNG["url"][:60] + "\n" + PNG["url"][60:]}}]}]},
                          "messages.0.content.0: llama takes text only"),
                         ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
                          "messages.0.content.0: 'audio' parts are not supported"),
                         # a video beside an image is named, not dropped as empty text
                         ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": PNG},
                                                                     {"type": "video_url", "video_url": PNG}]}]},
                          "messages.0.content.1: 'video_url' parts are not supported")]:
        status, error, _ = raw(server, "POST", "/v1/chat/completions", {"messages": user, **extra})
        assert status == 400 and words in error["error"]["message"], (extra, error)
    status, error, _ = raw(server, "POST", "/v1/completions", {"prompt": [1, 2, 10 ** 6]})
    assert status == 400 and "outside the model's vocabulary" in error["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        openai_client(server).chat.completions.create(model="x", messages=user, max_tokens=0)
    status, error, _ = raw(server, "GET", "/v1/nothing")
    assert status == 404 and "no such endpoint" in error["error"]["message"]
    status, error, _ = raw(server, "GET", "/v1/chat/completions")
    assert status == 405


def test_a_seed_makes_sampling_repeatable(server):
    client = openai_client(server)
    ask_twice = [client.chat.completions.create(model="x", messages=ask("kites"), max_tokens=12, temperature=1.0,
                                                seed=7).choices[0].message.content for _ in range(2)]
    other = client.chat.completions.create(model="x", messages=ask("kites"), max_tokens=12, temperature=1.0,
                                           seed=8).choices[0].message.content
    assert ask_twice[0] == ask_twice[1] != other
